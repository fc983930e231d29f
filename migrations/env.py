"""Alembic environment: binds migrations to the ORM metadata in worker/jobs/tables.py.

The URL comes from, in order: a connection the caller put in ``config.attributes["connection"]``
(tests), ``sqlalchemy.url`` set on the config (``longtake migrate``), or ``Settings().database_url``.
SQLite runs in batch mode (ALTER TABLE support).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from worker.jobs.db import make_engine
from worker.jobs.tables import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from worker.settings import Settings

    return Settings().database_url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, dialect_opts={"paramstyle": "named"}
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:
        _run(conn)
        return
    engine = make_engine(_url())
    try:
        with engine.begin() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
