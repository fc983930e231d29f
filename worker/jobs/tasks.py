"""The render task: claim the row, render on the worker's NodeEngine under a heartbeated lease, end the row.

Who calls: the Celery task ``longtake.render_job(job_id)`` (registered by
:func:`worker.jobs.celery_app.create_worker_app`) calls :meth:`JobWorker.run`; tests may call it
directly. One :class:`JobWorker` per process holds the DB engine, the store, the delivery factory it
was built with and the :class:`NodeExecutor` (the node's warm rank processes, started by the first
job); nothing else survives a task.

One attempt:
1. ``claim`` (conditional UPDATE). No lease -> the job is running elsewhere, finished, cancelled or
   out of attempts: return without rendering (this is how a message delivered twice renders once).
2. Fetch inputs (``file://`` re-checked against ``Settings.file_root``; ``s3://`` and ``upload://``
   downloaded into ``work_dir``); read the committed segments and, if any, the resume state of the
   last one. Should the render refuse that state (made with other options, another model or plan:
   ``ResumeStateError``), the segments are discarded and the job renders from the beginning
   (:meth:`JobWorker._start_over`).
3. Build the job's delivery (the ``delivery`` factory given to :class:`JobWorker`; default
   :func:`worker.delivery.job_delivery.s3_delivery`) whose ``on_commit`` is the lease-fenced
   ``JobStore.commit_segment``.
4. Start :class:`LeaseKeeper` (heartbeat every ``heartbeat_s`` with the latest progress, poll the
   cancel flag every ``cancel_poll_s``) and run the render on :class:`worker.jobs.runner.NodeExecutor`.
5. End the row by outcome: finish | mark_cancelled (+ abandon the multipart upload) | requeue and
   publish a new message (retryable error, attempts left) | fail | nothing (lease lost: the row
   belongs to someone else now) | release and publish (drained: the worker got SIGTERM; the
   attempt is not counted).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote, urlsplit

from celery import Celery

from pipeline.errors import InvalidInputError, RenderError, ResumeStateError
from pipeline.media_types import Fragment
from pipeline.placement.render_job import RankRenderRequest
from pipeline.request import Renderer, RenderProgress, RenderRequest
from worker.access import InputGrants, InputRefusedError
from worker.delivery.job_delivery import DeliveryFactory, JobDelivery, s3_delivery
from worker.delivery.keys import upload_key
from worker.delivery.segment import SegmentRecord
from worker.delivery.storage import open_object_store
from worker.errors import LeaseLostError, ObjectNotFoundError
from worker.jobs import metrics
from worker.jobs.db import DbRetry, is_connection_error, make_engine
from worker.jobs.lease import LeaseKeeper
from worker.jobs.queue import enqueue_render
from worker.jobs.records import JobRecord, Lease, Progress
from worker.jobs.runner import NodeExecutor, RenderJob, RenderOutcome
from worker.jobs.session import SessionFeeder
from worker.jobs.session_relay import SessionRelay
from worker.jobs.store import JobStore
from worker.logging import job_context, set_chunk
from worker.settings import Settings
from worker.spec import resolve_file_uri

log = logging.getLogger(__name__)


class JobWorker:
    """Runs render attempts in this process (one at a time)."""

    _instances: dict[int, JobWorker] = {}
    _lock = threading.Lock()
    # set once by request_drain (SIGTERM) or, in a prefork pool child, by the drain signal's handler
    # (worker.jobs.celery_app): the running attempt stops between chunks and is handed back
    drain_requested = threading.Event()

    def __init__(
        self,
        settings: Settings,
        celery: Celery | None = None,
        *,
        delivery: DeliveryFactory = s3_delivery,
        renderer: Renderer | None = None,
    ) -> None:
        """``celery`` publishes the message of a requeued job (None: it waits for the next one);
        ``delivery`` builds each attempt's sinks and ``renderer`` renders on the ranks (a
        module-level function with ``pipeline.render.render``'s signature, which is the default;
        tests pass their fakes here)."""
        self.settings = settings
        self.celery = celery
        self.engine = make_engine(settings.database_url, pool_size=2)
        self.store = JobStore(
            self.engine,
            max_attempts=settings.max_attempts,
            # an outage up to db_outage_max_s is ridden out: the render goes on, commits wait
            retry=DbRetry(settings.db_retry_attempts, settings.db_retry_max_wait_s, max_s=settings.db_outage_max_s),
        )
        self.owner = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self.delivery_factory = delivery
        if renderer is None:  # the real pipeline (imports the model code: only where a job runs)
            from pipeline.render import render

            renderer = render
        self.renderer: Renderer = renderer
        self.node = NodeExecutor(
            ranks=settings.node_ranks,
            device=settings.resolved_node_device(),
            threads_per_rank=settings.resolved_node_threads(),
            preset=settings.node_preset,
            checkpoint=settings.checkpoint,
        )

    @classmethod
    def for_process(
        cls,
        settings: Settings,
        celery: Celery | None = None,
        *,
        delivery: DeliveryFactory = s3_delivery,
        renderer: Renderer | None = None,
    ) -> JobWorker:
        """One per process (engines must not cross a fork: keyed by pid)."""
        with cls._lock:
            inst = cls._instances.get(os.getpid())
            if inst is None:
                inst = cls._instances[os.getpid()] = cls(settings, celery, delivery=delivery, renderer=renderer)
                atexit.register(inst.node.close, settings.kill_grace_s)  # ranks also die with the process (PDEATHSIG)
            return inst

    @classmethod
    def request_drain(cls) -> None:
        """The worker is shutting down (Celery's ``worker_shutting_down``, i.e. SIGTERM, connected by
        :mod:`worker.jobs.celery_app`): the running render stops between chunks, the job is
        released without charging its attempt and republished, so another worker resumes it within
        one chunk plus the drain instead of after the whole job (or the lease, once killed).
        Called in a signal handler: the flag is set before anything is logged. In the Celery parent
        of a prefork pool nothing renders; the parent passes the drain on to its pool children."""
        first = not cls.drain_requested.is_set()
        cls.drain_requested.set()
        if first:
            log.warning("shutdown requested: the running job (if any) is handed back after this chunk")

    # ------------------------------------------------------------------------------ one attempt
    def run(self, job_id: str) -> str:
        """Claim and render ``job_id``; returns how the attempt ended (for logs and tests)."""
        with job_context(job_id):
            lease = self.store.claim(job_id, owner=self.owner, lease_s=self.settings.lease_s)
            if lease is None:
                log.info(
                    "job not claimable (running elsewhere, ended, cancelled or out of attempts); skipping"
                )
                metrics.ATTEMPTS.labels("skipped").inc()
                return "skipped"
            metrics.BUSY.set(1)
            try:
                outcome = self._attempt(lease)
            except LeaseLostError as exc:
                log.warning("lease lost: %s", exc)
                outcome = "lease_lost"
            except Exception as exc:
                if is_connection_error(exc):
                    # nothing can be written: the row stays running and the reaper requeues it
                    log.error("database unreachable for db_outage_max_s; attempt %d abandoned: %s",
                              lease.attempt, exc)
                    outcome = "db_unreachable"
                else:
                    # a bug or an outage in this worker, not in the render: give the attempt back
                    # now instead of leaving the lease to expire
                    log.exception("attempt %d broke in the worker", lease.attempt)
                    outcome = self._retry_or_fail(
                        lease,
                        None,
                        code="worker_error",
                        retryable=True,
                        message=f"worker {self.owner} failed: {type(exc).__name__}: {exc}",
                    )
            finally:
                metrics.BUSY.set(0)
            metrics.ATTEMPTS.labels(outcome).inc()
            log.info("attempt %d ended: %s", lease.attempt, outcome)
            return outcome

    def _attempt(self, lease: Lease) -> str:
        rec = self.store.get(lease.job_id)
        if rec is None:
            raise LeaseLostError(f"job {lease.job_id} vanished after it was claimed")
        metrics.QUEUE_WAIT.observe(max(0.0, (datetime.now(UTC) - rec.queued_at).total_seconds()))
        log.info("claimed (attempt %d of %d)", lease.attempt, rec.max_attempts)
        workdir = self.settings.work_dir / lease.job_id / f"attempt-{lease.attempt}"
        lost = threading.Event()

        def on_commit(seg: SegmentRecord) -> None:
            try:
                self.store.commit_segment(lease, seg)
            except LeaseLostError:
                lost.set()
                raise
            except Exception as exc:
                if not is_connection_error(exc):
                    raise
                # the database stayed away for db_outage_max_s: the lease can no longer be proven;
                # stop like a lost lease, the reaper hands the job on once the database is back
                lost.set()
                raise LeaseLostError(
                    f"job {lease.job_id}: database unreachable for db_outage_max_s="
                    f"{self.settings.db_outage_max_s:g} s; segment {seg.index} was not committed and "
                    "the attempt stops (the job resumes after its last committed segment)"
                ) from exc
            metrics.SEGMENTS.inc()

        def fence() -> None:
            try:
                self.store.check_lease(lease)
            except LeaseLostError:
                lost.set()
                raise

        def make_delivery(committed: Sequence[SegmentRecord]) -> JobDelivery:
            return self.delivery_factory(
                self.settings,
                tenant=rec.tenant,
                job_id=rec.id,
                spec=rec.spec,
                committed=committed,
                on_commit=on_commit,
                attempt=lease.attempt,
                fence=fence,
            )

        try:
            committed = self.store.segments(lease.job_id)
            delivery = make_delivery(committed)
            image = self._fetch(rec, rec.spec.image, "image", workdir)
            # a live session has no audio file: the render follows the live directory the session
            # feeder writes (worker.jobs.session)
            audio = workdir / "live" if rec.spec.audio is None else self._fetch(rec, rec.spec.audio, "audio", workdir)
            resume_state = self._resume_state(committed, delivery)
        except InvalidInputError as exc:
            self.store.fail(lease.job_id, lease=lease, code=exc.code, message=str(exc))
            return "failed"
        except Exception as exc:  # storage outage while preparing: retry the attempt later
            return self._retry_or_fail(
                lease,
                None,
                code="prepare_failed",
                message=f"preparing the render failed: {exc}",
                retryable=exc.retryable if isinstance(exc, RenderError) else True,
            )
        if committed:
            log.info("resuming after committed segment %d", committed[-1].index)
        # the delivery keeps what it needs of them (compactly); a resume of a long job would
        # otherwise hold every earlier segment's record for the whole attempt
        del committed
        feeder: list[SessionFeeder] = []
        try:
            outcome = self._render(lease, rec, delivery, image, audio, resume_state, feeder)
            if resume_state is not None and outcome.status == "failed" and outcome.code == ResumeStateError.code:
                fresh = self._start_over(lease, outcome.message or "", make_delivery)
                if isinstance(fresh, str):
                    return fresh
                delivery = fresh
                outcome = self._render(lease, rec, delivery, image, audio, None, feeder)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if lost.is_set() and outcome.status != "succeeded":
            outcome = RenderOutcome(status="stopped", code="lease_lost", message="lease lost during a commit")
        return self._end(lease, delivery, outcome, feeder[0] if feeder else None)

    def _start_over(
        self, lease: Lease, refusal: str, make_delivery: Callable[[Sequence[SegmentRecord]], JobDelivery]
    ) -> JobDelivery | str:
        """The render refused the resume state before it published anything
        (``pipeline.errors.ResumeStateError``: the job's options, the model or the plan differ from
        those the state was made with — typically a deploy between two attempts — or the state is of
        an older snapshot version). Not the user's error, and the job can still be done right: the
        committed segments were made under that state, so the row forgets them
        (``JobStore.discard_segments``, fenced; progress back to 0), their objects and the
        interrupted upload are deleted (``JobDelivery.discard``), and this attempt renders from the
        beginning into a fresh delivery, which it returns. Resuming anyway would publish a video
        whose method or model changes at the seam; failing would make the user resubmit for the
        same result. A storage error here ends the attempt retryable (the row already starts from
        the beginning); how the attempt ended is returned instead of a delivery then."""
        stale = self.store.segments(lease.job_id)
        log.warning(
            "the render refused the resume state (%s); discarding the %d committed segments and rendering "
            "the job from the beginning",
            refusal,
            len(stale),
            extra={"resume_refused": refusal, "segments_discarded": len(stale)},
        )
        self.store.discard_segments(lease)
        metrics.RESUMES_DISCARDED.inc()
        try:
            delivery = make_delivery(())
            delivery.discard(stale)
        except LeaseLostError:
            raise
        except Exception as exc:
            return self._retry_or_fail(
                lease,
                None,
                code="prepare_failed",
                message=f"deleting the {len(stale)} segments of a refused resume state failed: {exc}; the "
                "job renders from the beginning",
                retryable=exc.retryable if isinstance(exc, RenderError) else True,
            )
        return delivery

    def _render(
        self,
        lease: Lease,
        rec: JobRecord,
        delivery: JobDelivery,
        image: Path,
        audio: Path,
        resume_state: bytes | None,
        feeder_out: list[SessionFeeder],
    ) -> RenderOutcome:
        """Render one attempt; for a live session also run its :class:`SessionFeeder` (appended to
        ``feeder_out`` for :meth:`_end`)."""
        s = self.settings
        session = rec.spec.session
        keeper = LeaseKeeper(
            self.store,
            lease,
            heartbeat_s=s.heartbeat_s,
            cancel_poll_s=s.cancel_poll_s,
            # the render thread's own watchdog (progress_timeout_s, then the kill) acts first
            stall_s=s.progress_timeout_s + s.cancel_grace_s + s.lease_s,
            drain=self.drain_requested,
        )
        stop_reason = keeper.stop_reason
        feeder: SessionFeeder | None = None
        if session is not None:
            # a session is not handed back at shutdown (its audio cannot follow it to another
            # worker): the worker's warm shutdown waits for it to end (docs/sessions.md)
            def stop_reason() -> str | None:
                reason = keeper.stop_reason()
                return None if reason == "drain" else reason

            feeder = SessionFeeder(
                rec.id,
                audio,
                session,
                lambda: SessionRelay(s.broker_url, s.queue_name, rec.id, socket_timeout_s=s.broker_socket_timeout_s),
                # the render itself stops at max_job_s of wall time: end the feed before that
                max_s=min(s.session_max_s, 0.9 * s.max_job_s),
                max_ahead_s=s.session_max_ahead_s,
                max_lag_s=s.session_max_lag_s,
                stop_reason=stop_reason,
            )
            feeder_out.append(feeder)
        claimed_at = time.monotonic()
        first_fragment_at: list[float] = []
        last_chunk_at = [claimed_at]

        def on_fragment(frag: Fragment) -> None:
            now = time.monotonic()
            set_chunk(frag.index)
            if not first_fragment_at:
                first_fragment_at.append(now)
                metrics.TIME_TO_FIRST_FRAME.observe(now - claimed_at)
            metrics.CHUNK_SECONDS.observe(now - last_chunk_at[0])
            last_chunk_at[0] = now

        def on_progress(p: RenderProgress) -> None:
            if feeder is not None:
                feeder.on_progress(p)
            keeper.report(
                Progress(
                    chunks_done=p.emission_index + 1,
                    num_chunks=p.num_emissions if feeder is None else None,  # a session's total is unknown
                    frames_done=p.frames_done,
                    num_frames=p.num_frames if feeder is None else None,
                    session=feeder.report() if feeder is not None else None,
                )
            )

        request = RenderRequest(
            image=image,
            audio=audio,
            text=rec.spec.text,
            seed=rec.spec.seed,
            family=rec.spec.family,
            preset=rec.spec.preset,
            checkpoint=s.model_weights(rec.spec.model),
            options=dict(rec.spec.options),  # render() checks them again, for the preset it loads
            use_i_chunks=session is None or session.latency == "default",
            live=session is not None,
        )
        job = RenderJob(
            job_id=rec.id,
            render=RankRenderRequest(self.renderer, request, resume_state=resume_state),
            log_level=s.log_level,
            log_json=s.log_json,
        )
        on_alive: Callable[[float], None] = keeper.alive
        if feeder is not None:
            session_feeder = feeder

            def session_alive(grace_s: float) -> None:
                keeper.alive(grace_s)
                # the first sign of life after the ranks' start: the render is on its way, the API
                # tells the sender `ready` (docs/sessions.md)
                if grace_s == 0.0 and not session_feeder.ready:
                    session_feeder.ready = True
                    keeper.report(Progress(chunks_done=0, session=session_feeder.report()))

            on_alive = session_alive

        keeper.start()
        if feeder is not None:
            feeder.start()
        try:
            outcome = self.node.run(
                job,
                delivery.sinks,
                stop_reason=stop_reason,
                on_progress=on_progress,
                on_fragment=on_fragment,
                on_alive=on_alive,
                cancel_grace_s=s.cancel_grace_s,
                progress_timeout_s=s.progress_timeout_s,
                timeout_s=s.max_job_s,
            )
        finally:
            if feeder is not None:
                feeder.stop()  # the render returned: end the feed if it has not ended (a failure)
            keeper.stop()
        if first_fragment_at:
            log.info(
                "first fragment %.2f s after the claim",
                first_fragment_at[0] - claimed_at,
                extra={"claim_to_first_fragment_s": round(first_fragment_at[0] - claimed_at, 3)},
            )
        if outcome.status == "succeeded" and outcome.result is not None:
            wall, frames = outcome.result.wall_s, outcome.result.num_frames
            if wall > 0 and frames > 0:
                metrics.FRAMES_PER_SECOND.observe(frames / wall)
        return outcome

    def _end(
        self, lease: Lease, delivery: JobDelivery, outcome: RenderOutcome, feeder: SessionFeeder | None = None
    ) -> str:
        session = feeder.report() if feeder is not None else None
        if outcome.status == "succeeded":
            # what the row will claim must exist (issue 17 item 6: a store that lost data mid-render)
            problem = delivery.verify(self.store.segments(lease.job_id))
            if problem is not None:
                return self._retry_or_fail(
                    lease, delivery, code="output_missing", retryable=True,
                    message=f"outputs failed verification at finish: {problem}",
                )
            if feeder is not None and session is not None and feeder.end_reason == "error":
                # the sender's stream broke: what it sent until then is rendered and kept (partial)
                self.store.fail_session(
                    lease,
                    code="session_input",
                    message=f"the session's audio stream ended with an error: {feeder.error}",
                    outputs=delivery.outputs(),
                    session=session,
                )
                return "failed"
            if feeder is not None and feeder.end_reason == "cancelled" and self.store.cancel_requested(lease.job_id):
                self.store.mark_cancelled(lease, partial_outputs=delivery.outputs(), session=session)
                return "cancelled"
            self.store.finish(lease, outputs=delivery.outputs(), session=session)
            return "succeeded"
        if outcome.status == "stopped":
            return "lease_lost"
        if outcome.status == "drained":
            # the committed segments and the multipart upload stay for the next attempt
            self.store.release(lease, reason=f"worker {self.owner} shutting down")
            self._publish(lease.job_id)
            return "drained"
        if outcome.status == "cancelled":
            delivery.abandon()
            self.store.mark_cancelled(lease, partial_outputs=delivery.partial_outputs(), session=session)
            return "cancelled"
        return self._retry_or_fail(
            lease,
            delivery,
            code=outcome.code or "render_failed",
            message=outcome.message or "render failed",
            retryable=outcome.retryable,
        )

    def _retry_or_fail(
        self, lease: Lease, delivery: JobDelivery | None, *, code: str, message: str, retryable: bool
    ) -> str:
        log.error("attempt %d failed: %s: %s (retryable=%s)", lease.attempt, code, message, retryable)
        if retryable and self.store.requeue(lease, code=code, message=message):
            self._publish(lease.job_id)
            return "requeued"
        if not retryable:
            self.store.fail(lease.job_id, lease=lease, code=code, message=message)
        if delivery is not None:
            delivery.abandon()
        return "failed"

    def _publish(self, job_id: str) -> None:
        if self.celery is None:
            log.warning("no Celery app: requeued job %s waits for the next message", job_id)
            return
        rec = self.store.get(job_id)
        enqueue_render(
            self.celery,
            job_id,
            queue=self.settings.queue_name,
            priority=rec.priority if rec is not None else 5,
        )

    # ------------------------------------------------------------------------------ inputs
    def _resume_state(self, committed: Sequence[SegmentRecord], delivery: JobDelivery) -> bytes | None:
        """The state of the newest committed segment that has one (states are stored every
        ``state_every`` segments); the render re-makes the segments after it, which the delivery
        sink recognises by checksum and does not upload again. None: start from the beginning."""
        with_state = [seg for seg in committed if seg.state_key is not None]
        if not with_state:
            return None
        return delivery.load_state(with_state[-1].state_key)  # type: ignore[arg-type]

    def _fetch(self, rec: JobRecord, uri: str, field: str, workdir: Path) -> Path:
        """A local path for an input URI (downloads s3:// and upload:// into ``workdir``), after the
        same grant check the API made at submit (:class:`worker.access.InputGrants`): this worker's
        credentials must not read for the job's tenant what the tenant may not name."""
        try:
            InputGrants.from_settings(self.settings).check(rec.tenant, field, uri)
        except InputRefusedError as exc:
            raise InvalidInputError(exc.message, field=field) from exc
        parts = urlsplit(uri)
        if parts.scheme == "file":
            try:
                path = resolve_file_uri(uri, self.settings.file_root, field=field)
            except ValueError as exc:
                raise InvalidInputError(str(exc), field=field) from exc
            if not path.is_file():
                raise InvalidInputError(f"{field}: {uri!r} does not exist or is not a file", field=field)
            return path
        if parts.scheme == "s3":
            store = open_object_store(f"s3://{parts.netloc}", endpoint_url=self.settings.s3_endpoint_url)
            key = unquote(parts.path).lstrip("/")
        else:  # upload://<id>, stored by the API under the tenant
            store = open_object_store(
                self.settings.object_store_url, endpoint_url=self.settings.s3_endpoint_url
            )
            key = upload_key(rec.tenant, parts.netloc)
        dest = workdir / f"{field}{Path(key).suffix}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            store.download_to(key, dest)
        except ObjectNotFoundError as exc:
            raise InvalidInputError(f"{field}: {uri!r} does not exist; upload it again", field=field) from exc
        return dest
