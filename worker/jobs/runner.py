"""Runs one render attempt on this worker's NodeEngine (persistent, warm rank processes).

Who calls: :mod:`worker.jobs.tasks` — :class:`JobWorker` owns one :class:`NodeExecutor` for the life of
the worker process (started lazily by the first job, on the task's thread: in the prefork pool that
is the pool child, never the Celery parent). Per attempt it builds a :class:`RenderJob` (plain,
picklable) and the job's sinks, then calls :meth:`NodeExecutor.run` on the task's thread.

Every rank runs :func:`render_attempt` (:func:`pipeline.placement.render_job.render_on_rank` with
the worker's JSON logging) on the typed :class:`RenderJob`; rank 0 publishes init/fragments/close
and progress (``RenderEvent``), which arrive here in order and are relayed by the one
:class:`~pipeline.placement.relay.SinkRelay` to the real sinks (uploads and lease-fenced commits happen in this process, next to the job row). The
ranks keep their modules between jobs, so the model family is loaded once per worker, not per job.

Stopping: ``stop_reason`` is polled; on ``"cancel"``, ``"lease_lost"`` or ``"drain"`` the job's cancel flag is
set and the render ends between chunks; if it has not ended after ``cancel_grace_s`` the engine
kills its ranks (they are restarted, cold, by the next job). A rank that dies mid-job ends the
attempt with the engine's ``RankDiedError`` (retryable, names the rank, pid and signal). The ranks
die with this process (``PR_SET_PDEATHSIG`` + a watchdog in :mod:`pipeline.placement.rank`), so
``kill -9`` of a worker leaves no orphan render.

Nothing here keeps fragments after relaying them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.process import AuthenticationString as _AuthKey  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Literal

from pipeline.errors import RenderError
from pipeline.media_types import Fragment, FrameSink
from pipeline.placement.relay import SinkRelay
from pipeline.placement.render_job import RankRenderRequest, RankRenderResult, WarmReport
from pipeline.request import RenderProgress, RenderResult
from worker.jobs import metrics

if TYPE_CHECKING:  # torch is imported only where the engine is used, never by the Celery parent
    from pathlib import Path

    from pipeline.placement.engine import NodeEngine
    from pipeline.placement.rank import RankContext

log = logging.getLogger(__name__)

OutcomeStatus = Literal["succeeded", "cancelled", "failed", "stopped", "drained"]


@dataclass(frozen=True)
class RenderJob:
    """One attempt for the ranks (picklable; the request's paths are local files already fetched)."""

    job_id: str
    render: RankRenderRequest
    log_level: str = "INFO"
    log_json: bool = True


@dataclass(frozen=True)
class RenderOutcome:
    """How an attempt ended. ``stopped``: the parent stopped it because the lease was lost;
    ``drained``: stopped between chunks because the worker is shutting down (SIGTERM)."""

    status: OutcomeStatus
    code: str | None = None
    message: str | None = None
    retryable: bool = False
    result: RenderResult | None = None
    warm: WarmReport | None = None


# ------------------------------------------------------------------------------------------ rank side
_logging_configured = False


def render_attempt(ctx: RankContext, job: RenderJob) -> RankRenderResult:
    """The rank job of the worker: :func:`render_on_rank` with the worker's logging (job id on
    records)."""
    global _logging_configured
    from pipeline.placement.render_job import render_on_rank
    from worker.logging import configure_logging, job_context

    if not _logging_configured:
        configure_logging(job.log_level, json_lines=job.log_json)
        _logging_configured = True
    with job_context(job.job_id):
        return render_on_rank(ctx, job.render)


# --------------------------------------------------------------------------------------- parent side
@contextmanager
def _children_allowed() -> Iterator[None]:
    """Celery's prefork pool runs tasks in daemonic processes, and multiprocessing refuses to start
    children from those (so that no orphans outlive an exiting daemon). The ranks are supervised
    (joined, killed, PR_SET_PDEATHSIG), so the flag is lifted while the engine starts them."""
    cfg = mp.current_process()._config  # type: ignore[attr-defined]
    daemon = cfg.pop("daemon", None)
    authkey = cfg.get("authkey")
    if authkey is not None and not isinstance(authkey, _AuthKey):
        # billiard (the prefork pool) leaves its own AuthenticationString type here, which the
        # stdlib spawn refuses to pickle; give the children a key of the stdlib type
        cfg["authkey"] = _AuthKey(bytes(authkey))
    try:
        yield
    finally:
        if daemon is not None:
            cfg["daemon"] = daemon
        if authkey is not None:
            cfg["authkey"] = authkey


class _StopOverdue(Exception):
    """Raised from ``should_cancel`` when the render ignored a stop for ``cancel_grace_s``: the
    engine then kills its ranks (see ``NodeEngine.run``)."""


class _Stalled(Exception):
    """Raised from ``should_cancel`` when the ranks sent nothing for ``progress_timeout_s``: the
    engine kills them and the attempt ends retryable (``render_stalled``)."""


class NodeExecutor:
    """This worker process's NodeEngine and how one attempt runs on it. Not thread-safe: one
    attempt at a time (the worker renders one job at a time across its node)."""

    def __init__(
        self,
        *,
        ranks: int,
        device: str,
        threads_per_rank: int,
        start_timeout_s: float = 600.0,
        preset: str = "tiny",
        checkpoint: Path | None = None,
        family: str = "tiny",
    ) -> None:
        self.ranks = ranks
        self.family = family
        self.preset = preset
        self.checkpoint = checkpoint
        self.device = device
        self.threads_per_rank = threads_per_rank
        self.start_timeout_s = start_timeout_s
        self._engine: NodeEngine | None = None
        self._owner_pid = os.getpid()

    @property
    def engine(self) -> NodeEngine:
        """The engine (created on first use; ranks spawned by the first ``run``)."""
        if self._engine is None:
            from pipeline.families import FAMILIES
            from pipeline.placement.engine import EngineConfig, NodeEngine
            from pipeline.placement.loaders import family_loaders

            # One rank renders with its own (lazily loaded, warm) family; several ranks shard the
            # family's large models across them, loaded once when the engine starts.
            loaders = (family_loaders(FAMILIES.get(self.family), self.preset, checkpoint=self.checkpoint)
                       if self.ranks > 1 else {})
            self._engine = NodeEngine(
                EngineConfig(
                    loaders=loaders,
                    world_size=self.ranks,
                    device_type=self.device,
                    threads_per_rank=self.threads_per_rank,
                    start_timeout_s=self.start_timeout_s,
                )
            )
        return self._engine

    @property
    def pids(self) -> list[int]:
        return self._engine.pids if self._engine is not None else []

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the ranks (worker shutdown). Only the process that started them may."""
        if self._engine is not None and os.getpid() == self._owner_pid:
            self._engine.close(timeout_s=timeout_s)

    def run(
        self,
        job: RenderJob,
        sinks: Sequence[FrameSink],
        *,
        stop_reason: Callable[[], str | None],
        on_progress: Callable[[RenderProgress], None] | None = None,
        on_fragment: Callable[[Fragment], None] | None = None,
        on_alive: Callable[[float], None] | None = None,
        cancel_grace_s: float = 10.0,
        progress_timeout_s: float = 900.0,
        timeout_s: float | None = None,
        poll_s: float = 0.1,
    ) -> RenderOutcome:
        """Render ``job`` into ``sinks`` on the ranks; never raises for render/sink/rank failures.

        Every event from the ranks counts as a sign of life; ``progress_timeout_s`` without one
        (a rank deadlocked, a collective that never returns) kills the ranks and ends the attempt
        as retryable ``render_stalled``. ``on_alive(grace_s)`` hears every such sign of life, and
        before the ranks (re)start ``on_alive(start_timeout_s)``: their start is bounded by that,
        not by ``progress_timeout_s`` (the worker's lease keeper uses it to tell a stuck render
        thread from a busy one).
        """
        alive = on_alive or (lambda grace_s: None)
        relay = SinkRelay(sinks, on_progress=on_progress, on_fragment=on_fragment)
        stop: list[str] = []
        stop_at: list[float] = []
        last_event = [time.monotonic()]

        def on_event(event: object) -> None:
            last_event[0] = time.monotonic()
            alive(0.0)
            relay.on_event(event)

        def should_cancel() -> bool:
            silent_s = time.monotonic() - last_event[0]
            if silent_s > progress_timeout_s:
                raise _Stalled(
                    f"the render sent nothing (no progress, no fragment) for {silent_s:.0f} s, more than "
                    f"progress_timeout_s={progress_timeout_s:g}; its ranks {self.pids} were killed and the "
                    "job resumes from its last committed segment (raise LONGTAKE_PROGRESS_TIMEOUT_S if "
                    "one chunk of this model legitimately takes longer)"
                )
            if not stop:
                reason = stop_reason()
                if reason is not None:
                    stop.append(reason)
                    stop_at.append(time.monotonic())
                    log.info("%s: asking the render to stop after this chunk", reason)
            if stop and time.monotonic() - stop_at[0] > cancel_grace_s:
                raise _StopOverdue(
                    f"render did not stop within cancel_grace_s={cancel_grace_s} s of the {stop[0]}; "
                    f"its ranks {self.pids} were killed and restart at the next job"
                )
            return bool(stop)

        engine = self.engine
        outcome: RenderOutcome
        try:
            with _children_allowed():
                alive(self.start_timeout_s)
                engine.start()  # (re)spawning ranks is not the render's silence: start_timeout_s bounds it
                last_event[0] = time.monotonic()
                alive(0.0)
                result = engine.run(
                    render_attempt,
                    job,
                    timeout_s=timeout_s,
                    on_event=on_event,
                    should_cancel=should_cancel,
                    poll_s=poll_s,
                )
            rendered, warm = result.value.result, result.value.warm
            log.info(
                "render done on engine generation %d (rank pids %s): %s",
                engine.generation,
                engine.pids,
                warm,
                extra={"warm": asdict(warm), "ttff_s": rendered.ttff_s, "wall_s": rendered.wall_s},
            )
            outcome = RenderOutcome(status="succeeded", result=rendered, warm=warm)
            if not relay.closed:
                outcome = RenderOutcome(
                    status="failed",
                    code="render_failed",
                    retryable=True,
                    message="render returned without closing its sinks",
                )
        except _StopOverdue as exc:
            log.warning("%s", exc)
            outcome = RenderOutcome(status="cancelled", code="cancelled", message=str(exc))
        except _Stalled as exc:
            log.error("%s", exc)
            metrics.STALLS.labels("ranks_killed").inc()
            outcome = RenderOutcome(status="failed", code="render_stalled", message=str(exc), retryable=True)
        except RenderError as exc:
            # from the ranks (original type), the engine (rank died, ...) or a sink: SinkError,
            # StorageError, LeaseLostError (worker.errors) all carry their code and retryable flag
            if exc.code == "cancelled":
                outcome = RenderOutcome(status="cancelled", code="cancelled", message=str(exc))
            else:
                outcome = RenderOutcome(
                    status="failed", code=exc.code, message=str(exc), retryable=exc.retryable
                )
        except Exception as exc:  # a sink broke outside the error hierarchy (a bug): retry the attempt
            log.exception("sink failed: %s; the render was stopped", exc)
            outcome = RenderOutcome(status="failed", code="sink_error", message=str(exc), retryable=True)
        finally:
            if relay.opened and not relay.closed:
                relay.close(ok=False)
        if stop and stop[0] == "lease_lost":
            return RenderOutcome(status="stopped", code="lease_lost", message="lease lost")
        if stop and stop[0] == "drain" and outcome.status == "cancelled":
            return RenderOutcome(status="drained", code="drained", message="worker shutting down")
        return outcome
