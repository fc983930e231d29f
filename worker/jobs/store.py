"""JobStore: the job row is the truth about who runs a job and how far it got.

Size: one class of ~550 lines on purpose: every fenced write sits next to the claim, heartbeat and
reaper queries whose token and status conditions define the fence; split, the fence would be read
in pieces. The records it returns are in :mod:`worker.jobs.records`.

Who calls what:
- the API / client / CLI: :meth:`JobStore.create`, :meth:`get`, :meth:`list`, :meth:`request_cancel`;
- the Celery task (:mod:`worker.jobs.tasks`): :meth:`claim`, :meth:`heartbeat`, :meth:`commit_segment`
  (from the delivery sink's ``on_commit``), :meth:`discard_segments` (a resume state the render
  refused: the job restarts from the beginning), :meth:`finish`, :meth:`fail`, :meth:`requeue`,
  :meth:`release` (drain on SIGTERM), :meth:`mark_cancelled`, :meth:`cancel_requested`;
- the reaper (a thread in every worker, or ``longtake reap``): :meth:`requeue_expired`, and the
  outbox sweep :meth:`take_unpublished` (the API calls :meth:`mark_unpublished` when a send fails).

Leases. ``claim`` is one conditional UPDATE: it succeeds when the job is ``queued``, or ``running``
with an expired lease that the reaper has not requeued yet (we take it over directly: a redelivered
message should not wait for the reaper), and attempts are left. It writes a fresh random token.
Every later write by that worker (heartbeat, segment commit, finish, cancel, fail) is conditioned on
that token and ``status = 'running'`` — the fence: once another worker has claimed the job, the stale
worker's writes match no row and raise :class:`LeaseLostError` having written nothing.

Clocks: lease expiry is computed from the calling host's UTC clock, so worker hosts must run NTP;
skew shortens or lengthens leases by the skew, it never lets two tokens be valid at once (the token,
not the clock, fences writes).

Retries: each public method runs under :class:`worker.jobs.db.DbRetry` (connection loss only) and is
written so that repeating it after an unknown outcome is harmless (see the per-method notes).
Nothing here holds a session between calls.
"""

from __future__ import annotations

import builtins
import logging
import re
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, delete, func, or_, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from worker.delivery.segment import SegmentRecord
from worker.errors import LeaseLostError
from worker.jobs.db import DbRetry
from worker.jobs.records import JobRecord, JobStatus, Lease, Progress, aware, record_of
from worker.jobs.tables import JobRow, SegmentRow
from worker.spec import JobSpec

log = logging.getLogger(__name__)

_TENANT_RE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _fenced(lease: Lease) -> Any:
    return and_(JobRow.id == lease.job_id, JobRow.lease_token == lease.token, JobRow.status == "running")


class JobStore:
    """All reads and writes of ``jobs`` and ``segments``. Thread-safe (one session per call)."""

    def __init__(self, engine: Engine, *, max_attempts: int = 3, retry: DbRetry | None = None) -> None:
        self.engine = engine
        self.default_max_attempts = max_attempts
        self._retry = retry or DbRetry()
        # lease token -> monotonic time until which this process knows the lease valid (claim,
        # heartbeat and commit each extend it): check_lease answers from it without a query
        self._valid_until: dict[str, float] = {}
        self._clock_lock = threading.Lock()

    def _renewed(self, lease_token: str, lease_s: float, started: float) -> None:
        with self._clock_lock:
            self._valid_until[lease_token] = max(self._valid_until.get(lease_token, 0.0), started + lease_s)

    def check_lease(self, lease: Lease, *, margin_s: float | None = None) -> None:
        """Raise :class:`LeaseLostError` unless ``lease`` still owns the job: the fence of object
        writes (the delivery calls it before every upload). Answered from this process's own
        record while more than ``margin_s`` (default half the lease) of the last renewal is left —
        no other worker can claim a job before its lease expires — else by a fenced read. A frozen
        worker (SIGSTOP, a long GC pause) wakes past that margin, so its next write is checked
        against the row."""
        margin = lease.lease_s / 2 if margin_s is None else margin_s
        with self._clock_lock:
            valid_until = self._valid_until.get(lease.token, 0.0)
        if time.monotonic() + margin < valid_until:
            return

        def op() -> bool:
            with self.engine.connect() as conn:
                return conn.scalar(select(JobRow.id).where(_fenced(lease))) is not None

        if not self._retry(op, what=f"check lease of job {lease.job_id}"):
            raise LeaseLostError(
                f"job {lease.job_id}: lease {lease.token} of {lease.owner!r} is no longer valid "
                "(another worker took the job over); object write refused"
            )

    def _greatest(self, column: Any, value: int) -> Any:
        # SQLite's two-argument max() is PostgreSQL's greatest()
        return (
            func.max(column, value) if self.engine.dialect.name == "sqlite" else func.greatest(column, value)
        )

    # ------------------------------------------------------------------ submission and reads
    def create(self, spec: JobSpec, *, tenant: str, max_attempts: int | None = None) -> JobRecord:
        """Insert a queued job, or return the tenant's existing job with the same idempotency key
        (whatever its spec). Safe to repeat: the id is chosen before the first try. A live session
        (``spec.session``) gets one attempt, whatever ``max_attempts`` says."""
        if not _TENANT_RE.match(tenant):
            raise ValueError(f"tenant: {tenant!r} is not a tenant id; use 1-64 of A-Z a-z 0-9 _ -")
        job_id = str(uuid.uuid4())
        attempts = max_attempts if max_attempts is not None else self.default_max_attempts
        if spec.session is not None:
            attempts = 1  # a live session is not resumable: its streamed audio went to one worker

        def op() -> JobRecord:
            with Session(self.engine) as s:
                existing = self._existing(s, job_id, tenant, spec.idempotency_key)
                if existing is not None:
                    return existing
                now = _utcnow()
                s.add(
                    JobRow(
                        id=job_id,
                        tenant=tenant,
                        idempotency_key=spec.idempotency_key,
                        status="queued",
                        priority=spec.priority,
                        spec=spec.model_dump(mode="json"),
                        attempts=0,
                        max_attempts=attempts,
                        cancel_requested=False,
                        progress_chunks=0,
                        progress_frames=0,
                        progress_s=0.0,
                        created_at=now,
                        queued_at=now,
                        updated_at=now,
                        # optimistic outbox mark: the caller publishes next and calls
                        # mark_unpublished if that fails; a caller that dies in between leaves a
                        # row the sweeper republishes once its message is found missing
                        published_at=now,
                        outputs={},
                        outputs_partial=False,
                        # a session's report starts empty: the reaper and the API tell sessions by
                        # it (jobs with an audio file leave it SQL NULL: None would store JSON null)
                        **({"session_state": {}} if spec.session is not None else {}),
                    )
                )
                try:
                    s.commit()
                except IntegrityError:
                    # lost a race with a concurrent submission carrying the same key
                    s.rollback()
                    existing = self._existing(s, job_id, tenant, spec.idempotency_key)
                    if existing is None:
                        raise
                    return existing
                row = s.get(JobRow, job_id)
                assert row is not None
                return record_of(row)

        return self._retry(op, what=f"create job for tenant {tenant}")

    @staticmethod
    def _existing(s: Session, job_id: str, tenant: str, key: str | None) -> JobRecord | None:
        row = s.get(JobRow, job_id)
        if row is None and key is not None:
            row = s.scalars(
                select(JobRow).where(JobRow.tenant == tenant, JobRow.idempotency_key == key)
            ).first()
        return record_of(row) if row is not None else None

    def get(self, job_id: str, *, tenant: str | None = None) -> JobRecord | None:
        """The job, or None if it does not exist or belongs to another tenant (when given)."""

        def op() -> JobRecord | None:
            with Session(self.engine) as s:
                row = s.get(JobRow, job_id)
                if row is None or (tenant is not None and row.tenant != tenant):
                    return None
                return record_of(row)

        return self._retry(op, what=f"get job {job_id}")

    def list(
        self, *, tenant: str, status: JobStatus | None = None, limit: int = 50, before: datetime | None = None
    ) -> builtins.list[JobRecord]:
        """The tenant's jobs, newest first; ``before`` pages by ``created_at``."""

        def op() -> builtins.list[JobRecord]:
            q = select(JobRow).where(JobRow.tenant == tenant)
            if status is not None:
                q = q.where(JobRow.status == status)
            if before is not None:
                q = q.where(JobRow.created_at < before)
            q = q.order_by(JobRow.created_at.desc(), JobRow.id).limit(max(1, min(limit, 1000)))
            with Session(self.engine) as s:
                return [record_of(r) for r in s.scalars(q)]

        return self._retry(op, what=f"list jobs of tenant {tenant}")

    def count_by_status(self) -> dict[str, int]:
        """Jobs per status, for the ``longtake_jobs`` gauge."""

        def op() -> dict[str, int]:
            with Session(self.engine) as s:
                rows = s.execute(select(JobRow.status, func.count()).group_by(JobRow.status)).all()
                return {str(st): int(n) for st, n in rows}

        return self._retry(op, what="count jobs by status")

    # ------------------------------------------------------------------ leases
    def claim(self, job_id: str, *, owner: str, lease_s: float) -> Lease | None:
        """Take the job if it is queued (or running on an expired lease) and attempts are left;
        None otherwise (already running elsewhere, finished, cancelled, out of attempts).

        Safe to repeat: the token is chosen before the first try, and a repeat that finds its own
        token on a running row returns that lease instead of claiming again.
        """
        token = str(uuid.uuid4())

        def op() -> Lease | None:
            started = time.monotonic()
            now = _utcnow()
            expires = now + timedelta(seconds=lease_s)
            with Session(self.engine) as s, s.begin():
                mine = s.scalars(
                    select(JobRow).where(
                        JobRow.id == job_id, JobRow.lease_token == token, JobRow.status == "running"
                    )
                ).first()
                if mine is None:
                    res = s.execute(
                        update(JobRow)
                        .where(
                            JobRow.id == job_id,
                            JobRow.cancel_requested.is_(False),
                            JobRow.attempts < JobRow.max_attempts,
                            or_(
                                JobRow.status == "queued",
                                and_(JobRow.status == "running", JobRow.lease_expires_at < now),
                            ),
                        )
                        .values(
                            status="running",
                            lease_owner=owner,
                            lease_token=token,
                            lease_expires_at=expires,
                            attempts=JobRow.attempts + 1,
                            started_at=func.coalesce(JobRow.started_at, now),
                            progress_at=now,
                            updated_at=now,
                        )
                        .execution_options(synchronize_session=False)
                    )
                    if res.rowcount != 1:  # type: ignore[attr-defined]
                        return None
                    mine = s.get(JobRow, job_id, populate_existing=True)
                    assert mine is not None
                self._renewed(token, lease_s, started)
                return Lease(
                    job_id=job_id,
                    owner=owner,
                    token=token,
                    attempt=mine.attempts,
                    lease_s=lease_s,
                    expires_at=aware(mine.lease_expires_at) or expires,
                )

        return self._retry(op, what=f"claim job {job_id}")

    def heartbeat(self, lease: Lease, *, progress: Progress | None = None) -> bool:
        """Extend the lease by ``lease.lease_s`` from now (and record progress). False when the
        lease is lost: the caller must stop the render. Repeating is harmless."""

        def op() -> bool:
            started = time.monotonic()
            now = _utcnow()
            values: dict[str, Any] = {
                "lease_expires_at": now + timedelta(seconds=lease.lease_s),
                "updated_at": now,
            }
            if progress is not None:
                # never backwards: a commit may already have recorded a later chunk
                values["progress_frames"] = self._greatest(JobRow.progress_frames, progress.frames_done)
                values["progress_at"] = case(
                    (JobRow.progress_frames < progress.frames_done, now), else_=JobRow.progress_at
                )
                if progress.num_chunks is not None:
                    values["num_chunks"] = progress.num_chunks
                if progress.num_frames is not None:
                    values["num_frames"] = progress.num_frames
                if progress.session is not None:
                    values["session_state"] = progress.session
            with self.engine.begin() as conn:
                res = conn.execute(update(JobRow).where(_fenced(lease)).values(**values))
            if res.rowcount != 1:
                return False
            self._renewed(lease.token, lease.lease_s, started)
            return True

        return self._retry(op, what=f"heartbeat job {lease.job_id}")

    def commit_segment(self, lease: Lease, seg: SegmentRecord) -> None:
        """Record one durably uploaded segment, fenced by the lease (LeaseLostError: nothing written).

        Segments must arrive without gaps (index = number already committed, or a repeat of one
        already there). A repeat with the same checksum is a no-op (a retried call whose first try
        landed); a repeat with a different checksum replaces the row (the current lease holder
        re-uploaded that index, and its object is the one now in storage).
        """

        def write(started: float) -> None:
            now = _utcnow()
            with Session(self.engine) as s, s.begin():
                # this UPDATE takes the job row lock first, serialising with claim/reaper
                res = s.execute(
                    update(JobRow)
                    .where(_fenced(lease))
                    .values(updated_at=now, lease_expires_at=now + timedelta(seconds=lease.lease_s))
                    .execution_options(synchronize_session=False)
                )
                if res.rowcount != 1:  # type: ignore[attr-defined]
                    raise LeaseLostError(
                        f"job {lease.job_id}: lease {lease.token} of {lease.owner!r} is no longer "
                        f"valid; segment {seg.index} was not committed"
                    )
                existing = s.get(SegmentRow, (lease.job_id, seg.index))
                if existing is not None and existing.checksum == seg.checksum:
                    return
                if existing is None:
                    last = s.scalar(select(func.max(SegmentRow.idx)).where(SegmentRow.job_id == lease.job_id))
                    expected = 0 if last is None else last + 1
                    if seg.index != expected:
                        raise ValueError(
                            f"job {lease.job_id}: segment index {seg.index} leaves a gap (next "
                            f"expected {expected}); commit segments in index order"
                        )
                    existing = SegmentRow(job_id=lease.job_id, idx=seg.index)
                    s.add(existing)
                existing.key = seg.key
                existing.nbytes = seg.nbytes
                existing.duration_s = seg.duration_s
                existing.checksum = seg.checksum
                existing.state_key = seg.state_key
                existing.first_frame = seg.first_frame
                existing.num_frames = seg.num_frames
                existing.attempt = lease.attempt
                existing.committed_at = now
                s.flush()
                count, total_s = s.execute(
                    select(func.count(), func.coalesce(func.sum(SegmentRow.duration_s), 0.0)).where(
                        SegmentRow.job_id == lease.job_id
                    )
                ).one()
                s.execute(
                    update(JobRow)
                    .where(JobRow.id == lease.job_id)
                    .values(
                        progress_chunks=count,
                        progress_s=float(total_s),
                        progress_at=now,
                        progress_frames=self._greatest(
                            JobRow.progress_frames, seg.first_frame + seg.num_frames
                        ),
                    )
                    .execution_options(synchronize_session=False)
                )

        def op() -> None:
            started = time.monotonic()
            write(started)  # committed (or raised): the lease was extended from `started`
            self._renewed(lease.token, lease.lease_s, started)

        self._retry(op, what=f"commit segment {seg.index} of job {lease.job_id}")

    def discard_segments(self, lease: Lease) -> int:
        """Forget every committed segment of the job and its progress, fenced (LeaseLostError:
        nothing changed): the attempt renders the job from the beginning because its resume state
        cannot continue this render (``pipeline.errors.ResumeStateError``: the options or the model
        changed since it was made). One transaction: the row stops naming the old segments (and
        their resume states) before anything deletes their objects, so a crash in between leaves
        orphan objects, never a row naming missing ones. Returns how many were discarded. Repeating
        is harmless."""

        def op() -> int:
            started = time.monotonic()
            now = _utcnow()
            with Session(self.engine) as s, s.begin():
                res = s.execute(
                    update(JobRow)
                    .where(_fenced(lease))
                    .values(
                        progress_chunks=0,
                        progress_frames=0,
                        progress_s=0.0,
                        progress_at=now,
                        updated_at=now,
                        lease_expires_at=now + timedelta(seconds=lease.lease_s),
                    )
                    .execution_options(synchronize_session=False)
                )
                if res.rowcount != 1:  # type: ignore[attr-defined]
                    raise LeaseLostError(
                        f"job {lease.job_id}: lease {lease.token} of {lease.owner!r} is no longer valid; "
                        "its segments were not discarded"
                    )
                gone = s.execute(
                    delete(SegmentRow).where(SegmentRow.job_id == lease.job_id)
                    .execution_options(synchronize_session=False)
                )
                count = int(gone.rowcount)  # type: ignore[attr-defined]
            self._renewed(lease.token, lease.lease_s, started)
            return count

        return self._retry(op, what=f"discard segments of job {lease.job_id}")

    def segments(self, job_id: str) -> builtins.list[SegmentRecord]:
        """Committed segments in index order (the resume point is the last one)."""

        def op() -> builtins.list[SegmentRecord]:
            with Session(self.engine) as s:
                rows = s.scalars(
                    select(SegmentRow).where(SegmentRow.job_id == job_id).order_by(SegmentRow.idx)
                )
                return [
                    SegmentRecord(
                        index=r.idx,
                        key=r.key,
                        nbytes=r.nbytes,
                        duration_s=r.duration_s,
                        checksum=r.checksum,
                        state_key=r.state_key,
                        first_frame=r.first_frame,
                        num_frames=r.num_frames,
                    )
                    for r in rows
                ]

        return self._retry(op, what=f"list segments of job {job_id}")

    # ------------------------------------------------------------------ endings
    def _end(self, lease: Lease, status: JobStatus, values: dict[str, Any], what: str) -> None:
        def op() -> None:
            now = _utcnow()
            with self.engine.begin() as conn:
                res = conn.execute(
                    update(JobRow)
                    .where(_fenced(lease))
                    .values(status=status, finished_at=now, updated_at=now, lease_expires_at=None, **values)
                )
                if res.rowcount == 1:
                    return
                # a repeat whose first try landed finds the row ended under our own token
                row = conn.execute(
                    select(JobRow.status, JobRow.lease_token).where(JobRow.id == lease.job_id)
                ).first()
                if row is not None and row[0] == status and row[1] == lease.token:
                    return
                raise LeaseLostError(
                    f"job {lease.job_id}: lease {lease.token} of {lease.owner!r} is no longer valid "
                    f"(row is {row[0] if row else 'gone'}); not marked {status}"
                )

        self._retry(op, what=f"{what} job {lease.job_id}")

    def finish(
        self, lease: Lease, *, outputs: dict[str, str], session: dict[str, object] | None = None
    ) -> None:
        """Mark succeeded with the final output URIs (fenced); ``session``: a live session's final
        report (end reason, audio and silence seconds)."""
        values: dict[str, Any] = {
            "outputs": dict(outputs), "outputs_partial": False, "error_code": None, "error_message": None
        }
        if session is not None:
            values["session_state"] = session
        self._end(lease, "succeeded", values, "finish")

    def fail_session(
        self, lease: Lease, *, code: str, message: str, outputs: dict[str, str], session: dict[str, object]
    ) -> None:
        """Mark a live session failed (its stream broke: bad input) while keeping what it rendered
        until then, flagged partial (fenced)."""
        self._end(
            lease,
            "failed",
            {
                "outputs": dict(outputs),
                "outputs_partial": True,
                "error_code": code[:64],
                "error_message": message,
                "session_state": session,
            },
            "fail",
        )

    def open_audio(self, job_id: str, *, tenant: str) -> bool:
        """Claim the one WebSocket sender of a live session (conditional UPDATE: True once per
        session, ever; False when a sender already connected, or the job is not the tenant's
        session or has ended). Sessions are not resumable, so the claim is never released."""

        def op() -> bool:
            now = _utcnow()
            with self.engine.begin() as conn:
                res = conn.execute(
                    update(JobRow)
                    .where(
                        JobRow.id == job_id,
                        JobRow.tenant == tenant,
                        JobRow.session_state.is_not(None),
                        JobRow.audio_opened_at.is_(None),
                        JobRow.status.in_(("queued", "running")),
                    )
                    .values(audio_opened_at=now, updated_at=now)
                )
                return bool(res.rowcount == 1)

        return self._retry(op, what=f"open the audio stream of job {job_id}")

    def mark_cancelled(
        self, lease: Lease, *, partial_outputs: dict[str, str], session: dict[str, object] | None = None
    ) -> None:
        """Mark cancelled; the outputs written so far are kept and flagged partial (fenced).
        ``session``: a live session's final report."""
        values: dict[str, Any] = {
            "outputs": dict(partial_outputs),
            "outputs_partial": True,
            "error_code": "cancelled",
            "error_message": "cancelled on request",
        }
        if session is not None:
            values["session_state"] = session
        self._end(lease, "cancelled", values, "cancel")

    def fail(self, job_id: str, *, code: str, message: str, lease: Lease | None = None) -> None:
        """Fail the job for good. With a lease the write is fenced (LeaseLostError); without one
        (an operator, or a worker that never claimed) it fails any job that has not ended yet."""
        values: dict[str, Any] = {"error_code": code[:64], "error_message": message}
        if lease is not None:
            if lease.job_id != job_id:
                raise ValueError(f"fail: lease is for job {lease.job_id}, not {job_id}")
            self._end(lease, "failed", values, "fail")
            return

        def op() -> None:
            now = _utcnow()
            with self.engine.begin() as conn:
                conn.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id, JobRow.status.in_(("queued", "running")))
                    .values(status="failed", finished_at=now, updated_at=now, lease_expires_at=None, **values)
                )

        self._retry(op, what=f"fail job {job_id}")

    def requeue(self, lease: Lease, *, code: str, message: str) -> bool:
        """End this attempt after a retryable error: back to queued if attempts are left and no
        cancel is pending (True: the caller publishes a new message); else cancelled (cancel
        pending) or failed with the error (False). Fenced."""

        def op() -> bool:
            now = _utcnow()
            with self.engine.begin() as conn:
                res = conn.execute(
                    update(JobRow)
                    .where(
                        _fenced(lease),
                        JobRow.attempts < JobRow.max_attempts,
                        JobRow.cancel_requested.is_(False),
                    )
                    .values(
                        status="queued",
                        queued_at=now,
                        published_at=now,  # the caller publishes next
                        updated_at=now,
                        lease_owner=None,
                        lease_expires_at=None,
                        error_code=code[:64],
                        error_message=message,
                    )
                )
                return bool(res.rowcount == 1)

        if self._retry(op, what=f"requeue job {lease.job_id}"):
            return True
        if self.cancel_requested(lease.job_id):
            self._end(
                lease,
                "cancelled",
                {
                    "outputs_partial": True,
                    "error_code": "cancelled",
                    "error_message": f"cancelled on request; last attempt: {message}",
                },
                "cancel",
            )
            return False
        self._end(
            lease,
            "failed",
            {
                "error_code": code[:64],
                "error_message": f"{message} (attempt {lease.attempt}, no attempts left)",
            },
            "fail",
        )
        return False

    def release(self, lease: Lease, *, reason: str) -> None:
        """Hand the job back without charging the attempt (the worker is shutting down: SIGTERM
        drain): queued again with ``attempts - 1``, lease cleared, outbox mark set (the caller
        publishes next). Fenced (LeaseLostError)."""

        def op() -> None:
            now = _utcnow()
            with self.engine.begin() as conn:
                res = conn.execute(
                    update(JobRow)
                    .where(_fenced(lease))
                    .values(
                        status="queued",
                        attempts=JobRow.attempts - 1,
                        queued_at=now,
                        published_at=now,
                        updated_at=now,
                        lease_owner=None,
                        lease_token=None,
                        lease_expires_at=None,
                    )
                )
                if res.rowcount == 1:
                    return
                # a repeat whose first try landed: the row is queued again, no longer under our token
                row = conn.execute(select(JobRow.status, JobRow.lease_token).where(JobRow.id == lease.job_id)).first()
                if row is not None and row[0] == "queued" and row[1] is None:
                    return
                raise LeaseLostError(f"job {lease.job_id}: lease {lease.token} lost; not released ({reason})")

        self._retry(op, what=f"release job {lease.job_id}")
        log.info("job %s handed back (%s); attempt %d not counted", lease.job_id, reason, lease.attempt,
                 extra={"job_id": lease.job_id})

    # ------------------------------------------------------------------ cancel
    def request_cancel(self, job_id: str, *, tenant: str) -> bool:
        """Ask to cancel. A queued job is cancelled at once; a running one gets the flag its worker
        polls between chunks. False when the job is not the tenant's or has already ended."""

        def op() -> bool:
            now = _utcnow()
            with self.engine.begin() as conn:
                res = conn.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id, JobRow.tenant == tenant, JobRow.status == "queued")
                    .values(
                        status="cancelled",
                        cancel_requested=True,
                        finished_at=now,
                        updated_at=now,
                        error_code="cancelled",
                        error_message="cancelled on request before it started",
                    )
                )
                if res.rowcount == 1:
                    return True
                res = conn.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id, JobRow.tenant == tenant, JobRow.status == "running")
                    .values(cancel_requested=True, updated_at=now)
                )
                return bool(res.rowcount == 1)

        return self._retry(op, what=f"cancel job {job_id}")

    def cancel_requested(self, job_id: str) -> bool:
        def op() -> bool:
            with self.engine.connect() as conn:
                return bool(conn.scalar(select(JobRow.cancel_requested).where(JobRow.id == job_id)))

        return self._retry(op, what=f"poll cancel flag of job {job_id}")

    # ------------------------------------------------------------------ delivery state
    def save_delivery_state(self, lease: Lease, state: dict[str, Any] | None) -> None:
        """Store the sink's resumable delivery state (e.g. a multipart upload id), fenced."""

        def op() -> None:
            with self.engine.begin() as conn:
                res = conn.execute(update(JobRow).where(_fenced(lease)).values(delivery_state=state))
                if res.rowcount != 1:
                    raise LeaseLostError(f"job {lease.job_id}: lease lost; delivery state not saved")

        self._retry(op, what=f"save delivery state of job {lease.job_id}")

    def delivery_state(self, job_id: str) -> dict[str, Any] | None:
        def op() -> dict[str, Any] | None:
            with self.engine.connect() as conn:
                return conn.scalar(select(JobRow.delivery_state).where(JobRow.id == job_id))

        return self._retry(op, what=f"read delivery state of job {job_id}")

    # ------------------------------------------------------------------ reaper
    def requeue_expired(
        self, *, now: datetime | None = None, limit: int = 100, min_db_uptime_s: float = 0.0
    ) -> builtins.list[str]:
        """Requeue running jobs whose lease expired; returns the requeued ids (the caller
        publishes a message for each). Jobs out of attempts are failed with the reason; jobs with
        a pending cancel are cancelled. Each row is changed by a conditional UPDATE on the token
        it was seen with, so reapers on many workers and late heartbeats cannot race it.

        ``min_db_uptime_s`` (PostgreSQL): reap nothing while the server has been up for less than
        that — after a restart every lease looks expired though its holder is alive and about to
        heartbeat (see :func:`worker.jobs.reaper.reaper_loop`)."""

        # kept across retries: a retry after a dropped connection must still return the ids the
        # first try requeued (their rows no longer match, and each needs its message published)
        requeued: builtins.list[str] = []

        def op() -> builtins.list[str]:
            t = now or _utcnow()
            with self.engine.connect() as conn:
                if min_db_uptime_s > 0 and self.engine.dialect.name == "postgresql":
                    started = conn.scalar(select(func.pg_postmaster_start_time()))
                    if started is not None and aware(started) > t - timedelta(seconds=min_db_uptime_s):
                        log.info("reaper: PostgreSQL restarted at %s; leases are not reaped yet", started)
                        return requeued
                expired = conn.execute(
                    select(
                        JobRow.id,
                        JobRow.lease_token,
                        JobRow.lease_owner,
                        JobRow.attempts,
                        JobRow.max_attempts,
                        JobRow.cancel_requested,
                        JobRow.lease_expires_at,
                        JobRow.session_state.is_not(None),
                    )
                    .where(JobRow.status == "running", JobRow.lease_expires_at < t)
                    .order_by(JobRow.lease_expires_at)
                    .limit(limit)
                ).all()
            for job_id, token, owner, attempts, max_attempts, cancel, expired_at, is_session in expired:
                guard = and_(
                    JobRow.id == job_id,
                    JobRow.lease_token == token,
                    JobRow.status == "running",
                    JobRow.lease_expires_at < t,
                )
                why = (
                    f"worker {owner!r} stopped heartbeating (lease expired at "
                    f"{aware(expired_at):%Y-%m-%d %H:%M:%S} UTC) on attempt {attempts} of {max_attempts}"
                )
                if cancel:
                    values: dict[str, Any] = {
                        "status": "cancelled",
                        "finished_at": t,
                        "outputs_partial": True,
                        "error_code": "cancelled",
                        "error_message": f"cancelled; {why}",
                    }
                elif is_session:
                    # a live session's audio went to the dead worker: it cannot be resumed
                    values = {
                        "status": "failed",
                        "finished_at": t,
                        "outputs_partial": True,
                        "error_code": "session_lost",
                        "error_message": f"{why}; a live session is not resumable (its streamed audio "
                        "went to that worker): the segments rendered until then stay (GET .../outputs), "
                        "start a new session",
                    }
                elif attempts >= max_attempts:
                    values = {
                        "status": "failed",
                        "finished_at": t,
                        "error_code": "lease_expired",
                        "error_message": f"{why}; no attempts left. Check that worker's logs "
                        "(crash, OOM kill, lost node) and resubmit",
                    }
                else:
                    values = {
                        "status": "queued",
                        "queued_at": t,
                        "published_at": t,  # reap_once publishes next
                        "lease_owner": None,
                        "error_code": "lease_expired",
                        "error_message": f"{why}; requeued",
                    }
                with self.engine.begin() as conn:
                    res = conn.execute(
                        update(JobRow).where(guard).values(lease_expires_at=None, updated_at=t, **values)
                    )
                if res.rowcount == 1:
                    log.warning(
                        "reaper: job %s %s: %s", job_id, values["status"], why, extra={"job_id": job_id}
                    )
                    if values["status"] == "queued":
                        requeued.append(job_id)
            return requeued

        return self._retry(op, what="requeue expired leases")

    # ------------------------------------------------------------------ outbox (the sweeper)
    def mark_unpublished(self, job_id: str) -> None:
        """The message of a queued job could not be sent (broker down): leave it to the sweeper,
        which publishes unpublished rows on its next pass (the API calls this after a failed send)."""

        def op() -> None:
            with self.engine.begin() as conn:
                conn.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id, JobRow.status == "queued")
                    .values(published_at=None)
                )

        self._retry(op, what=f"mark job {job_id} unpublished")

    def take_unpublished(
        self,
        *,
        republish_after_s: float,
        live: builtins.set[str],
        now: datetime | None = None,
        limit: int = 500,
    ) -> builtins.list[tuple[str, int]]:
        """Queued jobs whose message must be (re)sent: never published (``published_at`` NULL),
        or published more than ``republish_after_s`` ago and not among the ``live`` message ids
        the broker still holds. Each returned row was stamped ``published_at = now`` by a
        conditional UPDATE on the value it was seen with, so of many sweepers exactly one
        republishes a given job per interval. Returns ``(job_id, priority)``; the caller
        publishes each (and calls :meth:`mark_unpublished` when that fails)."""
        taken: builtins.list[tuple[str, int]] = []

        def op() -> builtins.list[tuple[str, int]]:
            t = now or _utcnow()
            stale = t - timedelta(seconds=republish_after_s)
            with self.engine.connect() as conn:
                rows = conn.execute(
                    select(JobRow.id, JobRow.priority, JobRow.published_at)
                    .where(
                        JobRow.status == "queued",
                        JobRow.cancel_requested.is_(False),
                        or_(JobRow.published_at.is_(None), JobRow.published_at < stale),
                    )
                    .order_by(JobRow.priority.desc(), JobRow.queued_at)
                    .limit(limit)
                ).all()
            done = {job_id for job_id, _ in taken}
            for job_id, priority, seen in rows:
                if job_id in live or job_id in done:
                    continue
                seen_cond = JobRow.published_at.is_(None) if seen is None else JobRow.published_at == seen
                with self.engine.begin() as conn:
                    res = conn.execute(
                        update(JobRow)
                        .where(JobRow.id == job_id, JobRow.status == "queued", seen_cond)
                        .values(published_at=t)
                    )
                if res.rowcount == 1:
                    taken.append((job_id, int(priority)))
            return taken

        return self._retry(op, what="take unpublished queued jobs")
