"""Where the database is, how connections are set up, and schema migrations (Alembic, configured here
in Python: no alembic.ini, so `laneplay db upgrade` and the app work from any directory).

SQLite connections get, on every connect: a busy timeout (writers wait instead of failing with
"database is locked"), foreign keys on, WAL (readers never block the writer) and synchronous=FULL
(a committed transaction survives a crash of the process or the machine). Write transactions start
with BEGIN IMMEDIATE: they take the write lock up front, so two writers never both read and then
deadlock on upgrading to write (SQLITE_BUSY that no timeout can cure).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

BUSY_TIMEOUT_MS = 30_000
MIGRATIONS = Path(__file__).parent / "migrations"
WRITE = {"laneplay_write": True}  # execution option: begin with BEGIN IMMEDIATE


def data_dir() -> Path:
    """Where the app keeps its files: $LANEPLAY_DATA_DIR, default ./data."""
    return Path(os.environ.get("LANEPLAY_DATA_DIR") or "data")


def database_url(url: str | None = None) -> str:
    """`url`, else $LANEPLAY_DATABASE_URL, else a SQLite file in $LANEPLAY_DATA_DIR (default ./data)."""
    if url:
        return url
    if os.environ.get("LANEPLAY_DATABASE_URL"):
        return os.environ["LANEPLAY_DATABASE_URL"]
    return f"sqlite:///{(data_dir() / 'laneplay.db').resolve()}"


def _on_connect(dbapi_conn, _record) -> None:
    dbapi_conn.isolation_level = None  # the driver's implicit BEGIN is replaced by _on_begin
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")  # first: the WAL switch below may wait
    cur.execute("PRAGMA foreign_keys = ON")
    cur.execute("PRAGMA journal_mode = WAL")
    cur.execute("PRAGMA synchronous = FULL")
    cur.close()


def _on_begin(conn) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("laneplay_write") else "BEGIN")


def make_engine(url: str | None = None) -> Engine:
    url = make_url(database_url(url))
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if url.database in (None, "", ":memory:"):
        # One shared connection, or every session would see its own empty database.
        engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
    else:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
    event.listen(engine, "connect", _on_connect)
    event.listen(engine, "begin", _on_begin)
    return engine


# Alembic is imported where it is used: processes that only read and write skip its import time.
def alembic_config():
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def head() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _migrate(engine: Engine, action: str, revision: str) -> str | None:
    """One write transaction: concurrent starts of the app take turns, and a failed migration leaves
    the previous schema in place (SQLite has transactional DDL)."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    from sqlalchemy.exc import OperationalError

    cfg = alembic_config()
    for attempt in range(5):
        try:
            with engine.execution_options(**WRITE).begin() as conn:
                cfg.attributes["connection"] = conn
                getattr(command, action)(cfg, revision)
                return MigrationContext.configure(conn).get_current_revision()
        except OperationalError as e:
            # SQLite can answer "locked" without waiting out the busy timeout while several fresh
            # connections switch the file to WAL at once; the transaction rolled back whole: try again.
            if "database is locked" not in str(e) or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))


def upgrade_engine(engine: Engine, revision: str = "head") -> str | None:
    return _migrate(engine, "upgrade", revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _on(url: str | None, fn, *args):
    engine = make_engine(url)
    try:
        return fn(engine, *args)
    finally:
        engine.dispose()


def upgrade(url: str | None = None, revision: str = "head") -> str | None:
    """Brings the database at `url` (default: see database_url) to `revision`; returns the revision."""
    return _on(url, _migrate, "upgrade", revision)


def downgrade(url: str | None, revision: str) -> str | None:
    return _on(url, _migrate, "downgrade", revision)


def current(url: str | None = None) -> str | None:
    return _on(url, current_revision)
