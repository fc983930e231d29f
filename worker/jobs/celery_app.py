"""The worker's Celery application: the render task, the worker-process signals, built on demand.

``celery -A worker.jobs.celery_app worker --pool=solo -c 1 -Q longtake`` (or ``longtake worker``)
loads the module attribute :data:`app`, which is built from ``Settings()`` on first access (a
module ``__getattr__``), never at import: importing this module reads no environment and connects to
nothing. Everything else builds its own app with :func:`create_worker_app` (a worker) or
:func:`worker.jobs.queue.create_celery_app` (a publisher: the API, the reaper, tests).

:func:`create_worker_app` registers ``longtake.render_job(job_id)``, whose body is
:meth:`worker.jobs.tasks.JobWorker.run` on the process' one ``JobWorker`` (built with the
``delivery`` factory and ``renderer`` given here: tests pass their fakes), and connects the worker-process signals:
logging is configured on ``setup_logging``; on ``worker_process_init`` the metrics endpoint
(``Settings.metrics_port``) starts in the process that renders — before the first job, so an idle
worker is scraped too; the solo pool sends that signal in the worker process itself — and
the reaper (``Settings.reaper_enabled``) runs as a daemon thread in the worker's main process until
``worker_shutdown``; ``worker_shutting_down`` (SIGTERM, SIGINT, SIGQUIT) asks the running job to
drain (:meth:`JobWorker.request_drain`). With ``--pool=solo`` (the recommended pool) both work in
the worker process, which renders; with ``--pool=prefork`` the metrics endpoint starts in the pool
child instead (it renders, so it holds the render metrics), and the drain
reaches the child by a signal: the Celery parent, in its ``worker_shutting_down``, sends
:data:`DRAIN_SIGNAL` to each process of its pool (the pids ``celery inspect stats`` lists; never the
ranks a child started), whose handler, installed at ``worker_process_init``, sets
:attr:`JobWorker.drain_requested`. The parent's warm shutdown then waits for a task that ends after
its chunk (``drained``).
The queue configuration and why each setting is there: :mod:`worker.jobs.queue`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

from celery import Celery, signals
from celery.concurrency.prefork import TaskPool as PreforkPool

from pipeline.request import Renderer
from worker.delivery.job_delivery import DeliveryFactory, s3_delivery
from worker.jobs.db import DbRetry, make_engine
from worker.jobs.metrics import start_metrics_server
from worker.jobs.queue import RENDER_TASK_NAME, create_celery_app
from worker.jobs.reaper import reaper_loop
from worker.jobs.store import JobStore
from worker.jobs.tasks import JobWorker
from worker.logging import configure_logging
from worker.settings import Settings

log = logging.getLogger(__name__)

#: what the Celery parent of a prefork pool sends its pool processes on ``worker_shutting_down``: a
#: real-time signal, which neither Celery nor billiard handles, resets or ignores in a pool child
#: (SIGUSR1 is the soft time limit there; SIGUSR2 is Celery's rdb signal, and billiard's signal
#: protection turns it into an exit when the pool runs without an event loop, e.g. the sqla broker).
#: Internal: a process that got it hands back every job it claims afterwards.
DRAIN_SIGNAL = signal.SIGRTMIN


def create_worker_app(
    settings: Settings, *, delivery: DeliveryFactory = s3_delivery, renderer: Renderer | None = None
) -> Celery:
    """The Celery app a worker process serves: the queue configuration of ``settings``, the render
    task (``renderer`` — default ``pipeline.render.render`` — rendering into ``delivery``'s sinks) and
    the worker-process signals. Build one per process."""
    celery = create_celery_app(settings)

    def render_job(job_id: str) -> str:
        return JobWorker.for_process(settings, celery, delivery=delivery, renderer=renderer).run(job_id)

    # Celery ships no types: registered by a call rather than its (untyped) decorator
    celery.task(
        name=RENDER_TASK_NAME, shared=False, acks_late=True, reject_on_worker_lost=True, ignore_result=True
    )(render_job)

    _connect_worker_signals(celery, settings)
    return celery


def _connect_worker_signals(celery: Celery, settings: Settings) -> None:
    stop = threading.Event()
    uid = f"longtake-{id(celery)}"

    def setup_logging(**_: Any) -> None:
        configure_logging(settings.log_level, json_lines=settings.log_json)

    def start_reaper(sender: Any = None, **_: Any) -> None:
        if settings.reaper_enabled and settings.reaper_interval_s > 0:
            threading.Thread(
                target=reaper_loop, args=(celery, settings, stop), name="longtake-reaper", daemon=True
            ).start()
            log.info("reaper thread started (every %.1f s)", settings.reaper_interval_s)

    def stop_reaper(**_: Any) -> None:
        stop.set()

    def serve_metrics() -> None:
        if settings.metrics_port > 0:
            # an engine of its own (one connection) for the fleet-wide longtake_jobs gauge
            store = JobStore(make_engine(settings.database_url, pool_size=1), retry=DbRetry(1))
            start_metrics_server(settings.metrics_port, store.count_by_status)

    def start_metrics(**_: Any) -> None:
        # worker_process_init: the process that renders (and so records the render metrics) — the
        # worker itself with --pool=solo (its pool sends the signal there), the pool child with prefork
        serve_metrics()

    def listen_for_drain(**_: Any) -> None:
        signal.signal(DRAIN_SIGNAL, _drain_signalled)

    workers: list[Any] = []  # this app's WorkController in this process (worker_init)

    def keep_worker(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is celery:
            workers.append(sender)

    def drain(**_: Any) -> None:
        # in Celery's handler of the signal, in the worker's main process: the job rendering here
        # (--pool=solo), then each prefork pool child (its render is elsewhere)
        JobWorker.request_drain()
        for pid in _pool_children(workers):
            try:
                os.kill(pid, DRAIN_SIGNAL)
            except ProcessLookupError:  # the child is gone already
                pass

    # weak=False: the closures live as long as the process' app (the signals are process-wide)
    signals.setup_logging.connect(setup_logging, weak=False, dispatch_uid=f"{uid}-logging")
    signals.worker_process_init.connect(start_metrics, weak=False, dispatch_uid=f"{uid}-metrics")
    signals.worker_process_init.connect(listen_for_drain, weak=False, dispatch_uid=f"{uid}-child-drain")
    signals.worker_ready.connect(start_reaper, weak=False, dispatch_uid=f"{uid}-reaper")
    signals.worker_init.connect(keep_worker, weak=False, dispatch_uid=f"{uid}-worker")
    signals.worker_shutting_down.connect(drain, weak=False, dispatch_uid=f"{uid}-drain")
    signals.worker_shutdown.connect(stop_reaper, weak=False, dispatch_uid=f"{uid}-stop")


def _pool_children(workers: list[Any]) -> list[int]:
    """The pids of the prefork pool processes of ``workers`` (the pool's own list, which ``celery
    inspect stats`` shows as ``pool.processes``); none for the other pools, whose tasks run in this
    process."""
    pids: list[int] = []
    for worker in workers:
        pool = getattr(worker, "pool", None)
        if isinstance(pool, PreforkPool):
            try:
                pids += pool.info["processes"]
            except AttributeError:  # the pool is stopped already (a second signal, late in the shutdown)
                pass
    return [pid for pid in pids if pid != os.getpid()]


def _drain_signalled(signum: int, frame: FrameType | None) -> None:
    """:data:`DRAIN_SIGNAL`'s handler (a pool child): set the flag and nothing else — no logging in
    a signal handler; the render sees the flag between chunks and the release logs the hand-back.
    One-shot: the flag never clears, and ignoring the signal first means that a second one cannot
    run this handler again inside ``Event.set`` (its lock is not reentrant)."""
    signal.signal(signum, signal.SIG_IGN)
    JobWorker.drain_requested.set()


_app: Celery | None = None
_app_lock = threading.Lock()


def __getattr__(name: str) -> Celery:
    """``app``: the production worker app, built from ``Settings()`` on first access."""
    global _app
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _app_lock:
        if _app is None:
            _app = create_worker_app(Settings())
        return _app
