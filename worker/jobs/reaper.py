"""The reaper: requeue jobs whose worker stopped heartbeating and publish a fresh message for each.

Who calls what: every worker process runs :func:`reaper_loop` as a daemon thread (started on
Celery's ``worker_ready`` by :mod:`worker.jobs.celery_app` when ``Settings.reaper_enabled``);
``longtake reap`` runs :func:`reap_once` from the command line. Many reapers at once are safe: each
row is changed by a conditional UPDATE (:meth:`worker.jobs.store.JobStore.requeue_expired`).
"""

from __future__ import annotations

import logging
import threading

from celery import Celery

from worker.jobs.db import DbRetry, make_engine
from worker.jobs.metrics import REAPED
from worker.jobs.queue import enqueue_render
from worker.jobs.store import JobStore
from worker.settings import Settings

log = logging.getLogger(__name__)


def reap_once(store: JobStore, celery: Celery, *, queue: str) -> list[str]:
    """One reaper pass (``longtake reap`` and the worker's reaper thread): requeue expired leases
    and publish a fresh message for each requeued job (its old one died with its worker)."""
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
