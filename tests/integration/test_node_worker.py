"""The Celery worker renders through its NodeEngine (one CPU rank): the rank process and what it loaded
stay warm between jobs; a cancel or a lost lease ends the job between chunks and keeps the rank (or kills it after
the grace period); a SIGKILLed rank requeues the attempt with a reason naming the rank and the job
then succeeds on a fresh rank; kill -9 of the worker process alone leaves no orphan rank. The last
test runs the real pipeline (tiny preset) twice through one worker and checks the warm family."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import fake_pipeline
import pytest
from jobs_harness import JobsEnv, pid_alive

from worker.spec import JobSpec, spec_context

pytestmark = pytest.mark.integration


def _rank_pid(w: object, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = w.render_pids()  # type: ignore[attr-defined]
        if len(pids) == 1:
            return int(pids[0])
        time.sleep(0.1)
    raise TimeoutError(f"no single rank process under the worker: {w.render_pids()}")  # type: ignore[attr-defined]


def _warm_reports(log_path: Path) -> list[dict[str, object]]:
    """The ``warm`` field of each "render done" record of a worker's JSON log."""
    out = []
    for line in log_path.read_text().splitlines():
        if '"render done' not in line:
            continue
        rec = json.loads(line[line.index("{") :])
        out.append(ast.literal_eval(rec["warm"]))
    return out


def _log_field(log_path: Path, name: str) -> list[object]:
    out = []
    for line in log_path.read_text().splitlines():
        if f'"{name}"' in line:
            out.append(json.loads(line[line.index("{") :])[name])
    return out


def test_rank_stays_warm_across_jobs_and_a_cancel(jobs_env: JobsEnv) -> None:
    w = jobs_env.start_worker("w1", NODE_THREADS_PER_RANK="1")
    first = jobs_env.submit(seed=61, num_fragments=3, sleep_s=0.02)
    (rec,) = jobs_env.wait([first], timeout=90)
    assert rec.status == "succeeded", rec
    rank = _rank_pid(w)

    # cancel mid-render: cancelled within about one chunk, the render stopped, the rank kept
    chunk_s = 0.3
    job = jobs_env.submit(seed=62, num_fragments=40, sleep_s=chunk_s)
    jobs_env.wait_for(job, lambda r: r.chunks_done >= 2, timeout=60)
    t0 = time.monotonic()
    assert jobs_env.store.request_cancel(job, tenant="t1")
    rec = jobs_env.wait_for(job, lambda r: r.status == "cancelled", timeout=30)
    took = time.monotonic() - t0
    assert took < chunk_s + 0.1 + 1.5, took
    assert rec.outputs_partial and rec.error_code == "cancelled" and 2 <= rec.chunks_done < 40
    rendered = sum(1 for seed, _ in jobs_env.renders().elements() if seed == 62)
    time.sleep(1.0)
    assert sum(1 for seed, _ in jobs_env.renders().elements() if seed == 62) == rendered  # stopped
    assert rendered <= rec.chunks_done + 1
    assert w.render_pids() == [rank]  # the rank is still up, idle and warm

    third = jobs_env.submit(seed=63, num_fragments=3, sleep_s=0.02)
    (rec,) = jobs_env.wait([third], timeout=60)
    assert rec.status == "succeeded" and jobs_env.final_bytes(rec) == fake_pipeline.expected_output(63, 3)
    assert {pid for _, _, pid in _render_lines(jobs_env)} == {rank}  # every fragment from the one rank
    reports = _warm_reports(w.log_path)
    assert [r["jobs_on_rank"] for r in reports] == [1, 2]  # the cancelled job did not count
    assert {r["pid"] for r in reports} == {rank}


def _render_lines(jobs_env: JobsEnv) -> list[tuple[int, int, int]]:
    return [
        (int(a), int(b), int(c))
        for a, b, c in (ln.split() for ln in jobs_env.render_log.read_text().splitlines() if ln.strip())
    ]


def test_cancel_ignored_past_grace_kills_the_rank(jobs_env: JobsEnv) -> None:
    # a chunk longer than the grace period: the render cannot stop in time, the ranks are killed
    w = jobs_env.start_worker("w1", NODE_THREADS_PER_RANK="1", CANCEL_GRACE_S="0.5")
    job = jobs_env.submit(seed=71, num_fragments=10, sleep_s=2.0)
    jobs_env.wait_for(job, lambda r: r.chunks_done >= 1, timeout=60)
    rank = _rank_pid(w)
    assert jobs_env.store.request_cancel(job, tenant="t1")
    rec = jobs_env.wait_for(job, lambda r: r.status == "cancelled", timeout=30)
    assert rec.outputs_partial
    deadline = time.monotonic() + 5
    while pid_alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(rank), "rank still alive after the cancel grace period"
    assert "did not stop within cancel_grace_s=0.5" in w.log_path.read_text()
    nxt = jobs_env.submit(seed=72, num_fragments=2, sleep_s=0.02)
    (rec,) = jobs_env.wait([nxt], timeout=90)
    assert rec.status == "succeeded"  # a fresh rank
    assert _rank_pid(w) != rank


def test_killed_rank_requeues_with_reason_then_succeeds(jobs_env: JobsEnv) -> None:
    n, seed = 30, 81
    w = jobs_env.start_worker("w1", NODE_THREADS_PER_RANK="1")
    job = jobs_env.submit(seed=seed, num_fragments=n, sleep_s=0.2)
    jobs_env.wait_for(job, lambda r: r.chunks_done >= 3, timeout=60)
    rank = _rank_pid(w)
    os.kill(rank, signal.SIGKILL)
    rec = jobs_env.wait_for(job, lambda r: r.error_code == "rank_died" or r.status != "running", timeout=30)
    assert rec.error_code == "rank_died", rec
    assert f"rank 0 (pid {rank}) killed by signal SIGKILL" in (rec.error_message or "")
    (rec,) = jobs_env.wait([job], timeout=120)
    assert rec.status == "succeeded" and rec.attempts == 2, rec
    assert jobs_env.final_bytes(rec) == fake_pipeline.expected_output(seed, n)
    assert [s.index for s in jobs_env.store.segments(job)] == list(range(n))
    new_rank = _rank_pid(w)
    assert new_rank != rank and pid_alive(w.pid)  # the worker survived, its engine restarted
    assert "requeued" in w.log_path.read_text()


def test_lost_lease_stops_the_render_and_keeps_the_rank(jobs_env: JobsEnv) -> None:
    from sqlalchemy import text

    w = jobs_env.start_worker("w1", NODE_THREADS_PER_RANK="1", LEASE_S="30", HEARTBEAT_S="0.3")
    job = jobs_env.submit(seed=95, num_fragments=60, sleep_s=0.2)
    jobs_env.wait_for(job, lambda r: r.chunks_done >= 2, timeout=60)
    rank = _rank_pid(w)
    with jobs_env.store.engine.begin() as conn:  # another worker took the job over
        conn.execute(
            text("UPDATE jobs SET lease_token = 'stolen', lease_owner = 'w-other' WHERE id = :id"), {"id": job}
        )
    deadline = time.monotonic() + 20
    while "attempt 1 ended: lease_lost" not in w.log_path.read_text():
        assert time.monotonic() < deadline, w.log_path.read_text()[-3000:]
        time.sleep(0.1)
    rendered = sum(1 for seed, _ in jobs_env.renders().elements() if seed == 95)
    time.sleep(1.0)
    assert sum(1 for seed, _ in jobs_env.renders().elements() if seed == 95) == rendered < 60  # stopped
    rec = jobs_env.store.get(job)
    assert rec is not None and rec.status == "running" and rec.lease_owner == "w-other"  # row left alone
    assert w.render_pids() == [rank]  # stopped between chunks: the rank stays warm


def test_worker_killed_alone_leaves_no_orphan_rank(jobs_env: JobsEnv) -> None:
    w = jobs_env.start_worker("w1", NODE_THREADS_PER_RANK="1")
    job = jobs_env.submit(seed=91, num_fragments=40, sleep_s=0.2)
    jobs_env.wait_for(job, lambda r: r.chunks_done >= 1, timeout=60)
    rank = _rank_pid(w)
    os.kill(w.pid, signal.SIGKILL)  # only the worker process, not its process group
    w.proc.wait(10)  # type: ignore[union-attr]
    deadline = time.monotonic() + 5
    while pid_alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(rank), "rank outlived its worker"


@pytest.mark.slow
def test_real_pipeline_two_jobs_one_worker_warm_family(jobs_env: JobsEnv) -> None:
    from bench.inputs import DEMO_IMAGE, speech_wav

    if shutil.which("ffprobe") is None:
        pytest.skip("ffprobe not installed")
    w = jobs_env.start_worker(
        "w1", app="real",
        NODE_THREADS_PER_RANK="1", LEASE_S="30", HEARTBEAT_S="2",
    )
    inp = jobs_env.tmp / "in"
    shutil.copy(DEMO_IMAGE, inp / "ref.png")
    recs = []
    for seed in (1, 2):
        audio = speech_wav(inp / f"speech-{seed}.wav", 1.0, seed=seed)
        spec = JobSpec.model_validate(
            {"image": f"file://{inp}/ref.png", "audio": f"file://{audio}", "seed": seed, "preset": "tiny"},
            context=spec_context(jobs_env.settings.file_root),
        )
        rec = jobs_env.store.create(spec, tenant="t1")
        jobs_env.publish(rec.id)
        (done,) = jobs_env.wait([rec.id], timeout=400)
        assert done.status == "succeeded", done
        recs.append(done)
    for rec in recs:
        path = Path(rec.outputs["mp4"][len("file://") :])
        probe = subprocess.run(
            ["ffprobe", "-v", "error", "-count_frames", "-select_streams", "v:0", "-show_entries",
             "stream=nb_read_frames:format=duration", "-of", "json", str(path)],
            check=True, capture_output=True, text=True,
        )
        info = json.loads(probe.stdout)
        assert int(info["streams"][0]["nb_read_frames"]) > 0
        assert abs(float(info["format"]["duration"]) - 1.0) < 0.3, info
    cold, warm = _warm_reports(w.log_path)
    print(f"cold: {cold}\nwarm: {warm}")
    print("claim -> first fragment (s):", _log_field(w.log_path, "claim_to_first_fragment_s"))
    print("render ttff (s):", _log_field(w.log_path, "ttff_s"), "wall (s):", _log_field(w.log_path, "wall_s"))
    assert cold["pid"] == warm["pid"] and (cold["jobs_on_rank"], warm["jobs_on_rank"]) == (1, 2)
    assert int(cold["loads_this_job"]) >= 4 and float(cold["load_s_this_job"]) > 0  # type: ignore[arg-type]
    assert warm["loads_this_job"] == 0 and warm["load_s_this_job"] == 0  # the family stayed warm
    assert warm["modules_loaded"] == cold["modules_loaded"]
