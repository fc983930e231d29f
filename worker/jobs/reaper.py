"""The reaper and the outbox sweeper: requeue jobs whose worker stopped heartbeating, and (re)send
the message of every queued job that has none, so that row and message never diverge for long.

Who calls what: every worker process runs :func:`reaper_loop` as a daemon thread (started on
Celery's ``worker_ready`` by :mod:`worker.jobs.celery_app` when ``Settings.reaper_enabled``), which
calls :func:`reap_once` and :func:`sweep_once` every ``reaper_interval_s``; ``longtake reap`` runs
:func:`reap_once` from the command line. Many reapers at once are safe: each row is changed by a
conditional UPDATE (:meth:`worker.jobs.store.JobStore.requeue_expired`,
:meth:`~worker.jobs.store.JobStore.take_unpublished`), and a duplicate message is harmless anyway
(the claim is a conditional UPDATE: the second delivery renders nothing).

Why a sweeper (issue 17 item 4): a message can be lost while its row stays ``queued`` — Redis
restarted without persistence, a worker died holding a prefetched message, the API could not reach
Redis at submit (it then answers at once and leaves the row unpublished). The row is the truth:
every pass publishes rows never published, and republishes rows published more than
``republish_after_s`` ago whose job id is in none of the broker's queue lists
(:func:`worker.jobs.queue.queued_job_ids`). A lost message is therefore re-sent within
``republish_after_s + reaper_interval_s`` (an unpublished one within ``reaper_interval_s``).
"""

from __future__ import annotations

import logging
import threading
import time

from celery import Celery

from worker.jobs.db import DbRetry, is_connection_error, make_engine
from worker.jobs.metrics import REAPED, REPUBLISHED
from worker.jobs.queue import enqueue_render, queued_job_ids
from worker.jobs.store import JobStore
from worker.settings import Settings

log = logging.getLogger(__name__)


def reap_once(store: JobStore, celery: Celery, *, queue: str, min_db_uptime_s: float = 0.0) -> list[str]:
    """One reaper pass (``longtake reap`` and the worker's reaper thread): requeue expired leases
    and publish a fresh message for each requeued job (its old one died with its worker). With
    ``min_db_uptime_s`` nothing is reaped on a PostgreSQL server up for less than that."""
    ids = store.requeue_expired(min_db_uptime_s=min_db_uptime_s)
    for job_id in ids:
        REAPED.inc()
        rec = store.get(job_id)
        enqueue_render(celery, job_id, queue=queue, priority=rec.spec.priority if rec is not None else 5)
        log.info("reaper: republished job %s", job_id, extra={"job_id": job_id})
    return ids


def sweep_once(store: JobStore, celery: Celery, settings: Settings) -> list[str]:
    """One outbox pass: send the message of every queued job that has none (see the module doc).
    Returns the ids published. A broker that cannot be read skips the pass (nothing is stamped)."""
    live = queued_job_ids(settings.broker_url, settings.queue_name, timeout_s=settings.broker_socket_timeout_s)
    sent: list[str] = []
    for job_id, priority in store.take_unpublished(
        republish_after_s=settings.republish_after_s, live=live or set()
    ):
        try:
            enqueue_render(celery, job_id, queue=settings.queue_name, priority=priority, retry=False)
        except Exception as exc:
            store.mark_unpublished(job_id)
            log.warning("sweeper: could not publish job %s (%s); next pass", job_id, exc)
            continue
        REPUBLISHED.inc()
        sent.append(job_id)
        log.info("sweeper: published queued job %s (it had no message in the broker)", job_id,
                 extra={"job_id": job_id})
    return sent


def reaper_loop(celery: Celery, settings: Settings, stop: threading.Event) -> None:
    """Every ``reaper_interval_s``: requeue expired leases (publishing a message for each) and run
    the outbox sweep. Runs until ``stop`` is set; errors are logged and the loop goes on (a DB or
    broker outage must not kill the thread).

    Outages: while the database is unreachable no lease can be renewed, so every lease looks
    expired the moment it is back, though the workers holding them are alive and rendering (their
    DB calls retry for ``db_outage_max_s``). The reaper therefore makes one try per pass (no
    retries inside a pass) and, after a pass that could not reach the database, reaps nothing for
    ``outage_grace_s(settings)``: long enough for every holder's retrying heartbeat to land. A
    PostgreSQL restart that no pass saw is caught by the same bound on the server's uptime
    (:meth:`JobStore.requeue_expired`'s ``min_db_uptime_s``)."""
    engine = make_engine(settings.database_url, pool_size=1)
    store = JobStore(engine, max_attempts=settings.max_attempts, retry=DbRetry(1, settings.db_retry_max_wait_s))
    grace_s = outage_grace_s(settings)
    hold_until = 0.0
    try:
        while not stop.wait(settings.reaper_interval_s):
            if time.monotonic() >= hold_until:
                try:
                    reap_once(store, celery, queue=settings.queue_name, min_db_uptime_s=grace_s)
                except Exception as exc:
                    if is_connection_error(exc):
                        hold_until = time.monotonic() + grace_s
                        log.warning(
                            "reaper: database unreachable (%s); no lease is reaped until %.0f s after "
                            "it is back (running jobs' heartbeats land first)", exc, grace_s,
                        )
                    else:
                        log.exception("reaper pass failed; retrying in %.1f s", settings.reaper_interval_s)
            try:
                sweep_once(store, celery, settings)
            except Exception as exc:
                if is_connection_error(exc):
                    hold_until = time.monotonic() + grace_s
                log.warning("sweeper pass failed (%s); retrying in %.1f s", exc, settings.reaper_interval_s)
    finally:
        engine.dispose()


def outage_grace_s(settings: Settings) -> float:
    """How long the reapers wait after a database outage before reaping: one lease plus one
    back-off of the holders' retries (their first heartbeat after the outage lands by then)."""
    return settings.lease_s + settings.db_retry_max_wait_s
