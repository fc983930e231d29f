"""Row and message never diverge for long (issue 17 item 4): a queued job whose Celery message was
lost still runs, because every worker's outbox sweeper (worker.jobs.reaper.sweep_once) republishes
queued jobs whose message is in none of the broker's queue lists; and a submit while Redis is down
answers at once (the row is the truth; the sweeper publishes it when Redis is back)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from private_servers import PrivateRedis
from test_jobs_outages import _env

pytestmark = pytest.mark.integration

FAST_SWEEP = {"republish_after_s": "1"}  # the harness' reaper/sweeper runs every 0.5 s


def _messages(url: str, queue: str) -> int:
    """Render messages waiting in ``queue``: kombu's ten priority lists, read directly."""
    client = redis.Redis.from_url(url)
    try:
        return sum(int(client.llen(k)) for k in [queue, *(f"{queue}\x06\x16{n}" for n in range(1, 10))])
    finally:
        client.close()


def _volatile_redis(tmp: Path) -> PrivateRedis:
    d = tmp / "redis"
    d.mkdir()
    r = PrivateRedis(d, persist=False)
    r.start()
    return r


def test_message_lost_in_a_redis_restart_is_republished(tmp_path: Path, pg_url: str) -> None:
    broker = _volatile_redis(tmp_path)
    je = _env(tmp_path, pg_url, broker.url, **FAST_SWEEP)
    try:
        job = je.submit(seed=81, num_fragments=3, sleep_s=0.02)  # published; no worker yet
        assert _messages(broker.url, je.settings.queue_name) == 1
        broker.stop()
        broker.start()  # Redis without persistence: the message is gone, the row stays queued
        assert _messages(broker.url, je.settings.queue_name) == 0
        w = je.start_worker("w1")
        t0 = time.monotonic()
        (rec,) = je.wait([job], timeout=45)
        assert rec.status == "succeeded" and rec.attempts == 1, rec
        assert "sweeper: published queued job" in w.log_path.read_text()
        print(f"lost message republished and job done {time.monotonic() - t0:.1f} s after the worker was ready")
    finally:
        for w in je.workers:
            w.stop()
        je.store.engine.dispose()
        broker.stop()


def test_message_taken_by_a_dead_consumer_is_republished(tmp_path: Path, pg_url: str) -> None:
    # A worker killed as the job was published took the message (kombu moved it out of the queue
    # list) and died before claiming: emulated exactly by popping the message from the list.
    je = _env(tmp_path, pg_url, "redis://127.0.0.1:6379/1", **FAST_SWEEP)
    client = redis.Redis.from_url("redis://127.0.0.1:6379/1")
    queue = je.settings.queue_name
    try:
        job = je.submit(seed=82, num_fragments=3, sleep_s=0.02)
        assert _messages("redis://127.0.0.1:6379/1", queue) == 1
        client.delete(queue, *client.keys(f"{queue}\x06\x16*"))
        je.start_worker("w1")
        (rec,) = je.wait([job], timeout=45)
        assert rec.status == "succeeded" and rec.attempts == 1, rec
    finally:
        for w in je.workers:
            w.stop()
        je.store.engine.dispose()
        client.delete(queue, f"_kombu.binding.{queue}", *client.keys(f"{queue}\x06\x16*"))


def test_submit_with_redis_down_is_fast_and_the_job_runs_later(tmp_path: Path, pg_url: str) -> None:
    broker = _volatile_redis(tmp_path)
    je = _env(tmp_path, pg_url, broker.url, **FAST_SWEEP)
    api = je.api()
    try:
        broker.stop()
        t0 = time.monotonic()
        resp = api.post("/v1/jobs", json=je.api_spec(seed=83, num_fragments=3, sleep_s=0.02))
        took = time.monotonic() - t0
        print(f"submit with Redis down: {resp.status_code} in {took * 1000:.0f} ms")
        assert resp.status_code == 201, resp.text
        assert took < 3.0, took  # was ~33 s (publish retries), past the client's 30 s timeout
        job = resp.json()["id"]
        assert je.store.get(job).status == "queued"  # type: ignore[union-attr]
        broker.start()
        je.start_worker("w1")
        (rec,) = je.wait([job], timeout=45)
        assert rec.status == "succeeded" and rec.attempts == 1, rec
        assert len(je.store.list(tenant="t1")) == 1  # one job: nothing for a client to resubmit
    finally:
        for w in je.workers:
            w.stop()
        api.close()
        je.store.engine.dispose()
        broker.stop()
