"""Fixtures for the storage tests: a fresh SQLite file per test."""
import pytest

from storage import Store


@pytest.fixture
def db_url(tmp_path):
    return f"sqlite:///{tmp_path / 'laneplay.db'}"


@pytest.fixture
def store(db_url):
    s = Store(db_url)
    yield s
    s.close()
