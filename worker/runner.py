"""Runs one render attempt in its own spawned process and supervises it.

Who calls: :mod:`worker.tasks` builds a :class:`RenderJob` (plain, picklable) and the job's sinks,
then calls :meth:`RenderRunner.run` on the Celery task's thread. The child process (``spawn``
context: no inherited CUDA/torch state, no DB or broker connections) imports the render entry point
(``Settings.render_entry``, ``module:function``; the module also provides ``RenderRequest``), runs
it with one :class:`_PipeSink`, and streams everything back through a one-way pipe:

    ("open", InitSegment) ("write", Fragment) ("progress", dict) ("close", ok)
    then exactly one of ("done", result dict) | ("cancelled", message) | ("error", code, message, retryable)

The parent relays open/write/close to the real sinks (uploads, commits under the lease happen in
the parent), reports progress, and stops the child when asked: on cancel it sets the shared event
the render polls between chunks, waits ``cancel_grace_s``, then SIGTERM, ``kill_grace_s``, SIGKILL;
on a lost lease it goes straight to SIGTERM. The child dies with its parent (PR_SET_PDEATHSIG plus a
watchdog thread), so ``kill -9`` of a worker leaves no orphan render.

Nothing here keeps fragments after relaying them; the pipe's buffer is the only back-pressure.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import AuthenticationString as _AuthKey  # type: ignore[attr-defined]
from pathlib import Path
from typing import Any, Literal

from pipeline.media_types import Fragment, FrameSink, InitSegment

log = logging.getLogger(__name__)

OutcomeStatus = Literal["succeeded", "cancelled", "failed", "stopped"]


@dataclass(frozen=True)
class RenderJob:
    """Everything the child needs (picklable; paths are local files already fetched)."""

    job_id: str
    entry: str
    image: str
    audio: str
    text: str | None
    seed: int
    preset: str
    checkpoint: str | None
    resume_state: bytes | None
    log_level: str = "INFO"
    log_json: bool = True


@dataclass(frozen=True)
class RenderOutcome:
    """How an attempt ended. ``stopped``: the parent stopped it because the lease was lost."""

    status: OutcomeStatus
    code: str | None = None
    message: str | None = None
    retryable: bool = False
    result: dict[str, Any] | None = None
    exitcode: int | None = None


# ---------------------------------------------------------------------------------------- child side
class _PipeSink:
    """The child's only sink: forwards to the parent. Thread-safe (the render may write from its
    own thread while progress is sent from another)."""

    def __init__(self, conn: Connection, lock: threading.Lock) -> None:
        self._conn = conn
        self._lock = lock

    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            self._conn.send(msg)

    def open(self, init: InitSegment) -> None:
        self._send(("open", init))

    def write(self, fragment: Fragment) -> None:
        self._send(("write", fragment))

    def close(self, *, ok: bool) -> None:
        self._send(("close", ok))


def _die_with_parent() -> None:
    parent = os.getppid()
    try:  # Linux: the kernel kills us when the parent thread exits
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:  # portable fallback, and covers a parent that died before prctl
        while True:
            if os.getppid() != parent:
                os._exit(70)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _as_dict(obj: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return dict(vars(obj))


def _child_main(conn: Connection, cancel: Any, job: RenderJob) -> None:
    """Entry point of the render process (module-level so ``spawn`` can import it)."""
    from worker.logging import configure_logging, job_context, set_chunk

    _die_with_parent()
    configure_logging(job.log_level, json_lines=job.log_json)
    lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send(msg)

    with job_context(job.job_id):
        try:
            module_name, _, func_name = job.entry.partition(":")
            module = importlib.import_module(module_name)
            render = getattr(module, func_name)
            request = module.RenderRequest(
                image=Path(job.image),
                audio=Path(job.audio),
                text=job.text,
                seed=job.seed,
                preset=job.preset,
                checkpoint=Path(job.checkpoint) if job.checkpoint else None,
            )

            def on_progress(p: Any) -> None:
                set_chunk(getattr(p, "emission_index", None))
                send(("progress", _as_dict(p)))

            result = render(
                request,
                [_PipeSink(conn, lock)],
                mode="streaming",
                resume_state=job.resume_state,
                should_cancel=cancel.is_set,
                on_progress=on_progress,
            )
            send(("done", _as_dict(result)))
        except BaseException as exc:  # everything is reported to the parent, which decides
            code = str(getattr(exc, "code", "") or "")
            if code == "cancelled":
                send(("cancelled", str(exc)))
            elif code:
                send(("error", code, str(exc), bool(getattr(exc, "retryable", False))))
            elif isinstance(exc, MemoryError):
                send(("error", "out_of_memory", f"render ran out of host memory: {exc!r}", True))
            else:
                log.exception("render raised an unexpected %s", type(exc).__name__)
                send(("error", "render_failed", f"{type(exc).__name__}: {exc}", False))
        finally:
            conn.close()


# --------------------------------------------------------------------------------------- parent side
@contextmanager
def _children_allowed() -> Iterator[None]:
    """Celery's prefork pool runs tasks in daemonic processes, and multiprocessing refuses to start
    children from those (so that no orphans outlive an exiting daemon). The render child is
    supervised here (joined, terminated, PR_SET_PDEATHSIG), so the flag is lifted for the start."""
    cfg = mp.current_process()._config  # type: ignore[attr-defined]
    daemon = cfg.pop("daemon", None)
    authkey = cfg.get("authkey")
    if authkey is not None and not isinstance(authkey, _AuthKey):
        # billiard (the prefork pool) leaves its own AuthenticationString type here, which the
        # stdlib spawn refuses to pickle; give the child a key of the stdlib type
        cfg["authkey"] = _AuthKey(bytes(authkey))
    try:
        yield
    finally:
        if daemon is not None:
            cfg["daemon"] = daemon
        if authkey is not None:
            cfg["authkey"] = authkey


class RenderRunner:
    """Parent side of one attempt. ``stop_reason`` is polled: ``"cancel"`` (cooperative first),
    ``"lease_lost"`` (stop now), or None. Callbacks run on the caller's thread."""

    def __init__(
        self,
        job: RenderJob,
        sinks: Sequence[FrameSink],
        *,
        stop_reason: Callable[[], str | None],
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        on_fragment: Callable[[Fragment], None] | None = None,
        cancel_grace_s: float = 10.0,
        kill_grace_s: float = 5.0,
        poll_s: float = 0.1,
    ) -> None:
        self.job = job
        self.sinks = list(sinks)
        self._stop_reason = stop_reason
        self._on_progress = on_progress
        self._on_fragment = on_fragment
        self.cancel_grace_s = cancel_grace_s
        self.kill_grace_s = kill_grace_s
        self.poll_s = poll_s
        self.pid: int | None = None
        self._opened = False
        self._closed = False

    def run(self) -> RenderOutcome:
        ctx = mp.get_context("spawn")
        recv_conn, send_conn = ctx.Pipe(duplex=False)
        cancel = ctx.Event()
        with _children_allowed():
            proc = ctx.Process(
                target=_child_main, args=(send_conn, cancel, self.job), name=f"render-{self.job.job_id[:8]}"
            )
            proc.start()
        send_conn.close()  # the parent only reads; EOF then means the child is gone
        self.pid = proc.pid
        log.info("render process %s started", proc.pid)
        final: RenderOutcome | None = None
        stop: str | None = None
        cancel_deadline: float | None = None
        try:
            while True:
                reason = self._stop_reason() if stop is None else None
                if reason is not None:
                    stop = reason
                    if reason == "cancel":
                        log.info("cancel requested; asking the render to stop after this chunk")
                        cancel.set()
                        cancel_deadline = time.monotonic() + self.cancel_grace_s
                    else:
                        log.warning("stopping render process %s: %s", proc.pid, reason)
                        self._stop_process(proc)
                if cancel_deadline is not None and time.monotonic() > cancel_deadline and proc.is_alive():
                    log.warning(
                        "render did not stop within %.1f s of the cancel; terminating", self.cancel_grace_s
                    )
                    self._stop_process(proc)
                    cancel_deadline = None
                if not recv_conn.poll(self.poll_s):
                    continue
                try:
                    msg = recv_conn.recv()
                except (EOFError, OSError):
                    break
                try:
                    outcome = self._handle(msg)
                except Exception as exc:  # a real sink failed: nothing more to render for
                    log.error("sink failed: %s; stopping the render", exc)
                    self._stop_process(proc)
                    final = RenderOutcome(
                        status="failed",
                        code=str(getattr(exc, "code", "sink_error")),
                        message=str(exc),
                        retryable=bool(getattr(exc, "retryable", True)),
                    )
                    break
                if outcome is not None and final is None:
                    final = outcome
        finally:
            proc.join(self.kill_grace_s)
            if proc.is_alive():
                self._stop_process(proc)
            recv_conn.close()
            if self._opened and not self._closed:
                self._close_sinks(ok=False)
        exitcode = proc.exitcode
        if stop == "lease_lost":
            return RenderOutcome(status="stopped", code="lease_lost", message="lease lost", exitcode=exitcode)
        if final is not None:
            if final.status == "succeeded" and not self._closed:
                return RenderOutcome(
                    status="failed",
                    code="render_failed",
                    retryable=True,
                    exitcode=exitcode,
                    message="render returned without closing its sinks",
                )
            return dataclasses.replace(final, exitcode=exitcode)
        if stop == "cancel":
            return RenderOutcome(
                status="cancelled", message="render killed after the cancel grace period", exitcode=exitcode
            )
        return RenderOutcome(
            status="failed",
            code="render_crashed",
            retryable=True,
            exitcode=exitcode,
            message=f"render process {self.pid} exited with code {exitcode} before finishing "
            "(killed, out of memory, or crashed); the job resumes from its last committed chunk",
        )

    def _handle(self, msg: tuple[Any, ...]) -> RenderOutcome | None:
        kind = msg[0]
        if kind == "open":
            self._opened = True
            for sink in self.sinks:
                sink.open(msg[1])
        elif kind == "write":
            if self._on_fragment is not None:
                self._on_fragment(msg[1])
            for sink in self.sinks:
                sink.write(msg[1])
        elif kind == "close":
            self._close_sinks(ok=bool(msg[1]), raise_errors=True)
        elif kind == "progress":
            if self._on_progress is not None:
                self._on_progress(msg[1])
        elif kind == "done":
            return RenderOutcome(status="succeeded", result=msg[1])
        elif kind == "cancelled":
            return RenderOutcome(status="cancelled", code="cancelled", message=msg[1])
        elif kind == "error":
            return RenderOutcome(status="failed", code=msg[1], message=msg[2], retryable=msg[3])
        else:
            raise RuntimeError(f"render process sent an unknown message {kind!r}")
        return None

    def _close_sinks(self, *, ok: bool, raise_errors: bool = False) -> None:
        self._closed = True
        first: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close(ok=ok)
            except Exception as exc:
                if first is None:
                    first = exc
                if not raise_errors:
                    log.warning("closing sink %s (ok=%s) failed: %s", type(sink).__name__, ok, exc)
        if raise_errors and first is not None:
            raise first

    def _stop_process(self, proc: Any) -> None:
        if not proc.is_alive():
            return
        proc.terminate()
        proc.join(self.kill_grace_s)
        if proc.is_alive():
            log.warning("render process %s ignored SIGTERM for %.1f s; killing", proc.pid, self.kill_grace_s)
            proc.kill()
            proc.join()
