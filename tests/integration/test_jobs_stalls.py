"""A render that stops moving is never left `running` (issue 17, item 2).

Two ways a render can stall while its worker stays alive and heartbeats: a rank deadlocks (no
more events from it), or the worker's own render thread hangs inside a sink call. The first is
caught on the render thread (``progress_timeout_s``: ranks killed, attempt retried on the same
worker, which resumes after the last committed segment); the second by the lease keeper, which
stops heartbeating so the lease expires and another worker's reaper hands the job on.
"""

from __future__ import annotations

import time

import fake_pipeline
import pytest
from jobs_harness import JobsEnv, pid_alive

from worker.jobs.lease import LeaseKeeper

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_a_silent_rank_is_killed_and_the_job_resumes_on_a_fresh_one(jobs_env: JobsEnv) -> None:
    n, seed, bound = 8, 71, 2.0
    worker = jobs_env.start_worker("w1", progress_timeout_s=str(bound))
    job = jobs_env.submit(seed=seed, num_fragments=n, sleep_s=0.1, hang_at=3)
    rec = jobs_env.wait_for(job, lambda r: r.chunks_done >= 3, timeout=60)
    ranks = worker.render_pids()
    marker = jobs_env.tmp / f"hang-{seed}"
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    hung_at = time.monotonic()
    (rec,) = jobs_env.wait([job], timeout=90)
    assert rec.status == "succeeded", rec
    assert rec.attempts == 2, "the stall must end the attempt and retry it"
    assert jobs_env.final_bytes(rec) == fake_pipeline.expected_output(seed, n)
    assert [s.index for s in jobs_env.store.segments(job)] == list(range(n))
    assert not any(pid_alive(p) for p in ranks), "the stalled rank must have been killed"
    assert time.monotonic() - hung_at < bound + 30
    log = worker.log_path.read_text()
    assert "render_stalled" in log and "progress_timeout_s=2" in log


@pytest.mark.timeout(180)
def test_a_worker_stuck_in_a_sink_lets_its_lease_expire_and_another_worker_finishes(
    jobs_env: JobsEnv,
) -> None:
    n, seed = 8, 72
    marker = jobs_env.tmp / "sink-hang"
    stuck = jobs_env.start_worker(
        "stuck",
        progress_timeout_s="1",
        cancel_grace_s="1",
        app="hanging",
        fake_sink_hang=f"2:{marker}",
    )
    job = jobs_env.submit(seed=seed, num_fragments=n, sleep_s=0.1)
    jobs_env.wait_for(job, lambda r: r.status == "running" and r.lease_owner == "stuck", timeout=60)
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), "the stuck worker never reached fragment 2"
    helper = jobs_env.start_worker("helper")
    (rec,) = jobs_env.wait([job], timeout=120)
    assert rec.status == "succeeded", rec
    assert rec.lease_owner == "helper" and rec.attempts == 2
    assert jobs_env.final_bytes(rec) == fake_pipeline.expected_output(seed, n)
    assert [s.index for s in jobs_env.store.segments(job)] == list(range(n))
    assert "heartbeats stop so the lease expires" in stuck.log_path.read_text()
    assert "resuming after committed segment 1" in helper.log_path.read_text()


def test_the_ranks_start_is_not_a_stall_but_silence_after_it_is(jobs_env: JobsEnv) -> None:
    """Cold ranks (spawning, loading the models) can take longer than the stall bound; the keeper
    must keep the lease through the start (``alive(start_timeout_s)``) and still release it once
    the started render stays silent (the bug: a slow first start lost the lease on attempt 1)."""
    job = jobs_env.submit(seed=73, num_fragments=2, sleep_s=0.1, publish=False)
    lease = jobs_env.store.claim(job, owner="keeper-test", lease_s=3)
    assert lease is not None
    keeper = LeaseKeeper(jobs_env.store, lease, heartbeat_s=0.1, cancel_poll_s=0.1, stall_s=0.3)
    keeper.start()
    try:
        keeper.alive(2.0)  # what NodeExecutor.run says before engine.start()
        time.sleep(1.0)
        assert not keeper.stalled and keeper.stop_reason() is None, "the start was taken for a stall"
        keeper.alive(0.0)  # the ranks are up
        deadline = time.monotonic() + 5
        while not keeper.stalled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert keeper.stalled and keeper.stop_reason() == "lease_lost"
    finally:
        keeper.stop()
