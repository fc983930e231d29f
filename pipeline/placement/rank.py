"""The rank side of the NodeEngine: what one spawned process per device does, and what a job sees.

Who runs this: :class:`pipeline.placement.engine.NodeEngine` spawns :func:`rank_main` once per device
(spawn start method: no CUDA state is inherited from the parent). The process binds NUMA, joins the
process group, builds a 1-D device mesh, loads every module once through its loader, reports ready and
then runs jobs until told to stop. A job is a module-level function ``job(ctx, request) -> value``
with a typed, picklable request; it crosses the pipe as pickle sends functions (by reference, so it
must be importable at module level), every rank runs it (SPMD) and rank 0's return value goes back
to the caller. Modules stay warm in ``ctx.modules`` between jobs.

Messages (parent <- rank): ("ready", rank, info) | ("fatal", rank, text) once at start;
("event", job_id, obj) any number of times during a job (rank 0 publishing); ("done", job_id, rank,
value, report) | ("error", job_id, rank, error) once per job. Parent -> rank: ("job", job_id, job,
request) | ("stop",).

Every message a rank sends goes through its :class:`RankOutbox`, one lock around the pipe: rank 0
publishes from more than one thread (the render loop's progress, the publisher lane's fragments), and
``Connection.send`` writes a large message in several ``write`` calls, so two unsynchronised senders
interleave their bytes and the engine reads garbage (it then kills the ranks: see
``NodeEngine._receive``).
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler as _ForkingPickler
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.placement.fsdp import reset_after_failure
from pipeline.placement.numa import NumaBinding, bind_numa
from pipeline.placement.parking import ModelParker

logger = logging.getLogger(__name__)


class RankOutbox:
    """The rank's end of its pipe to the engine, safe to send on from any thread (one lock).

    Who calls: :meth:`RankContext.publish` (any thread of rank 0's job) and the rank's serve loop
    (ready, done, error). Nothing is kept after ``send`` returns.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[object, ...]) -> None:
        data = _ForkingPickler.dumps(message)  # pickled outside the lock: only the write is serialised
        with self._lock:
            self.conn.send_bytes(data)


@dataclass
class RankContext:
    """What a job function and a module loader receive on each rank.

    ``modules`` holds the warm modules (loaded once per rank, kept between jobs); a job must not keep
    references to per-job tensors on the context (they would outlive the job). ``parker`` parks and
    returns stage models (a no-op on CPU unless enabled).
    """

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup
    mesh: DeviceMesh
    numa: NumaBinding
    parker: ModelParker
    modules: dict[str, nn.Module] = field(default_factory=dict)
    job_id: int = 0
    _outbox: RankOutbox | None = None
    _cancel: MpEvent | None = None

    @property
    def is_publisher(self) -> bool:
        """Rank 0 publishes frames/segments and returns the job's value."""
        return self.rank == 0

    def publish(self, event: object) -> None:
        """Send ``event`` (picklable) to the caller's ``on_event`` now. Rank 0 only; any thread (events
        of one thread arrive in that thread's order)."""
        if not self.is_publisher:
            raise RuntimeError(f"rank {self.rank} called publish(); only rank 0 publishes (ctx.is_publisher)")
        if self._outbox is None:
            raise RuntimeError("publish() outside a job: the context has no connection to the engine")
        self._outbox.send(("event", self.job_id, event))

    def cancel_requested(self) -> bool:
        """True once the caller asked to cancel this job (poll between chunks, then raise)."""
        return self._cancel is not None and self._cancel.is_set()


ModuleLoader = Callable[[RankContext], nn.Module]
"""Builds one module on a rank (called once per rank at start, after the process group is up). It
may shard the module (``parallelize(model, ctx.mesh)``) and register it with ``ctx.parker``. A loader
crosses the spawn boundary by pickling: a module-level function or a ``functools.partial`` of one."""

RankJob = Callable[[RankContext, Any], object]
"""What :meth:`NodeEngine.run` runs on every rank: ``job(ctx, request) -> value``, module-level."""


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to start (picklable; sent through spawn)."""

    world_size: int
    device_type: str  # "cuda" or "cpu"
    store_port: int
    loaders: tuple[tuple[str, ModuleLoader], ...]  # (module name, loader), run in order
    threads_per_rank: int
    collective_timeout_s: float
    numa: bool
    park: bool | None
    parent_pid: int = 0  # the engine's process; the rank dies with it (0: do not watch)


@dataclass(frozen=True)
class RankReport:
    """Per-rank figures of one job. ``peak_bytes``: device peak on CUDA, peak RSS on CPU."""

    rank: int
    wall_s: float
    peak_bytes: int
    peak_kind: str  # "cuda_allocated" or "rss"


@dataclass(frozen=True)
class RankError:
    """A job's exception on one rank, as text (and the exception itself when it pickles)."""

    rank: int
    type_name: str
    message: str
    traceback: str
    exception: bytes | None


def _read_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    return int(match.group(1)) * 1024 if match else 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the peak RSS (VmHWM) of this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:  # peak then covers the whole process lifetime; say so once
        logger.warning(
            "cannot reset peak RSS (/proc/self/clear_refs: %s): peaks are since process start", exc
        )


def _peak(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_allocated"
    return _read_hwm_bytes(), "rss"


def _pickled(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:  # an exception type that cannot cross processes travels as text only
        return None
    return data


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` (the engine) goes away, however it goes (``kill -9``
    included), so no rank outlives its worker: ``PR_SET_PDEATHSIG`` (Linux; fires when the parent
    *thread* that spawned us exits, so the engine must be started from a long-lived thread) plus a
    watchdog thread that also covers a parent that died before the ``prctl``."""
    if parent_pid <= 0:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not glibc/Linux: the watchdog alone covers it
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(70)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def rank_main(rank: int, spec: RankSpec, conn: Connection, cancel: MpEvent) -> None:
    """Entry point of a spawned rank process (see the module docstring for the message protocol)."""
    die_with_parent(spec.parent_pid)
    outbox = RankOutbox(conn)
    logging.basicConfig(level=os.environ.get("LONGTAKE_LOG_LEVEL", "WARNING"))
    torch.set_num_threads(spec.threads_per_rank)
    device_index = rank if spec.device_type == "cuda" else None
    try:
        numa = bind_numa(device_index) if spec.numa else NumaBinding(None, (), False, False, "", "disabled")
        if spec.device_type == "cuda":  # GPU-only
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        store = dist.TCPStore(
            "127.0.0.1",
            spec.store_port,
            is_master=False,
            timeout=timedelta(seconds=spec.collective_timeout_s),
        )
        dist.init_process_group(
            backend="nccl" if spec.device_type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.collective_timeout_s),
            device_id=device if spec.device_type == "cuda" else None,
        )
        mesh = init_device_mesh(spec.device_type, (spec.world_size,))
        group = dist.group.WORLD
        assert group is not None
        ctx = RankContext(
            rank, spec.world_size, device, group, mesh, numa, ModelParker(device, enabled=spec.park)
        )
        for name, loader in spec.loaders:
            module = loader(ctx)
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"loader {loader!r} for module {name!r} returned {type(module).__name__}, not nn.Module"
                )
            ctx.modules[name] = module
    except BaseException as exc:
        outbox.send(("fatal", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    outbox.send(("ready", rank, {"numa": numa.reason, "cpus": list(numa.cpus), "device": str(device)}))
    try:
        _serve(ctx, outbox, cancel)
    finally:
        dist.destroy_process_group()


def _serve(ctx: RankContext, outbox: RankOutbox, cancel: MpEvent) -> None:
    while True:
        message = outbox.conn.recv()
        if message[0] == "stop":
            return
        _, job_id, job, request = message
        ctx.job_id, ctx._outbox, ctx._cancel = job_id, outbox, cancel
        _reset_peak(ctx.device)
        start = time.perf_counter()
        try:
            value = job(ctx, request)
        except Exception as exc:
            for module in ctx.modules.values():
                reset_after_failure(module)
            error = RankError(ctx.rank, type(exc).__name__, str(exc), traceback.format_exc(), _pickled(exc))
            outbox.send(("error", job_id, ctx.rank, error))
            continue
        finally:
            ctx._outbox = None
        if ctx.device.type == "cuda":  # GPU-only: the job's kernels belong to its wall time
            torch.cuda.synchronize(ctx.device)
        peak, kind = _peak(ctx.device)
        report = RankReport(ctx.rank, time.perf_counter() - start, peak, kind)
        outbox.send(("done", job_id, ctx.rank, value if ctx.is_publisher else None, report))
