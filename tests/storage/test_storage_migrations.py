"""Alembic: upgrade from empty and from the previous revision; the migrated schema is the ORM's."""
import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from laneplay import storage
from laneplay.storage import OPERATOR, Store
from laneplay.storage.db import alembic_config, make_engine
from laneplay.storage.models import Base

TABLES = {"sessions", "generations", "comparisons", "sample_results", "passk", "share_links"}


def schema_diff(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            mc = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            return compare_metadata(mc, Base.metadata)
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_history_is_linear_with_two_revisions():
    script = ScriptDirectory.from_config(alembic_config())
    assert script.get_heads() == [storage.head()] == ["0007"]
    assert [r.revision for r in script.walk_revisions()] == ["0007", "0006", "0005", "0004", "0003", "0002", "0001"]


def test_upgrade_empty_database_to_head(db_url):
    assert storage.current(db_url) is None
    assert storage.upgrade(db_url) == "0007"
    assert storage.current(db_url) == "0007"
    assert tables(db_url) == TABLES
    assert schema_diff(db_url) == []
    assert storage.upgrade(db_url) == "0007"  # idempotent


def test_upgrade_from_previous_revision_keeps_data(db_url):
    assert storage.upgrade(db_url, "0001") == "0001"
    assert tables(db_url) == TABLES - {"share_links"}
    diff = schema_diff(db_url)  # the comparison does see a schema that is behind
    assert [(d[0], d[1].name) for d in diff if d[0] == "add_table"] == [("add_table", "share_links")]
    sid = "S" * 22  # rows as the 0001 code wrote them (today's ORM knows newer columns)
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO sessions (id, created_at, updated_at, title, model, device, world_size, "
                          "columns, code, instruction, params) VALUES (:id, '2026-01-01 00:00:00', "
                          "'2026-01-01 00:00:00', 'made before share links existed', '', '', 1, 1, 'x = 1', '', '{}')"),
                     {"id": sid})
        conn.execute(text("INSERT INTO generations (session_id, batch, sample_index, created_at, text, "
                          "prompt_tokens, completion_tokens) VALUES (:id, 1, 0, '2026-01-01 00:00:00', 'y', 1, 1)"),
                     {"id": sid})
    engine.dispose()

    with Store(db_url) as s:  # opening the store upgrades
        assert storage.current(db_url) == "0007"
        assert s.get_session(sid, owner=OPERATOR)["title"] == "made before share links existed"
        token, _ = s.share_session(sid, owner=OPERATOR)
        assert s.get_shared(token)["generations"][0]["text"] == "y"
    assert schema_diff(db_url) == []


def test_upgrade_from_0002_gives_sessions_no_owner(db_url):
    assert storage.upgrade(db_url, "0002") == "0002"
    sid = "T" * 22
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO sessions (id, created_at, updated_at, title, model, device, world_size, "
                          "columns, code, instruction, params) VALUES (:id, '2026-01-01 00:00:00', "
                          "'2026-01-01 00:00:00', 'before owners', '', '', 1, 1, '', '', '{}')"), {"id": sid})
    engine.dispose()
    with Store(db_url) as s:
        assert storage.current(db_url) == "0007"
        assert s.get_session(sid, owner=OPERATOR)["title"] == "before owners"
        assert s.list_sessions(owner="o" * 43) == [] and [x["id"] for x in s.list_sessions(owner=OPERATOR)] == [sid]
    assert schema_diff(db_url) == []


def test_downgrade(db_url):
    storage.upgrade(db_url)
    assert storage.downgrade(db_url, "0002") == "0002"
    assert storage.downgrade(db_url, "0001") == "0001"
    assert tables(db_url) == TABLES - {"share_links"}
    engine = make_engine(db_url)
    with engine.connect() as conn:  # the trigger went with its table
        assert conn.execute(text("SELECT count(*) FROM sqlite_master WHERE type = 'trigger'")).scalar_one() == 0
    engine.dispose()
    assert storage.downgrade(db_url, "base") is None
    assert tables(db_url) == set()
    assert storage.upgrade(db_url) == "0007" and schema_diff(db_url) == []


def test_concurrent_upgrades_take_turns(db_url):
    # Several app processes starting at once on a fresh database: each upgrade is one BEGIN IMMEDIATE
    # transaction, so one migrates and the others find the schema already at head.
    errors, done = [], []

    def up():
        try:
            done.append(storage.upgrade(db_url))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=up) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and done == ["0007"] * 4
    assert schema_diff(db_url) == []


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_in_memory_upgrade(url):
    with Store(url) as s:
        assert s.list_sessions(owner=OPERATOR) == []
