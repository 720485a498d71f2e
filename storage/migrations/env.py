"""Alembic environment. Configured from Python by storage.db (no alembic.ini): the caller passes an
open connection in `config.attributes["connection"]`, so migrations run with the same PRAGMAs and
inside the same transaction as the rest of the storage layer."""
from alembic import context

from laneplay.storage.db import WRITE, database_url, make_engine
from laneplay.storage.models import Base

config = context.config
target_metadata = Base.metadata


def run(connection) -> None:
    # render_as_batch: SQLite cannot ALTER most things; batch mode rebuilds the table instead.
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():  # `--sql`: print the DDL instead of running it
    context.configure(url=database_url(config.get_main_option("sqlalchemy.url")),
                      target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif config.attributes.get("connection") is not None:
    run(config.attributes["connection"])
else:
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    with engine.execution_options(**WRITE).connect() as conn:
        run(conn)
    engine.dispose()
