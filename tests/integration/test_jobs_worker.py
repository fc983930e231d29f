"""Celery worker processes render jobs from the row: duplicates render once, cancel stops the render
process within about one chunk, bad inputs fail without retries, metrics are served."""

from __future__ import annotations

import json
import time
import urllib.request

import fake_pipeline
import pytest
from jobs_harness import JobsEnv, free_port, pid_alive

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_one_job_end_to_end_with_metrics(jobs_env: JobsEnv, pool: str) -> None:
    port = free_port()
    jobs_env.start_worker("w1", pool=pool, METRICS_PORT=str(port))
    job = jobs_env.submit(seed=11, num_fragments=4, sleep_s=0.05)
    (rec,) = jobs_env.wait([job], timeout=60)
    assert rec.status == "succeeded", rec
    assert rec.attempts == 1 and rec.chunks_done == 4 and rec.num_chunks == 4 and rec.frames_done == 40
    assert jobs_env.final_bytes(rec) == fake_pipeline.expected_output(11, 4)
    assert [s.index for s in jobs_env.store.segments(job)] == [0, 1, 2, 3]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'longtake_job_attempts_total{outcome="succeeded"} 1.0' in body
    assert 'longtake_jobs{status="succeeded"} 1.0' in body
    assert "longtake_queue_wait_seconds_count 1.0" in body
    assert "longtake_time_to_first_frame_seconds_count 1.0" in body
    assert "longtake_segments_committed_total 4.0" in body
    assert "job_id" not in body  # no per-job labels


def test_message_delivered_twice_renders_once(jobs_env: JobsEnv) -> None:
    jobs_env.start_worker("w1")
    jobs_env.start_worker("w2")
    job = jobs_env.submit(seed=21, num_fragments=6, sleep_s=0.1, publish=False)
    jobs_env.publish(job)
    jobs_env.publish(job)  # the same message twice: both workers get one
    (rec,) = jobs_env.wait([job], timeout=60)
    time.sleep(1.0)  # let the duplicate be consumed and skipped
    assert rec.status == "succeeded" and rec.attempts == 1
    renders = jobs_env.renders()
    assert sorted(renders) == [(21, i) for i in range(6)] and set(renders.values()) == {1}
    assert jobs_env.final_bytes(rec) == fake_pipeline.expected_output(21, 6)
    logs = "".join(w.log_path.read_text() for w in jobs_env.workers)
    assert "not claimable" in logs  # the duplicate was seen and skipped


def test_cancel_mid_render(jobs_env: JobsEnv) -> None:
    chunk_s = 0.3
    w = jobs_env.start_worker("w1")
    job = jobs_env.submit(seed=31, num_fragments=40, sleep_s=chunk_s)
    jobs_env.wait_for(job, lambda r: r.chunks_done >= 2, timeout=60)
    render_pids = w.render_pids()
    assert len(render_pids) == 1, render_pids
    t0 = time.monotonic()
    assert jobs_env.store.request_cancel(job, tenant="t1")
    rec = jobs_env.wait_for(job, lambda r: r.status == "cancelled", timeout=30)
    took = time.monotonic() - t0
    # one chunk + the cancel poll interval + the rank reporting the stop, with slack for a
    # loaded 2-core machine
    assert took < chunk_s + 0.1 + 1.5, took
    # the render stopped (no fragment after the cancel); its rank process stays up and warm
    rendered = sum(1 for seed, _ in jobs_env.renders().elements() if seed == 31)
    time.sleep(1.0)
    assert sum(1 for seed, _ in jobs_env.renders().elements() if seed == 31) == rendered
    assert w.render_pids() == render_pids and pid_alive(render_pids[0])
    assert rec.outputs_partial and rec.error_code == "cancelled"
    assert "segments" in rec.outputs
    assert 2 <= rec.chunks_done < 40
    assert len(jobs_env.store.segments(job)) == rec.chunks_done


def test_invalid_input_fails_once_and_oom_is_retried(jobs_env: JobsEnv) -> None:
    jobs_env.start_worker("w1")
    bad = jobs_env.submit(seed=41, num_fragments=4, sleep_s=0.02, fail_at=2, fail_code="invalid_input")
    oom = jobs_env.submit(seed=42, num_fragments=4, sleep_s=0.02, fail_at=3, fail_code="out_of_memory")
    rbad, room = jobs_env.wait([bad, oom], timeout=90)
    assert rbad.status == "failed" and rbad.error_code == "invalid_input" and rbad.attempts == 1
    assert "fragment 2" in (rbad.error_message or "")
    # retryable: requeued until max_attempts, each retry resuming after fragment 2
    assert room.status == "failed" and room.error_code == "out_of_memory" and room.attempts == 3
    renders = jobs_env.renders()
    assert [renders[(42, i)] for i in range(3)] == [1, 1, 1]


def test_options_reach_the_render_and_options_refused_at_run_time_fail_the_job(
    jobs_env: JobsEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spec's options are in the RenderRequest the rank's renderer gets; a row whose options the
    family refuses when it renders (bounds narrowed since submit, a row written behind the API) is
    read, claimed and failed once, ``invalid_input``, the row saying which option and why. In-process
    JobWorker on the real NodeEngine (one rank), the fake render checking options as render() does."""
    from sqlalchemy import update

    from worker.jobs.tables import JobRow
    from worker.jobs.tasks import JobWorker

    log = jobs_env.tmp / "requests.jsonl"
    monkeypatch.setenv("LONGTAKE_FAKE_REQUEST_LOG", str(log))  # read by the rank the worker spawns
    good = jobs_env.submit(seed=51, num_fragments=2, sleep_s=0.0, publish=False,
                           options={"steps": 3, "audio_guidance": 2.0})
    stale = jobs_env.submit(seed=52, num_fragments=2, sleep_s=0.0, publish=False, options={"steps": 3})
    with jobs_env.store.engine.begin() as conn:
        row = conn.execute(JobRow.__table__.select().where(JobRow.id == stale)).one()
        conn.execute(update(JobRow).where(JobRow.id == stale).values(spec={**row.spec, "options": {"steps": 99}}))
    worker = JobWorker(jobs_env.settings, renderer=fake_pipeline.render)
    try:
        assert worker.run(good) == "succeeded"
        assert worker.run(stale) == "failed"
    finally:
        worker.node.close(1.0)
        worker.engine.dispose()
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert seen == [{"seed": 51, "family": "tiny", "preset": "tiny", "options": {"steps": 3, "audio_guidance": 2.0}}]
    rec = jobs_env.store.get(stale)
    assert rec is not None and rec.status == "failed" and rec.attempts == 1, rec
    assert rec.error_code == "invalid_input"
    assert rec.error_message == "options.steps=99: must be int in [1, 50] (preset 'tiny' default 5)"


def test_preview_sink_failure_costs_the_preview_not_the_job() -> None:
    from pipeline.errors import SinkError
    from pipeline.media_types import Fragment
    from worker.delivery.job_delivery import BestEffortSink as _BestEffortSink

    class Flaky:
        def __init__(self) -> None:
            self.writes: list[int] = []
            self.closed: list[bool] = []

        def open(self, init: object) -> None:
            pass

        def write(self, fragment: Fragment) -> None:
            if fragment.index == 1:
                raise SinkError("stream gone")
            self.writes.append(fragment.index)

        def close(self, *, ok: bool) -> None:
            self.closed.append(ok)

    inner = Flaky()
    sink = _BestEffortSink(inner, "kvs preview")  # type: ignore[arg-type]
    sink.open(fake_pipeline.init_segment(1))
    for i in range(3):
        sink.write(Fragment(index=i, data=b"x", first_frame=i, num_frames=1, start_s=0.0, duration_s=0.04))
    sink.close(ok=True)
    assert inner.writes == [0] and inner.closed == [False]  # dropped after the error, closed once
