"""How fast a job moves to another worker when its worker goes away (issue 17 item 7 and the
deployment findings (a), (b)), with real Celery worker processes and real signals:

- kill -9 (no goodbye): the job waits for its lease to expire and a reaper pass, a stated bound
  of ``lease_s + reaper_interval_s`` — measured here with the *default* settings;
- SIGTERM (a pod stopping, a node drained): the render stops between chunks, the job is released
  without charging its attempt and republished, and another worker resumes it within one chunk
  plus the drain — with the solo pool and with prefork, whose parent passes the drain on to the
  pool child that renders;
- the metrics endpoint answers as soon as the worker is ready, before its first job.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import fake_pipeline
import httpx
import pytest
from jobs_harness import JobsEnv, free_port

from worker.settings import Settings

pytestmark = pytest.mark.integration


def _owner_and_spare(jobs_env: JobsEnv, job: str, names: tuple[str, str]):  # type: ignore[no-untyped-def]
    rec = jobs_env.wait_for(job, lambda r: r.chunks_done >= 4, timeout=60)
    workers = {w.name: w for w in jobs_env.workers if w.name in names}
    owner = workers.pop(rec.lease_owner)  # type: ignore[arg-type]
    (spare,) = workers.values()
    return owner, spare


@pytest.mark.slow
def test_kill9_death_to_resume_with_default_lease(jobs_env: JobsEnv) -> None:
    fields = Settings.model_fields
    defaults = {k: str(fields[k].default) for k in ("lease_s", "heartbeat_s", "reaper_interval_s")}
    bound = float(defaults["lease_s"]) + float(defaults["reaper_interval_s"])
    for name in ("w1", "w2"):
        jobs_env.start_worker(name, **defaults)
    n, seed = 60, 91
    job = jobs_env.submit(seed=seed, num_fragments=n, sleep_s=0.25)
    owner, spare = _owner_and_spare(jobs_env, job, ("w1", "w2"))
    owner.kill9()
    killed_at = time.monotonic()
    rec = jobs_env.wait_for(job, lambda r: r.status == "running" and r.lease_owner == spare.name, timeout=120)
    resumed_s = time.monotonic() - killed_at
    print(f"kill -9 -> resumed on {spare.name}: {resumed_s:.1f} s (stated bound lease_s + "
          f"reaper_interval_s = {bound:g} s; defaults {defaults})")
    assert rec.attempts == 2
    # the stated figure (25 s with the defaults) + 3 s for the reaper's publish, the claim and a
    # loaded machine; it was ~63 s with the old 60 s lease and 15 s reaper interval
    assert resumed_s <= min(bound, 25.0) + 3.0, resumed_s
    (rec,) = jobs_env.wait([job], timeout=120)
    assert rec.status == "succeeded" and jobs_env.final_bytes(rec) == fake_pipeline.expected_output(seed, n)


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_sigterm_hands_the_job_over_within_a_chunk(jobs_env: JobsEnv, pool: str) -> None:
    # prefork: the SIGTERM reaches the Celery parent, the job renders in its pool child
    jobs_env.start_worker("w1", pool=pool)
    jobs_env.start_worker("w2", pool=pool)
    n, seed, chunk_s = 40, 92, 0.25
    job = jobs_env.submit(seed=seed, num_fragments=n, sleep_s=chunk_s)
    owner, spare = _owner_and_spare(jobs_env, job, ("w1", "w2"))
    os.kill(owner.pid, signal.SIGTERM)  # what Kubernetes sends the pod's PID 1; the ranks are left alone
    t0 = time.monotonic()
    rec = jobs_env.wait_for(job, lambda r: r.status == "running" and r.lease_owner == spare.name, timeout=30)
    handover_s = time.monotonic() - t0
    assert owner.proc is not None
    owner.proc.wait(20)  # and the stopping worker exits: its warm shutdown had nothing left to wait for
    exited_s = time.monotonic() - t0
    print(f"SIGTERM -> resumed on {spare.name}: {handover_s:.2f} s; {owner.name} exited after {exited_s:.1f} s")
    assert handover_s < chunk_s + 3.0, handover_s
    assert rec.attempts == 1  # the released attempt was not charged
    (rec,) = jobs_env.wait([job], timeout=120)
    assert rec.status == "succeeded" and rec.attempts == 1 and rec.lease_owner == spare.name, rec
    assert [s.index for s in jobs_env.store.segments(job)] == list(range(n))
    assert jobs_env.final_bytes(rec) == fake_pipeline.expected_output(seed, n)
    # released by the process that rendered (the pool child with prefork), not only announced
    assert f"handed back (worker {owner.name} shutting down)" in owner.log_path.read_text()


def test_metrics_endpoint_is_up_before_the_first_job(jobs_env: JobsEnv) -> None:
    port = free_port()
    jobs_env.start_worker("w1", metrics_port=str(port))
    deadline = time.monotonic() + 10
    while True:
        try:
            resp = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert resp.status_code == 200
    assert 'longtake_jobs{status="queued"}' in resp.text and "longtake_worker_busy" in resp.text


def _objects(root: Path) -> dict[str, tuple[int, int]]:
    """Every object file under ``root`` with (inode, mtime): a rewrite or a new object shows."""
    return {
        str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_frozen_worker_writes_no_object_after_the_takeover(jobs_env: JobsEnv) -> None:
    """Issue 17 item 5: the owner is frozen (SIGSTOP) past its lease, another worker takes the job
    over and finishes it; thawed (SIGCONT), the stale worker goes on relaying what its rank had
    rendered meanwhile — and must write no object, new or old, under the job's prefix."""
    jobs_env.start_worker("w1")
    jobs_env.start_worker("w2")
    n, seed = 30, 93
    job = jobs_env.submit(seed=seed, num_fragments=n, sleep_s=0.25)
    owner, spare = _owner_and_spare(jobs_env, job, ("w1", "w2"))
    os.kill(owner.pid, signal.SIGSTOP)  # the worker only: its rank renders on into the pipe
    try:
        (rec,) = jobs_env.wait([job], timeout=120)
        assert rec.status == "succeeded" and rec.lease_owner == spare.name, rec
        root = jobs_env.tmp / "objects" / "tenants" / "t1" / "jobs" / job
        before = _objects(root)
    finally:
        os.kill(owner.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while "lease lost" not in owner.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # what the stale upload thread would write, it has written by now
    after = _objects(root)
    changed = sorted(k for k in after if before.get(k) != after[k])
    assert changed == [], f"the stale worker wrote {changed} after the takeover"
    assert jobs_env.final_bytes(rec) == fake_pipeline.expected_output(seed, n)
    for seg in jobs_env.store.segments(job):  # every committed object is the one its row names
        assert (jobs_env.tmp / "objects" / seg.key).is_file()
