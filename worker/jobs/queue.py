"""The render queue: the Celery configuration and the one message, ``longtake.render_job(job_id)``.

Who calls what: the API, the reaper and the outbox sweeper publish with :func:`enqueue_render` on an app from
:func:`create_celery_app` (configured, no tasks: publishing needs none); the worker process builds
its app with :func:`worker.jobs.celery_app.create_worker_app`, which starts from the same
configuration. The message carries only the job id — the job row is the truth and the result (no
result backend). The sweeper asks :func:`queued_job_ids` which queued jobs still have a message.

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
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from worker.settings import Settings

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
    """A Celery app configured for ``settings``, with no tasks: what publishers (the API, the
    reaper, ``longtake reap``) need. Connects to nothing until the first publish."""
    celery = Celery("longtake")
    celery.conf.update(celery_config(settings))
    celery.conf.longtake_settings = settings
    return celery


def enqueue_render(celery: Celery, job_id: str, *, queue: str, priority: int = 5, retry: bool = True) -> None:
    """Publish the render message for ``job_id`` (the only payload). Redis' priority queue treats a
    lower number as more urgent, so JobSpec.priority (9 = highest) is inverted here.

    ``retry=False`` (the API's submit): one try, so a broker outage fails in milliseconds (or one
    ``broker_socket_timeout_s`` for a black-holed host) instead of ``task_publish_retry_policy``'s
    ~33 s; the job row is the truth and the sweeper publishes it later."""
    pri = 9 - max(0, min(9, priority))
    if retry:
        celery.send_task(RENDER_TASK_NAME, args=[job_id], queue=queue, priority=pri)
        return
    with celery.producer_or_acquire() as producer:
        # one connect, not the transport's max_retries=10 back-off (~12 s) on a pooled connection
        producer.connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
        celery.send_task(RENDER_TASK_NAME, args=[job_id], queue=queue, priority=pri, retry=False, producer=producer)


def queued_job_ids(broker_url: str, queue: str, *, timeout_s: float = 5.0) -> set[str] | None:
    """Job ids of the render messages waiting in ``queue`` (Redis: the ten priority lists kombu
    keeps, read with LRANGE); None when the broker is not Redis (nothing to look into: the sweeper
    then republishes by age alone). Messages delivered to a worker but not acked (kombu's
    ``unacked`` hash) are not counted: a queued job whose message sits there was taken by a worker
    that died before claiming it, and only a new message wakes another one. Raises the broker's
    error when Redis is unreachable (the sweeper then skips its pass)."""
    if not broker_url.startswith(("redis://", "rediss://")):
        return None
    import base64
    import json

    import redis

    client = redis.Redis.from_url(broker_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        # kombu's priority sub-queues: the bare name for priority 0, name + "\x06\x16" + n for the rest
        keys = [queue, *(f"{queue}\x06\x16{n}" for n in range(1, 10))]
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.lrange(key, 0, -1)
        ids: set[str] = set()
        for messages in pipe.execute():
            for raw in messages:
                try:
                    body = json.loads(base64.b64decode(json.loads(raw)["body"]))
                    ids.add(str(body[0][0]))
                except (ValueError, KeyError, IndexError, TypeError):
                    continue  # not one of ours (or another protocol): never blocks a republish
        return ids
    finally:
        client.close()
