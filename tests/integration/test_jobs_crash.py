"""A worker killed with SIGKILL mid-render loses nothing: its lease expires, a reaper requeues the
job, another worker resumes after the last committed chunk, and the final output equals an
uninterrupted render. And 50 concurrent jobs on 2 workers each render exactly once. A retry whose
options or model changed since the resume state was made renders from the start instead."""

from __future__ import annotations

import logging
import shutil
import time

import fake_pipeline
import pytest
from jobs_harness import JobsEnv, pid_alive

from tests.integration.test_delivery_render import Recorder
from tests.weights_support import other_weights

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


@pytest.mark.parametrize("change", ["nothing", "options", "model"])
def test_retry_after_options_or_model_changed_renders_from_the_start(
    jobs_env: JobsEnv, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, change: str
) -> None:
    """The real pipeline through the worker's real components (JobWorker in process, its NodeEngine
    rank, PostgreSQL, the object store). Attempt 1 dies after committing fragments 0 and 1 with their
    resume states. Before attempt 2 either the job's options change (its row; as a deploy changing a
    preset default changes the options the family resolves) or the worker is deployed with other
    weights. The rank refuses the snapshot, the worker discards the two segments and renders from the
    beginning; that attempt dies too, after committing the new fragment 0 (the row holds it alone),
    and attempt 3 resumes from its state. The final MP4 is a fresh render's with the new options /
    weights, byte for byte, and nothing of attempt 1 is left in the row or the store. With nothing
    changed, attempt 2 resumes after fragment 1 (the key is the same in another process)."""
    from sqlalchemy import update

    from bench.inputs import DEMO_IMAGE, speech_wav
    from pipeline.families import FAMILIES
    from pipeline.render import RenderRequest, render
    from worker.delivery.keys import job_prefix
    from worker.delivery.storage import open_object_store
    from worker.jobs.tables import JobRow
    from worker.jobs.tasks import JobWorker
    from worker.spec import JobSpec, spec_context

    inp = jobs_env.tmp / "in"
    shutil.copy(DEMO_IMAGE, inp / "ref.png")
    audio = speech_wav(inp / "speech.wav", 2.0, seed=1)  # 50 frames: 4 fragments
    spec = JobSpec.model_validate(
        {"image": f"file://{inp}/ref.png", "audio": f"file://{audio}", "seed": 3},
        context=spec_context(jobs_env.settings.file_root),
    )
    job = jobs_env.store.create(spec, tenant="t1").id
    tiny = FAMILIES.get("tiny")
    shipped = tiny.default_checkpoint(tiny.preset("tiny"))
    assert shipped is not None
    settings = jobs_env.settings.model_copy(update={"checkpoint": shipped, "node_threads_per_rank": 1})
    monkeypatch.setenv("LONGTAKE_FAKE_RENDER_CRASH", f"2:{jobs_env.tmp / 'crashed'}")  # read by the rank
    first = JobWorker(settings, renderer=fake_pipeline.real_render_crashing_once)
    try:
        assert first.run(job) == "requeued"
    finally:
        first.node.close(1.0)
        first.engine.dispose()
    committed = jobs_env.store.segments(job)
    assert [s.index for s in committed] == [0, 1] and all(s.state_key for s in committed)

    options: dict[str, str | int | float] = {}
    checkpoint = shipped
    if change == "options":
        options = {"steps": 3}
        with jobs_env.store.engine.begin() as conn:
            conn.execute(update(JobRow).where(JobRow.id == job).values(
                spec={**spec.model_dump(mode="json"), "options": options}))
    elif change == "model":
        checkpoint = other_weights(shipped, jobs_env.tmp / "other.safetensors")
    # the deployed worker's attempt dies at fragment 1 if it gets there (a restart does: the row must
    # then hold the new fragment 0 only, and its state resume attempt 3); a resume starts at 2
    monkeypatch.setenv("LONGTAKE_FAKE_RENDER_CRASH", f"1:{jobs_env.tmp / 'crashed-again'}")
    second = JobWorker(settings.model_copy(update={"checkpoint": checkpoint}),
                       renderer=fake_pipeline.real_render_crashing_once)
    try:
        with caplog.at_level(logging.WARNING, logger="worker.jobs.tasks"):
            if change == "nothing":
                assert second.run(job) == "succeeded"
            else:
                assert second.run(job) == "requeued"
                restarted = jobs_env.store.segments(job)
                assert [(s.index, s.key.rsplit("/", 1)[-1]) for s in restarted] == [(0, "a2-seg_00000.m4s")]
                assert restarted[0].checksum != committed[0].checksum
                assert jobs_env.store.get(job).chunks_done == 1  # type: ignore[union-attr]
                assert second.run(job) == "succeeded"  # resumes after the new fragment 0
    finally:
        second.node.close(1.0)
        second.engine.dispose()

    rec = jobs_env.store.get(job)
    attempts = 2 if change == "nothing" else 3
    assert rec is not None and rec.status == "succeeded" and rec.attempts == attempts and rec.chunks_done == 4
    fresh = Recorder()
    render(RenderRequest(image=inp / "ref.png", audio=audio, seed=3, options=options, checkpoint=checkpoint),
           [fresh])
    assert fresh.init is not None and len(fresh.fragments) == 4
    assert jobs_env.final_bytes(rec) == fresh.init.data + b"".join(f.data for f in fresh.fragments)
    segs = jobs_env.store.segments(job)
    keys = [s.key.rsplit("/", 1)[-1] for s in segs]
    stored = [k.rsplit("/", 1)[-1] for k in open_object_store(settings.object_store_url).list(job_prefix("t1", job))]
    refused = [r.getMessage() for r in caplog.records if "refused the resume state" in r.getMessage()]
    if change == "nothing":
        assert not refused and segs[:2] == committed
        assert keys == ["a1-seg_00000.m4s", "a1-seg_00001.m4s", "a2-seg_00002.m4s", "a2-seg_00003.m4s"]
        return
    assert len(refused) == 1, refused
    what = "options.steps: 5 in the snapshot, 3 now" if change == "options" else "the model (weights: "
    assert what in refused[0] and "discarding the 2 committed segments" in refused[0]
    assert keys == ["a2-seg_00000.m4s", "a3-seg_00001.m4s", "a3-seg_00002.m4s", "a3-seg_00003.m4s"]
    assert not [k for k in stored if k.startswith("a1-")], stored  # attempt 1's segments and states
