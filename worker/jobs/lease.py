"""LeaseKeeper: the thread that keeps an attempt's lease alive and notices cancels and stalls.

Who calls what: :meth:`worker.jobs.tasks.JobWorker.run` starts one per attempt around the render;
:meth:`worker.jobs.runner.NodeExecutor.run` calls :meth:`LeaseKeeper.alive` on every event from the
ranks (and around the ranks' start), the task feeds :meth:`LeaseKeeper.report` from the render's
progress, and the runner polls :meth:`LeaseKeeper.stop_reason` between chunks.
"""

from __future__ import annotations

import logging
import threading
import time

from worker.jobs import metrics
from worker.jobs.records import Lease, Progress
from worker.jobs.store import JobStore
from worker.logging import job_context

log = logging.getLogger(__name__)


class LeaseKeeper(threading.Thread):
    """Heartbeats the lease and polls the cancel flag while the render runs (daemon thread).

    A DB outage is ridden out inside the store's retries (``db_outage_max_s``); the reapers hold
    off after one, so the lease stays ours when the database comes back.

    Drain: when ``drain`` is set (the worker got SIGTERM), :meth:`stop_reason` answers ``"drain"``
    and the render stops between chunks; the task then hands the job back (``JobStore.release``).

    Heartbeats prove that this process is alive, not that the render moves: when nothing has been
    heard from the render for ``stall_s`` (``alive`` is called on every event from the ranks; while
    the ranks start, with a grace of the start's own bound), the keeper stops heartbeating and lets
    the lease expire, so the reaper hands the job to
    another worker and this one's late commits are fenced. The render thread normally acts first
    (``NodeExecutor.run`` kills stalled ranks after ``progress_timeout_s``); this covers a render
    thread that is itself stuck, e.g. in a sink call that never returns.
    """

    def __init__(
        self,
        store: JobStore,
        lease: Lease,
        *,
        heartbeat_s: float,
        cancel_poll_s: float,
        stall_s: float = float("inf"),
        drain: threading.Event | None = None,
    ) -> None:
        super().__init__(name=f"lease-{lease.job_id[:8]}", daemon=True)
        self.store = store
        self.lease = lease
        self.heartbeat_s = heartbeat_s
        self.cancel_poll_s = cancel_poll_s
        self.stall_s = stall_s
        self.drain = drain
        self.progress: Progress | None = None
        self.lease_lost = False
        self.stalled = False
        self.cancel = False
        self.last_alive = time.monotonic()
        self._silent_until = self.last_alive + stall_s
        self._halt = threading.Event()
        self._wake = threading.Event()

    def alive(self, grace_s: float = 0.0) -> None:
        """The render sent something: it is not stalled. ``grace_s``: it may legitimately stay
        silent that much longer than ``stall_s`` from now (the ranks are starting, which
        ``start_timeout_s`` bounds on its own: loading the models is not a stall)."""
        self.last_alive = time.monotonic()
        self._silent_until = self.last_alive + grace_s + self.stall_s

    def report(self, progress: Progress) -> None:
        """Called per chunk: record it now rather than at the next heartbeat (the render's signs of
        life come through :meth:`alive`, which ``NodeExecutor.run`` calls on every event)."""
        self.progress = progress
        self._wake.set()

    def stop_reason(self) -> str | None:
        if self.lease_lost:
            return "lease_lost"
        if self.cancel:
            return "cancel"
        return "drain" if self.drain is not None and self.drain.is_set() else None

    def stop(self) -> None:
        self._halt.set()
        self._wake.set()
        self.join(timeout=30)

    def run(self) -> None:
        with job_context(self.lease.job_id):
            next_beat = time.monotonic() + self.heartbeat_s
            next_poll = time.monotonic()
            while not self._halt.is_set():
                woken = self._wake.wait(max(0.0, min(next_beat, next_poll) - time.monotonic()))
                self._wake.clear()
                if self._halt.is_set():
                    return
                now = time.monotonic()
                if now > self._silent_until:
                    log.error(
                        "no fragment or progress from the render for %.0f s (stall bound %.0f s): "
                        "heartbeats stop so the lease expires and the reaper hands the job to another "
                        "worker; this worker is stuck (see its stack with py-spy) and needs a restart",
                        now - self.last_alive,
                        self.stall_s,
                    )
                    metrics.STALLS.labels("lease_released").inc()
                    self.stalled = self.lease_lost = True
                    return
                try:
                    if woken or now >= next_beat:
                        if not self.store.heartbeat(self.lease, progress=self.progress):
                            log.warning("lease lost (another worker owns the job now)")
                            self.lease_lost = True
                            return
                        next_beat = now + self.heartbeat_s
                    if now >= next_poll:
                        if self.store.cancel_requested(self.lease.job_id):
                            self.cancel = True
                        next_poll = now + self.cancel_poll_s
                except Exception:
                    log.exception("heartbeat/cancel poll failed; retrying on the next tick")
