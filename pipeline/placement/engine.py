"""NodeEngine: one process per device, modules loaded once and kept warm, jobs run SPMD across them.

Who calls this: the worker (one NodeEngine per node, created at worker start, closed at shutdown) and
the benchmarks. The parent process never touches CUDA: ranks are spawned (not forked), each binds its
NUMA node, joins a torch.distributed group (NCCL on GPUs, gloo on CPU) through a TCP store the parent
serves on 127.0.0.1, builds a 1-D device mesh and loads its modules. ``world_size=1`` runs the same
code path (one spawned rank), so a CPU-only machine renders through the engine too.

A job is a module-level function ``job(ctx: RankContext, request) -> value`` (``RankJob``) with a
typed, picklable request; :meth:`NodeEngine.run` sends both to every rank and returns rank 0's value
(``JobResult[value]``). Rank 0 may publish events (frames, segments,
progress) while the job runs; they reach ``on_event`` in the parent in order.

Failures:
* the job raises on every rank (bad input, ...): the ranks stay up, warm; ``run`` raises (the original
  :class:`~pipeline.errors.RenderError` when it is one, else :class:`JobFailedError`).
* the job raises on some ranks while others stay blocked in a collective: after ``error_grace_s`` the
  group is torn down; ``run`` raises :class:`JobFailedError`; the next ``run`` starts a fresh group.
* a rank process dies (killed, segfault, OOM killer): ``run`` raises :class:`RankDiedError` naming the
  rank, its pid and exit code; the group is torn down and restarted at the next ``run``.
* the job exceeds ``timeout_s``: :class:`JobTimeoutError` naming the ranks still running; restart.
* a rank sends something that is not a protocol message (a torn pickle, a foreign object):
  :class:`RankProtocolError` (retryable) with the reader's traceback, at once; the ranks are killed
  (they may still be inside the job) and restart at the next ``run``.

Why one file of ~480 lines: the supervision loop (``run``), the receive/validate step and each
failure path share the group's state (pipes, sentinels, the cancel event) and one deadline; split,
every failure path would need that state passed around or re-derived.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as MpEvent
from types import TracebackType
from typing import Generic, NoReturn, TypeVar, cast

import torch.distributed as dist
import torch.multiprocessing as tmp

from pipeline.errors import ModuleLoadError, RenderError
from pipeline.placement.rank import ModuleLoader, RankContext, RankError, RankReport, RankSpec, rank_main

logger = logging.getLogger(__name__)

Request = TypeVar("Request")
Value = TypeVar("Value")
EventCallback = Callable[[object], None]


class RankDiedError(RenderError):
    """A rank process exited while the engine needed it; the job is lost, the group restarts."""

    code = "rank_died"
    retryable = True


class JobFailedError(RenderError):
    """The job raised on a rank (an exception that is not a RenderError, or a partial failure)."""

    code = "job_failed"


class RankProtocolError(RenderError):
    """A rank sent something that is not a message of the protocol (a torn or foreign pickle). The
    ranks' state is unknown (they may still be rendering), so they are killed; the job may retry."""

    code = "rank_protocol"
    retryable = True


class JobTimeoutError(RenderError):
    """The job did not finish on every rank within its timeout; the group restarts."""

    code = "job_timeout"
    retryable = True


@dataclass(frozen=True)
class EngineConfig:
    """How a NodeEngine lays out its ranks. One per node, from the worker's settings."""

    world_size: int = 1
    """Rank processes (one per GPU; 1 on a CPU-only machine)."""
    device_type: str = "cpu"
    """"cuda" (NCCL, rank i on cuda:i) or "cpu" (gloo)."""
    loaders: Mapping[str, ModuleLoader] = field(default_factory=dict)
    """Module name -> its loader ``fn(ctx) -> nn.Module`` (picklable: module-level function or a
    ``functools.partial`` of one). Run in order."""
    threads_per_rank: int = 1
    """torch intra-op threads per rank (CPU ranks; GPU ranks need few)."""
    start_timeout_s: float = 600.0
    """Seconds for every rank to join the group and load its modules."""
    collective_timeout_s: float = 300.0
    """Process-group timeout: a collective blocked longer than this raises on the rank."""
    error_grace_s: float = 10.0
    """After one rank reports an error, seconds the others get to report before a restart."""
    numa: bool = True
    """Bind each rank to its GPU's NUMA node (no-op without GPU or with one node)."""
    park: bool | None = None
    """Park idle stage models in host memory (None: only on CUDA)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"EngineConfig.world_size must be >= 1, got {self.world_size}")
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"EngineConfig.device_type must be 'cuda' or 'cpu', got {self.device_type!r}")
        for name, loader in self.loaders.items():
            if not callable(loader):  # else each rank fails at start with "'str' object is not callable"
                raise TypeError(
                    f"EngineConfig.loaders[{name!r}] is {loader!r}, not a callable; pass the loader function "
                    "itself (a module-level function or a functools.partial of one), not its import path"
                )


@dataclass(frozen=True)
class JobResult(Generic[Value]):
    """Rank 0's return value and each rank's figures for one job."""

    value: Value
    ranks: tuple[RankReport, ...]
    wall_s: float


@dataclass
class _Group:
    """One generation of rank processes (replaced as a whole on restart)."""

    procs: list[BaseProcess]
    conns: list[Connection]
    cancel: MpEvent
    store: dist.TCPStore


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code} (exit code {code})"
    return f"exited with code {code}"


_MESSAGE_ARITY = {"ready": 3, "fatal": 3, "event": 3, "done": 5, "error": 4}


def _checked(rank: int, message: object) -> tuple[object, ...]:
    """``message`` if it has the shape of a rank message (module docstring of ``rank``), else raise."""
    if (
        not isinstance(message, tuple)
        or not message
        or _MESSAGE_ARITY.get(str(message[0])) != len(message)
    ):
        raise TypeError(f"unknown message from rank {rank}: {_describe(message)}")
    return message


def _describe(obj: object, limit: int = 120) -> str:
    text = repr(obj)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(obj).__name__})"


def job_name(job: Callable[..., object]) -> str:
    """``"package.module:function"`` of a rank job; raises when it is not module-level (the ranks
    unpickle a function by that name, so a local function or a lambda cannot reach them)."""
    qualname = getattr(job, "__qualname__", "")
    module = getattr(job, "__module__", None)
    if not callable(job) or not qualname or not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"job {job!r} must be a module-level function (the ranks import it by name)")
    return f"{module}:{qualname}"


class NodeEngine:
    """Supervises the rank processes of one node and runs jobs on them (see module docstring).

    Use as a context manager or call :meth:`start` / :meth:`close`. Not thread-safe: one job at a
    time (a node renders one request at a time across all its GPUs).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._group: _Group | None = None
        self._job_id = 0
        self.generation = 0
        self.ready_info: list[dict[str, object]] = []

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> NodeEngine:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def is_running(self) -> bool:
        return self._group is not None

    @property
    def pids(self) -> list[int]:
        """Pids of the current rank processes (index = rank)."""
        if self._group is None:
            return []
        return [int(p.pid) for p in self._group.procs if p.pid is not None]

    def start(self) -> None:
        """Spawn the ranks and wait until each has joined the group and loaded its modules."""
        if self._group is not None:
            return
        cfg = self.config
        ctx = tmp.get_context("spawn")
        # The parent serves the rendezvous store: it holds the port, so no free-port race.
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=cfg.start_timeout_s),
        )
        spec = RankSpec(
            world_size=cfg.world_size,
            device_type=cfg.device_type,
            store_port=store.port,
            loaders=tuple(cfg.loaders.items()),
            threads_per_rank=cfg.threads_per_rank,
            collective_timeout_s=cfg.collective_timeout_s,
            numa=cfg.numa,
            park=cfg.park,
            parent_pid=os.getpid(),
        )
        cancel = ctx.Event()
        procs: list[BaseProcess] = []
        conns: list[Connection] = []
        for rank in range(cfg.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=rank_main, args=(rank, spec, child_end, cancel), name=f"longtake-rank{rank}"
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        self._group = _Group(procs, conns, cancel, store)
        self.generation += 1
        info: dict[int, dict[str, object]] = {}
        deadline = time.monotonic() + cfg.start_timeout_s
        try:
            while len(info) < cfg.world_size:
                for rank, message in self._receive(deadline, "start"):
                    if message[0] == "fatal":
                        raise ModuleLoadError(
                            f"rank {rank} failed to start (joining the process group or loading modules "
                            f"{sorted(cfg.loaders)}): {message[2]}"
                        )
                    info[rank] = cast(dict[str, object], message[2])
        except BaseException:
            self._teardown()
            raise
        self.ready_info = [info[r] for r in range(cfg.world_size)]
        logger.info(
            "node engine generation %d up: %d ranks on %s, pids %s",
            self.generation,
            cfg.world_size,
            cfg.device_type,
            self.pids,
        )

    def restart(self) -> None:
        """Tear the group down (killing ranks) and start a fresh one."""
        self._teardown()
        self.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the ranks politely (they leave the process group), killing any that do not exit."""
        group = self._group
        if group is None:
            return
        for conn in group.conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):  # that rank is already gone: join() below reaps it
                continue
        deadline = time.monotonic() + timeout_s
        for proc in group.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._teardown()

    def _teardown(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        for proc in group.procs:
            if proc.is_alive():
                proc.kill()
        for proc in group.procs:
            proc.join(10.0)
        for conn in group.conns:
            conn.close()

    # -- jobs -------------------------------------------------------------------------------
    def run(
        self,
        job: Callable[[RankContext, Request], Value],
        request: Request,
        *,
        timeout_s: float | None = None,
        on_event: EventCallback | None = None,
        should_cancel: Callable[[], bool] | None = None,
        poll_s: float = 0.2,
    ) -> JobResult[Value]:
        """Run ``job(ctx, request)`` on every rank; return rank 0's value and per-rank figures.

        ``on_event`` receives what rank 0 publishes, in order, on this thread. If it raises, the job
        is asked to cancel (``ctx.cancel_requested()``) and the exception is re-raised once the ranks
        stop (after ``error_grace_s`` they are killed and the group restarts at the next job).
        ``should_cancel`` is polled every ``poll_s`` seconds and asks the job to cancel; the job
        decides how to end (the pipeline raises ``CancelledError``). If ``should_cancel`` raises, the
        job is stopped the hard way: the ranks are killed at once (the group restarts at the next
        job) and that exception propagates — the caller's way to enforce a cancel grace period.
        """
        path = job_name(job)
        self.start()  # no-op when up; restarts after a failure tore the group down
        group = self._group
        assert group is not None
        self._job_id += 1
        job_id = self._job_id
        group.cancel.clear()
        started = time.monotonic()
        deadline = started + timeout_s if timeout_s is not None else float("inf")
        for rank, conn in enumerate(group.conns):
            try:
                conn.send(("job", job_id, job, request))
            except (BrokenPipeError, OSError):
                self._fail_dead(rank, "before the job started")
        values: dict[int, object] = {}
        reports: dict[int, RankReport] = {}
        errors: dict[int, RankError] = {}
        callback_error: BaseException | None = None
        while len(reports) + len(errors) < len(group.conns):
            for rank, message in self._receive(min(deadline, time.monotonic() + poll_s), path, job_id=job_id):
                kind = message[0]
                if (
                    kind == "event"
                    and message[1] == job_id
                    and callback_error is None
                    and on_event is not None
                ):
                    try:
                        on_event(message[2])
                    except BaseException as exc:  # re-raised below once the ranks have stopped
                        callback_error = exc
                        group.cancel.set()
                        # a job that does not poll ctx.cancel_requested() is stopped the hard way
                        deadline = min(deadline, time.monotonic() + self.config.error_grace_s)
                elif kind == "done" and message[1] == job_id:
                    values[rank], reports[rank] = message[3], cast(RankReport, message[4])
                elif kind == "error" and message[1] == job_id:
                    if not errors:  # the other ranks get a grace period to report too
                        deadline = min(deadline, time.monotonic() + self.config.error_grace_s)
                    errors[rank] = cast(RankError, message[3])
            if should_cancel is not None:
                try:
                    cancel_now = should_cancel()
                except BaseException:
                    self._teardown()
                    raise
                if cancel_now:
                    group.cancel.set()
            if time.monotonic() >= deadline and len(reports) + len(errors) < len(group.conns):
                running = [r for r in range(len(group.conns)) if r not in reports and r not in errors]
                self._teardown()
                if callback_error is not None:
                    raise callback_error
                if errors:
                    raise self._job_error(path, errors, stuck=running)
                raise JobTimeoutError(
                    f"job {path} did not finish within timeout_s={timeout_s} on ranks {running}; "
                    "the node engine was restarted (raise timeout_s if the job is legitimately this long)"
                )
        if callback_error is not None:
            raise callback_error
        if errors:
            raise self._job_error(path, errors, stuck=[])
        return JobResult(
            cast(Value, values.get(0)), tuple(reports[r] for r in sorted(reports)), time.monotonic() - started
        )

    def _job_error(self, path: str, errors: dict[int, RankError], stuck: list[int]) -> RenderError:
        first = errors[min(errors)]
        restart_note = (
            f"; ranks {stuck} were still inside the job (likely blocked in a collective) and the node engine "
            "was restarted"
            if stuck
            else ""
        )
        if first.exception is not None:
            original = pickle.loads(first.exception)
            if isinstance(original, RenderError) and not stuck:
                original.add_note(f"raised on rank {first.rank} of job {path}\n{first.traceback}")
                return original
        return JobFailedError(
            f"job {path} raised {first.type_name} on rank {first.rank}: {first.message}{restart_note}\n"
            f"failing ranks: {sorted(errors)}\n{first.traceback}"
        )

    def _fail_dead(self, rank: int, when: str) -> None:
        group = self._group
        assert group is not None
        proc = group.procs[rank]
        proc.join(5.0)
        reason = _describe_exit(proc.exitcode)
        self._teardown()
        consequence = (
            "the job is lost and the node engine will restart its rank processes at the next job"
            if "job" in when
            else "the node engine did not start (see the rank's stderr for its traceback)"
        )
        raise RankDiedError(f"rank {rank} (pid {proc.pid}) {reason} {when}; {consequence}")

    def _fail_protocol(self, rank: int, what: str, exc: Exception) -> NoReturn:
        """The pipe from ``rank`` carried something that is not a message. Nothing after it can be
        trusted (the stream may be torn mid-message) and the ranks may still be running the job, so
        they are killed; the next job starts a fresh group."""
        pids = self.pids
        self._teardown()
        trace = "".join(traceback.format_exception(exc))
        logger.error("rank %d sent a corrupt message during %s; ranks %s killed\n%s", rank, what, pids, trace)
        raise RankProtocolError(
            f"rank {rank} sent a message the engine cannot read during {what} "
            f"({type(exc).__name__}: {exc}); its ranks {pids} were killed and restart at the next job "
            f"(the job may retry)\n{trace}"
        ) from exc

    def _receive(
        self, deadline: float, what: str, *, job_id: int | None = None
    ) -> list[tuple[int, tuple[object, ...]]]:
        """Messages available before ``deadline``; raises RankDiedError if a rank process exits."""
        group = self._group
        assert group is not None
        timeout = max(0.0, deadline - time.monotonic())
        if timeout == float("inf"):
            timeout = 3600.0
        by_conn = {conn: rank for rank, conn in enumerate(group.conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(group.procs)}
        ready = wait([*group.conns, *by_sentinel], timeout)
        out: list[tuple[int, tuple[object, ...]]] = []
        for item in ready:
            if item in by_conn:
                conn = item
                rank = by_conn[conn]
                try:
                    while conn.poll():
                        out.append((rank, _checked(rank, conn.recv())))
                except (EOFError, OSError):
                    continue  # the pipe closed: the sentinel of that rank tells why
                except Exception as exc:  # bytes that do not unpickle, or not a protocol message
                    self._fail_protocol(rank, what, exc)
        # A rank exits only when told to stop: any exit here is a death. Messages read in the same
        # round no longer matter (the job or the start fails either way).
        if any(message[0] == "fatal" for _, message in out):
            return out  # the caller raises with the rank's own account of why it stopped
        for item in ready:
            if item in by_sentinel:
                when = "while the engine was starting" if job_id is None else f"during job {what}"
                self._fail_dead(by_sentinel[item], when)
        if job_id is None and not out and time.monotonic() >= deadline:
            self._teardown()
            raise ModuleLoadError(
                f"ranks did not report ready within start_timeout_s={self.config.start_timeout_s}s "
                "(loading modules too slow, or a rank is stuck joining the process group)"
            )
        return out
