"""What the job store hands out: job snapshots, leases, progress (plain, immutable data).

Who calls what: :class:`worker.jobs.store.JobStore` builds these from rows (:func:`record_of`); the
API turns a :class:`JobRecord` into its wire view, the task holds a :class:`Lease` for one attempt
and reports :class:`Progress` with its heartbeats. The segment record is
:class:`worker.delivery.segment.SegmentRecord` (the delivery makes it, the store keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, overload

from pydantic import BaseModel, ConfigDict

from worker.jobs.tables import JobRow
from worker.spec import STORED_KEY, JobSpec

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


@dataclass(frozen=True)
class Lease:
    """Proof of a claim. ``token`` fences every write; ``attempt`` is the 1-based claim count."""

    job_id: str
    owner: str
    token: str
    attempt: int
    lease_s: float
    expires_at: datetime


@dataclass(frozen=True)
class Progress:
    """Progress reported with a heartbeat (per chunk, from the render child)."""

    chunks_done: int
    num_chunks: int | None = None
    frames_done: int = 0
    num_frames: int | None = None
    # a live session's report (worker.jobs.session.SessionFeeder.report): replaces jobs.session_state
    session: dict[str, object] | None = None


class JobRecord(BaseModel):
    """A snapshot of one job row (the lease token is deliberately not included)."""

    model_config = ConfigDict(frozen=True)

    id: str
    tenant: str
    status: JobStatus
    spec: JobSpec
    priority: int
    idempotency_key: str | None
    attempts: int
    max_attempts: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    cancel_requested: bool
    chunks_done: int
    num_chunks: int | None
    frames_done: int
    num_frames: int | None
    seconds_done: float
    progress_at: datetime | None
    created_at: datetime
    queued_at: datetime
    started_at: datetime | None
    updated_at: datetime
    finished_at: datetime | None
    error_code: str | None
    error_message: str | None
    outputs: dict[str, str]
    outputs_partial: bool
    # live sessions only (None otherwise): the worker's report (end_reason, audio_s, silence_s,
    # chunk delays; see docs/sessions.md) and when the WebSocket sender connected
    session_state: dict[str, object] | None = None
    audio_opened_at: datetime | None = None


@overload
def aware(dt: datetime) -> datetime: ...
@overload
def aware(dt: datetime | None) -> datetime | None: ...
def aware(dt: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; everything we store is UTC
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=UTC)
    return dt


def record_of(row: JobRow) -> JobRecord:
    return JobRecord(
        id=row.id,
        tenant=row.tenant,
        status=row.status,  # type: ignore[arg-type]
        # the row's spec as submitted: options a newer family refuses fail the render, not the read
        spec=JobSpec.model_validate(row.spec, context={STORED_KEY: True}),
        priority=row.priority,
        idempotency_key=row.idempotency_key,
        attempts=row.attempts,
        max_attempts=row.max_attempts,
        lease_owner=row.lease_owner,
        lease_expires_at=aware(row.lease_expires_at),
        cancel_requested=row.cancel_requested,
        chunks_done=row.progress_chunks,
        num_chunks=row.num_chunks,
        frames_done=row.progress_frames,
        num_frames=row.num_frames,
        seconds_done=row.progress_s,
        progress_at=aware(row.progress_at),
        created_at=aware(row.created_at),
        queued_at=aware(row.queued_at),
        started_at=aware(row.started_at),
        updated_at=aware(row.updated_at),
        finished_at=aware(row.finished_at),
        error_code=row.error_code,
        error_message=row.error_message,
        outputs=dict(row.outputs or {}),
        outputs_partial=row.outputs_partial,
        session_state=dict(row.session_state) if row.session_state is not None else None,
        audio_opened_at=aware(row.audio_opened_at),
    )
