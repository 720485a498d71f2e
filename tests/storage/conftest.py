"""Fixtures for the storage tests: a fresh SQLite file per test."""
import sys
from pathlib import Path

import pytest

# Spawned child processes import their target by module name: `storage_workers` is found on this
# folder's path entry (the tests run with the repository root off sys.path).
sys.path.insert(0, str(Path(__file__).parent))

from laneplay.storage import Store


@pytest.fixture
def db_url(tmp_path):
    return f"sqlite:///{tmp_path / 'laneplay.db'}"


@pytest.fixture
def store(db_url):
    s = Store(db_url)
    yield s
    s.close()
