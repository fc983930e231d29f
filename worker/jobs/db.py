"""Engine creation and the bounded retry every JobStore operation runs under.

Who calls: entry points (CLI, Celery worker start, API factory) call :func:`make_engine` once per
process with ``Settings.database_url`` and hand the engine to :class:`worker.jobs.store.JobStore`.
Engines must not be created at import time, and must not cross a ``fork`` (the render child is
spawned, and never touches the database).

Connection loss (a PostgreSQL restart, a network blip) surfaces as ``OperationalError`` /
``InterfaceError`` or a DBAPI error with ``connection_invalidated``; :class:`DbRetry` retries those
with exponential back-off, a bounded number of times (the API: a few tries, then 503) or for a
bounded time (``max_s``: a worker rides out an outage of up to ``Settings.db_outage_max_s`` with
its render going on). Every JobStore operation is written to be safe to repeat after an unknown
outcome (the commit may have landed before the connection died).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def make_engine(url: str, *, pool_size: int = 5) -> Engine:
    """An engine with ``pool_pre_ping`` (drops connections a server restart killed) and, for
    SQLite, WAL + a busy timeout + foreign keys so the embedded default behaves like a server."""
    if url.startswith("sqlite"):
        engine = create_engine(url, pool_pre_ping=True, connect_args={"timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_recycle=1800,
        # a dead server must not hang a heartbeat for minutes
        connect_args={"connect_timeout": 5} if url.startswith("postgresql") else {},
    )


def is_connection_error(exc: BaseException) -> bool:
    """True for errors that mean 'the connection or server went away', worth retrying."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


class DbRetry:
    """Runs a callable, retrying connection errors with exponential back-off (capped at
    ``max_wait_s``): ``attempts`` tries, or with ``max_s`` as many as fit in ``max_s`` seconds."""

    def __init__(self, attempts: int = 8, max_wait_s: float = 4.0, *, max_s: float | None = None) -> None:
        self.attempts = attempts
        self.max_wait_s = max_wait_s
        self.max_s = max_s

    def __call__(self, fn: Callable[[], T], *, what: str) -> T:
        def _log(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "database connection error during %s (try %d of %s), retrying: %s",
                what,
                state.attempt_number,
                self.attempts if self.max_s is None else f"{self.max_s:g} s",
                exc,
            )

        retrying = Retrying(
            retry=retry_if_exception(is_connection_error),
            stop=stop_after_attempt(self.attempts) if self.max_s is None else stop_after_delay(self.max_s),
            wait=wait_exponential(multiplier=0.1, max=self.max_wait_s),
            before_sleep=_log,
            reraise=True,
        )
        return retrying(fn)


def alembic_config(url: str) -> Any:
    """An Alembic ``Config`` for ``migrations/`` bound to ``url`` (no alembic.ini needed, so it
    works from an installed package as well as a checkout)."""
    from pathlib import Path

    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).resolve().parents[2] / "migrations"))
    # '%' would be read as interpolation by ConfigParser
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision`` (``longtake migrate`` calls this)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)
