"""Fixtures for the job/worker integration tests: a fresh migrated PostgreSQL database per test
(cloned from a migrated template), a Celery queue of its own on the shared Redis, and real Celery worker processes running the
fake render. The helpers live in jobs_harness.py (importable by the tests; conftest is not).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jobs_harness import (  # noqa: E402
    PG_HOST,
    REDIS_URL,
    JobsEnv,
    admin_engine,
    drop_queue,
    make_env,
    settings_from_env,
)

from worker.jobs.db import make_engine, migrate  # noqa: E402
from worker.jobs.store import JobStore  # noqa: E402


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A database migrated to head once per session; each test clones it (fast)."""
    name = f"jobs_tpl_{os.getpid()}"
    try:
        admin = admin_engine()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
            c.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # pragma: no cover - no server
        pytest.skip(f"PostgreSQL not reachable at {PG_HOST}: {exc}")
    migrate(f"{PG_HOST}/{name}")
    yield name
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    name = f"jobs_t_{uuid.uuid4().hex[:12]}"
    admin = admin_engine()
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"'))
    yield f"{PG_HOST}/{name}"
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def jobs_env(tmp_path: Path, pg_url: str) -> Iterator[JobsEnv]:
    env = make_env(tmp_path, pg_url, REDIS_URL)
    settings = settings_from_env(env)
    engine = make_engine(pg_url)
    je = JobsEnv(
        tmp=tmp_path, settings=settings, env=env, store=JobStore(engine, max_attempts=settings.max_attempts)
    )
    try:
        yield je
    finally:
        for w in je.workers:
            w.stop()
        engine.dispose()
        drop_queue(REDIS_URL, settings.queue_name)
