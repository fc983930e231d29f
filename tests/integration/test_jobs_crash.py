"""A worker killed with SIGKILL mid-render loses nothing: its lease expires, a reaper requeues the
job, another worker resumes after the last committed chunk, and the final output equals an
uninterrupted render. And 50 concurrent jobs on 2 workers each render exactly once."""

from __future__ import annotations

import time

import fake_pipeline
import pytest
from jobs_harness import JobsEnv, pid_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_kill9_mid_render_resumes_on_other_worker(jobs_env: JobsEnv) -> None:
    n, seed = 30, 51
    workers = {w.name: w for w in (jobs_env.start_worker("w1"), jobs_env.start_worker("w2"))}
    job = jobs_env.submit(seed=seed, num_fragments=n, sleep_s=0.25)
    rec = jobs_env.wait_for(job, lambda r: r.chunks_done >= 4, timeout=60)
    assert rec.lease_owner in workers
    w1 = workers.pop(rec.lease_owner)
    (w2,) = workers.values()  # idle until the job is requeued
    render = w1.render_pids()
    assert len(render) == 1
    w1.kill9()  # the worker and its render rank, no goodbye
    deadline = time.monotonic() + 5  # a rank with torch loaded takes a moment longer to exit
    while pid_alive(render[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(render[0])
    done_at_kill = len(jobs_env.store.segments(job))

    (rec,) = jobs_env.wait([job], timeout=120)
    assert rec.status == "succeeded", rec
    assert rec.attempts == 2 and rec.lease_owner == w2.name
    assert jobs_env.final_bytes(rec) == fake_pipeline.expected_output(seed, n)
    segs = jobs_env.store.segments(job)
    assert [s.index for s in segs] == list(range(n))  # none missing, none duplicated
    renders = jobs_env.renders()
    # committed chunks were not rendered again; at most the one in flight at the kill was
    assert all(renders[(seed, i)] == 1 for i in range(done_at_kill))
    assert sum(renders.values()) <= n + 1
    assert "resuming after committed segment" in w2.log_path.read_text()


def test_fifty_jobs_two_workers_each_rendered_once(jobs_env: JobsEnv) -> None:
    jobs_env.start_worker("w1")
    jobs_env.start_worker("w2")
    n = 3
    t0 = time.monotonic()
    jobs = [jobs_env.submit(seed=1000 + i, num_fragments=n, sleep_s=0.02) for i in range(50)]
    recs = jobs_env.wait(jobs, timeout=400)
    took = time.monotonic() - t0
    assert all(r.status == "succeeded" for r in recs), [
        (r.id, r.status, r.error_message) for r in recs if r.status != "succeeded"
    ]
    assert all(r.attempts == 1 for r in recs)
    renders = jobs_env.renders()
    assert len(renders) == 50 * n and set(renders.values()) == {1}  # every fragment rendered once
    for r in recs:
        assert [s.index for s in jobs_env.store.segments(r.id)] == list(range(n))
        assert jobs_env.final_bytes(r) == fake_pipeline.expected_output(r.spec.seed, n)
    owners = {r.lease_owner for r in recs}
    assert owners == {"w1", "w2"}  # both workers took part
    print(f"50 jobs on 2 workers: {took:.1f} s")
