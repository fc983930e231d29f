"""ORM tables (SQLAlchemy 2 typed declarative): ``jobs`` and ``segments``.

Only :mod:`worker.jobs.store` reads and writes these; everything else goes through ``JobStore``. The
schema is created by the Alembic migrations in ``migrations/`` (never ``create_all`` outside tests of
SQLite embedded mode); ``tests/integration/test_jobs_migrations.py`` checks the two agree.

The read-only view ``longtake_jobs_v`` (created by the migration, documented in docs/jobs.md) is the
stable interface for users who poll status in SQL; these tables may change between releases.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled")
VIEW_NAME = "longtake_jobs_v"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class JobRow(Base):
    """One render job. ``status`` moves queued -> running -> succeeded | failed | cancelled, and back
    to queued when a lease expires (reaper) or a retryable error ends an attempt."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(
            "status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')", name="status_valid"
        ),
        CheckConstraint("attempts >= 0 AND max_attempts >= 1", name="attempts_valid"),
        UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
        # the reaper scans running jobs by lease expiry; listing is per tenant, newest first
        Index("ix_jobs_status_lease_expires_at", "status", "lease_expires_at"),
        Index("ix_jobs_tenant_created_at", "tenant", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    priority: Mapped[int] = mapped_column(Integer, default=5)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)

    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer)
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_token: Mapped[str | None] = mapped_column(String(36))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)

    progress_chunks: Mapped[int] = mapped_column(Integer, default=0)
    num_chunks: Mapped[int | None] = mapped_column(Integer)
    progress_frames: Mapped[int] = mapped_column(Integer, default=0)
    num_frames: Mapped[int | None] = mapped_column(Integer)
    progress_s: Mapped[float] = mapped_column(Float, default=0.0)
    # when the job last moved: its current attempt started, a chunk was committed or more frames
    # were rendered (heartbeats alone do not move it, unlike updated_at); NULL before the first claim
    progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    queued_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    outputs: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    outputs_partial: Mapped[bool] = mapped_column(Boolean, default=False)
    # opaque delivery state (e.g. an in-progress multipart upload) the sink needs to resume
    delivery_state: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # the outbox mark of a queued job: when its Celery message was last sent; NULL = not sent yet
    # (the broker was down at submit). The sweeper (worker.jobs.reaper) publishes NULL rows and
    # republishes rows whose message is no longer in the broker.
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # live sessions (issue 13; NULL for a job with an audio file): what the worker reports of the
    # session (end reason, audio and inserted silence seconds, per-chunk delay), and when its one
    # WebSocket sender connected (the API claims it with a conditional UPDATE: one sender, ever)
    session_state: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    audio_opened_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class SegmentRow(Base):
    """One committed output fragment of a job, written under the job's lease (fenced)."""

    __tablename__ = "segments"
    __table_args__ = (CheckConstraint("idx >= 0 AND nbytes >= 0", name="segment_valid"),)

    job_id: Mapped[str] = mapped_column(
        String(36), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(1024))
    nbytes: Mapped[int] = mapped_column(BigInteger)
    duration_s: Mapped[float] = mapped_column(Float)
    checksum: Mapped[str] = mapped_column(String(64))
    state_key: Mapped[str | None] = mapped_column(String(1024))
    first_frame: Mapped[int] = mapped_column(Integer)
    num_frames: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    committed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


# The stable read-only view (same SQL on PostgreSQL and SQLite). Columns are only ever added.
VIEW_SQL = f"""
CREATE VIEW {VIEW_NAME} AS
SELECT
    j.id AS job_id,
    j.tenant AS tenant,
    j.status AS status,
    j.priority AS priority,
    j.attempts AS attempts,
    j.max_attempts AS max_attempts,
    j.cancel_requested AS cancel_requested,
    j.progress_chunks AS chunks_done,
    j.num_chunks AS num_chunks,
    j.progress_frames AS frames_done,
    j.num_frames AS num_frames,
    j.progress_s AS seconds_done,
    j.error_code AS error_code,
    j.error_message AS error_message,
    j.outputs AS outputs,
    j.outputs_partial AS outputs_partial,
    j.created_at AS created_at,
    j.started_at AS started_at,
    j.finished_at AS finished_at,
    j.updated_at AS updated_at,
    (SELECT count(*) FROM segments s WHERE s.job_id = j.id) AS segments_committed,
    j.progress_at AS progress_at,
    j.session_state AS session
FROM jobs j
"""
