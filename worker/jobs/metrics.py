"""Prometheus metrics of a render worker. No job-id labels (unbounded cardinality); per-job detail
is in the logs and the job row.

Who calls: :mod:`worker.jobs.tasks` records into these as a job runs; :func:`start_metrics_server` is
called in the process that renders as it starts (Celery's ``worker_process_init``,
:mod:`worker.jobs.celery_app`), before its first job, when ``Settings.metrics_port`` is not 0 (idempotent per process). The ``longtake_jobs`` gauge is
read from the database at scrape time by :class:`JobsByStatusCollector`, so every worker reports the
same fleet-wide numbers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from prometheus_client import Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

log = logging.getLogger(__name__)

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")

ATTEMPTS = Counter(
    "longtake_job_attempts",
    "Render attempts by how they ended (succeeded, failed, cancelled, requeued, lease_lost, skipped)",
    ["outcome"],
)
SEGMENTS = Counter("longtake_segments_committed", "Output segments committed under a lease")
CHUNK_SECONDS = Histogram(
    "longtake_chunk_seconds",
    "Wall time per chunk (emission) of a render",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
FRAMES_PER_SECOND = Histogram(
    "longtake_render_frames_per_second",
    "Frames rendered per wall second over one attempt",
    buckets=(0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500),
)
TIME_TO_FIRST_FRAME = Histogram(
    "longtake_time_to_first_frame_seconds",
    "From claim to the first encoded fragment of an attempt",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
QUEUE_WAIT = Histogram(
    "longtake_queue_wait_seconds",
    "From (re)queue to claim",
    buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600),
)
LIVE_CHUNK_DELAY = Histogram(
    "longtake_live_chunk_delay_seconds",
    "Live sessions: per emission, from the arrival (at the API) of the last audio it needs to its "
    "publication by the render",
    buckets=(0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 30, 60),
)
BUSY = Gauge("longtake_worker_busy", "1 while this worker process runs a job")
REAPED = Counter("longtake_leases_reaped", "Expired leases the reaper requeued")
REPUBLISHED = Counter(
    "longtake_messages_republished",
    "Queued jobs whose message the sweeper (re)sent: never published, or lost by the broker",
)
STALLS = Counter(
    "longtake_render_stalls",
    "Renders that sent nothing for progress_timeout_s, by what was done: ranks_killed (the render "
    "was stopped and retried) or lease_released (the worker itself was stuck; heartbeats stopped)",
    ["action"],
)
RESUMES_DISCARDED = Counter(
    "longtake_resumes_discarded",
    "Retries whose resume state the render refused (the options, the model or the plan changed since "
    "it was made, or an older snapshot version): the committed segments were discarded and the job "
    "rendered from the beginning",
)

_server_lock = threading.Lock()
_server_port: int | None = None
_collector: JobsByStatusCollector | None = None


class JobsByStatusCollector(Collector):
    """``longtake_jobs{status=...}``: job rows per status, counted at scrape time."""

    def __init__(self, count_by_status: Callable[[], dict[str, int]]) -> None:
        self._count = count_by_status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily("longtake_jobs", "Jobs per status (from the database)", labels=["status"])
        try:
            counts = self._count()
        except Exception:
            log.exception("metrics: could not count jobs by status")
            return
        for status in JOB_STATUSES:
            fam.add_metric([status], float(counts.get(status, 0)))
        yield fam


def start_metrics_server(
    port: int, count_by_status: Callable[[], dict[str, int]] | None = None
) -> int | None:
    """Serve ``/metrics`` on ``port`` once per process (0 = off). Returns the port served, if any."""
    global _server_port, _collector
    if port <= 0:
        return None
    with _server_lock:
        if _server_port is None:
            if count_by_status is not None and _collector is None:
                _collector = JobsByStatusCollector(count_by_status)
                REGISTRY.register(_collector)
            start_http_server(port)
            _server_port = port
            log.info("metrics endpoint on :%d/metrics", port)
        return _server_port
