"""Migrations: one head; upgrade from empty and downgrade to empty on PostgreSQL and SQLite; the ORM
matches the migrated schema (autogenerate finds nothing to do); the status view exists."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from jobs_harness import PG_HOST, admin_engine
from sqlalchemy import inspect, text

from worker.jobs.db import alembic_config, make_engine
from worker.jobs.tables import VIEW_NAME, Base

pytestmark = pytest.mark.integration


@pytest.fixture
def empty_pg() -> Iterator[str]:
    name = f"jobs_mig_{uuid.uuid4().hex[:10]}"
    admin = admin_engine()
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    yield f"{PG_HOST}/{name}"
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def test_single_head() -> None:
    heads = ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()
    assert len(heads) == 1, heads


def _user_objects(url: str) -> tuple[set[str], set[str]]:
    engine = make_engine(url)
    try:
        insp = inspect(engine)
        return set(insp.get_table_names()) - {"alembic_version"}, set(insp.get_view_names())
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_upgrade_matches_orm_and_downgrade_to_empty(backend: str, empty_pg: str, tmp_path: Path) -> None:
    url = empty_pg if backend == "postgresql" else f"sqlite:///{tmp_path / 'm.db'}"
    cfg = alembic_config(url)
    command.upgrade(cfg, "head")
    tables, views = _user_objects(url)
    assert tables == {"jobs", "segments"} and views == {VIEW_NAME}
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diffs = compare_metadata(ctx, Base.metadata)
            assert diffs == [], diffs
            cols = [r[0] for r in conn.execute(text(f"SELECT * FROM {VIEW_NAME} LIMIT 0")).cursor.description]
            assert cols[:3] == ["job_id", "tenant", "status"] and "segments_committed" in cols
    finally:
        engine.dispose()
    command.downgrade(cfg, "base")
    assert _user_objects(url) == (set(), set())
    command.upgrade(cfg, "head")  # and back up again: downgrade left nothing behind
    assert _user_objects(url)[0] == {"jobs", "segments"}
