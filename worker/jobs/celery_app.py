"""The Celery application: Redis broker, configured for tasks that run for hours.

``celery -A worker.jobs.celery_app worker --pool=solo -c 1 -Q longtake`` (or ``longtake worker``) loads
the module-level :data:`app`. The API and the reaper publish with :func:`enqueue_render`; the message
carries only the job id — the job row is the truth and the result (no result backend).

Why each setting:
- one task at a time, no hidden prefetch: ``worker_prefetch_multiplier=1``, concurrency 1; a second
  message stays in Redis for another worker instead of waiting behind an hours-long render here;
- late ack + ``task_reject_on_worker_lost``: a message is acked when the task returns, so a worker
  that dies mid-render leaves its message in Redis' unacked set (redelivered after the visibility
  timeout). Recovery does not wait for that: the reaper requeues the expired lease and publishes a
  fresh message; the late duplicate finds the job claimed or done and renders nothing;
- ``visibility_timeout`` above the longest job (``Settings`` enforces it), or Redis would hand a
  running job's message to a second worker mid-render (harmless thanks to the lease, but wasteful);
- JSON only; results ignored;
- connection loss: retry forever on startup and while running (``broker_connection_max_retries=None``),
  short socket timeouts so a dead Redis is noticed, and ``worker_cancel_long_running_tasks_on_connection_loss``
  off: a Redis restart must not abort a render whose progress lives in PostgreSQL.

The reaper (``Settings.reaper_enabled``) runs as a daemon thread in every worker's main process,
started on ``worker_ready``; ``longtake reap`` is the same loop as a separate command.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from celery import Celery, signals

from worker.settings import Settings

if TYPE_CHECKING:
    from worker.jobs.store import JobStore

log = logging.getLogger(__name__)

RENDER_TASK_NAME = "longtake.render_job"


def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery configuration for ``settings`` (also used by tests to check it)."""
    return {
        "broker_url": settings.broker_url,
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "worker_concurrency": 1,
        "task_default_queue": settings.queue_name,
        "task_create_missing_queues": True,
        "task_time_limit": None,
        "task_soft_time_limit": None,
        "task_track_started": False,
        "worker_send_task_events": False,
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "broker_connection_retry_on_startup": True,
        "broker_connection_retry": True,
        "broker_connection_max_retries": None,
        "broker_connection_timeout": settings.broker_socket_timeout_s,
        "broker_pool_limit": 4,
        "broker_transport_options": _redis_transport_options(settings)
        if settings.broker_url.startswith(("redis://", "rediss://"))
        else {},  # kombu's other transports (sqla for `longtake up`) take no Redis socket options
        # publishing (API, reaper) retries a lost connection for a bounded time
        "task_publish_retry": True,
        "task_publish_retry_policy": {
            "max_retries": 30,
            "interval_start": 0.2,
            "interval_step": 0.5,
            "interval_max": 3.0,
        },
    }


def _redis_transport_options(settings: Settings) -> dict[str, Any]:
    return {
        "visibility_timeout": settings.visibility_timeout_s,
        "socket_timeout": settings.broker_socket_timeout_s,
        "socket_connect_timeout": settings.broker_socket_timeout_s,
        "socket_keepalive": True,
        "retry_on_timeout": True,
        "health_check_interval": 10,
        "max_retries": 10,
        "interval_start": 0.2,
        "interval_step": 0.5,
        "interval_max": 3.0,
        # message priorities 0..9 map onto Redis sub-queues, 0 consumed first (see enqueue_render)
        "priority_steps": list(range(10)),
    }


def create_celery_app(settings: Settings) -> Celery:
    """A Celery app for ``settings`` with the render task registered."""
    celery = Celery("longtake")
    celery.conf.update(celery_config(settings))
    celery.conf.longtake_settings = settings
    # registers RENDER_TASK_NAME on every app created here
    from worker.jobs.tasks import register_tasks

    register_tasks(celery)
    return celery


def enqueue_render(celery: Celery, job_id: str, *, queue: str, priority: int = 5) -> None:
    """Publish the render message for ``job_id`` (the only payload). Redis' priority queue treats a
    lower number as more urgent, so JobSpec.priority (9 = highest) is inverted here."""
    celery.send_task(RENDER_TASK_NAME, args=[job_id], queue=queue, priority=9 - max(0, min(9, priority)))


def reap_once(store: JobStore, celery: Celery, *, queue: str) -> list[str]:
    """One reaper pass (``longtake reap`` and the worker's reaper thread): requeue expired leases
    and publish a fresh message for each requeued job (its old one died with its worker)."""
    from worker.jobs.metrics import REAPED

    ids = store.requeue_expired()
    for job_id in ids:
        REAPED.inc()
        rec = store.get(job_id)
        enqueue_render(celery, job_id, queue=queue, priority=rec.spec.priority if rec is not None else 5)
        log.info("reaper: republished job %s", job_id, extra={"job_id": job_id})
    return ids


def reaper_loop(celery: Celery, settings: Settings, stop: threading.Event) -> None:
    """Requeue expired leases every ``reaper_interval_s`` and publish a message for each requeued
    job (its old message died with its worker). Runs until ``stop`` is set; errors are logged and
    the loop goes on (a DB or broker outage must not kill the thread)."""
    from worker.jobs.db import DbRetry, make_engine
    from worker.jobs.store import JobStore

    engine = make_engine(settings.database_url, pool_size=1)
    store = JobStore(
        engine,
        max_attempts=settings.max_attempts,
        retry=DbRetry(settings.db_retry_attempts, settings.db_retry_max_wait_s),
    )
    try:
        while not stop.wait(settings.reaper_interval_s):
            try:
                reap_once(store, celery, queue=settings.queue_name)
            except Exception:
                log.exception("reaper pass failed; retrying in %.1f s", settings.reaper_interval_s)
    finally:
        engine.dispose()


_reaper_stop = threading.Event()


@signals.setup_logging.connect
def _setup_logging(**_: Any) -> None:
    from worker.logging import configure_logging

    s: Settings = app.conf.longtake_settings
    configure_logging(s.log_level, json_lines=s.log_json)


@signals.worker_ready.connect
def _start_reaper(sender: Any = None, **_: Any) -> None:
    s: Settings = app.conf.longtake_settings
    if s.reaper_enabled and s.reaper_interval_s > 0:
        threading.Thread(
            target=reaper_loop, args=(app, s, _reaper_stop), name="longtake-reaper", daemon=True
        ).start()
        log.info("reaper thread started (every %.1f s)", s.reaper_interval_s)


@signals.worker_shutdown.connect
def _stop_reaper(**_: Any) -> None:
    _reaper_stop.set()


app = create_celery_app(Settings())
