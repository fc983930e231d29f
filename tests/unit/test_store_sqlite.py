"""JobStore on the embedded default (SQLite, migrated by Alembic): the lease life cycle.

The same behaviour under real concurrency is tested on PostgreSQL in tests/integration.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from worker.delivery.segment import SegmentRecord
from worker.errors import LeaseLostError
from worker.jobs.db import make_engine, migrate
from worker.jobs.records import Progress
from worker.jobs.store import JobStore
from worker.spec import JobSpec

SPEC = JobSpec.model_validate(
    {"image": "s3://bucket-a/face.png", "audio": "s3://bucket-a/voice.wav", "seed": 7}
)


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    migrate(url)
    return JobStore(make_engine(url), max_attempts=2)


def _seg(i: int, checksum: str = "") -> SegmentRecord:
    return SegmentRecord(
        index=i,
        key=f"seg/{i:06d}.m4s",
        nbytes=100 + i,
        duration_s=0.5,
        checksum=checksum or f"{i:064x}",
        state_key=f"state/{i:06d}.bin",
        first_frame=12 * i,
        num_frames=12,
    )


def test_create_is_idempotent_per_tenant(store: JobStore) -> None:
    keyed = SPEC.model_copy(update={"idempotency_key": "order-1"})
    a = store.create(keyed, tenant="t1")
    b = store.create(keyed, tenant="t1")
    c = store.create(keyed, tenant="t2")
    assert a.id == b.id and c.id != a.id
    assert a.status == "queued" and a.spec == keyed and a.attempts == 0 and a.max_attempts == 2
    assert store.get(a.id, tenant="t2") is None and store.get(a.id, tenant="t1") == a
    assert [j.id for j in store.list(tenant="t1")] == [a.id]
    with pytest.raises(ValueError, match="tenant"):
        store.create(SPEC, tenant="a/b")


def test_claim_fence_finish(store: JobStore) -> None:
    job = store.create(SPEC, tenant="t1")
    lease = store.claim(job.id, owner="w1", lease_s=30)
    assert lease is not None and lease.attempt == 1
    assert store.claim(job.id, owner="w2", lease_s=30) is None  # held by w1
    assert store.heartbeat(
        lease, progress=Progress(chunks_done=0, num_chunks=3, frames_done=5, num_frames=36)
    )
    store.commit_segment(lease, _seg(0))
    store.commit_segment(lease, _seg(0))  # a repeat of a landed commit is a no-op
    with pytest.raises(ValueError, match="gap"):
        store.commit_segment(lease, _seg(2))
    store.commit_segment(lease, _seg(1))
    rec = store.get(job.id)
    assert rec is not None and rec.status == "running" and rec.chunks_done == 2 and rec.num_chunks == 3
    assert rec.frames_done == 24 and rec.seconds_done == pytest.approx(1.0)
    # a late heartbeat carrying older progress does not move progress backwards
    assert store.heartbeat(lease, progress=Progress(chunks_done=1, frames_done=12))
    rec = store.get(job.id)
    assert rec is not None and rec.frames_done == 24
    store.finish(lease, outputs={"mp4": "s3://b/out.mp4"})
    store.finish(lease, outputs={"mp4": "s3://b/out.mp4"})  # repeat after an unknown outcome
    rec = store.get(job.id)
    assert rec is not None and rec.status == "succeeded" and rec.outputs == {"mp4": "s3://b/out.mp4"}
    assert [s.index for s in store.segments(job.id)] == [0, 1]
    assert store.claim(job.id, owner="w2", lease_s=30) is None  # finished jobs are never claimed


def test_expired_lease_taken_over_and_stale_writes_rejected(store: JobStore) -> None:
    job = store.create(SPEC, tenant="t1")
    old = store.claim(job.id, owner="w1", lease_s=0.01)
    assert old is not None
    store.commit_segment(old, _seg(0))
    import time

    time.sleep(0.05)
    new = store.claim(job.id, owner="w2", lease_s=30)
    assert new is not None and new.attempt == 2 and new.token != old.token
    with pytest.raises(LeaseLostError):
        store.commit_segment(old, _seg(1))
    assert not store.heartbeat(old)
    with pytest.raises(LeaseLostError):
        store.finish(old, outputs={})
    assert [s.index for s in store.segments(job.id)] == [0]
    store.commit_segment(new, _seg(1))
    assert store.segments(job.id)[-1].state_key == "state/000001.bin"


def test_reaper_requeues_then_fails_with_reason(store: JobStore) -> None:
    job = store.create(SPEC, tenant="t1")
    lease = store.claim(job.id, owner="w1", lease_s=5)
    assert lease is not None
    assert store.requeue_expired() == []  # not expired yet
    later = datetime.now(UTC) + timedelta(seconds=10)
    assert store.requeue_expired(now=later) == [job.id]
    rec = store.get(job.id)
    assert rec is not None and rec.status == "queued" and rec.error_code == "lease_expired"
    lease2 = store.claim(job.id, owner="w2", lease_s=5)
    assert lease2 is not None and lease2.attempt == 2
    assert store.requeue_expired(now=datetime.now(UTC) + timedelta(seconds=10)) == []
    rec = store.get(job.id)
    assert rec is not None and rec.status == "failed" and "no attempts left" in (rec.error_message or "")
    assert "'w2'" in (rec.error_message or "")


def test_cancel_queued_and_running(store: JobStore) -> None:
    queued = store.create(SPEC, tenant="t1")
    assert not store.request_cancel(queued.id, tenant="t2")  # another tenant's job
    assert store.request_cancel(queued.id, tenant="t1")
    rec = store.get(queued.id)
    assert rec is not None and rec.status == "cancelled"
    assert store.claim(queued.id, owner="w", lease_s=5) is None
    running = store.create(SPEC, tenant="t1")
    lease = store.claim(running.id, owner="w", lease_s=5)
    assert lease is not None and not store.cancel_requested(running.id)
    assert store.request_cancel(running.id, tenant="t1") and store.cancel_requested(running.id)
    store.mark_cancelled(lease, partial_outputs={"segments": "s3://b/p/"})
    rec = store.get(running.id)
    assert rec is not None and rec.status == "cancelled" and rec.outputs_partial
    assert not store.request_cancel(running.id, tenant="t1")  # already ended
    assert store.count_by_status() == {"cancelled": 2}


def test_discard_segments_forgets_them_and_the_progress_under_the_lease(store: JobStore) -> None:
    """A retry whose resume state the render refused starts over (worker.jobs.tasks._start_over):
    the row forgets the committed segments and their progress, fenced; the next commit is index 0."""
    import time

    job = store.create(SPEC, tenant="t1")
    first = store.claim(job.id, owner="w1", lease_s=0.01)
    assert first is not None
    store.commit_segment(first, _seg(0))
    store.commit_segment(first, _seg(1))
    time.sleep(0.05)
    lease = store.claim(job.id, owner="w2", lease_s=30)
    assert lease is not None and lease.attempt == 2
    with pytest.raises(LeaseLostError):
        store.discard_segments(first)  # a stale worker changes nothing
    assert [s.index for s in store.segments(job.id)] == [0, 1]
    assert store.discard_segments(lease) == 2
    assert store.discard_segments(lease) == 0  # a repeat after an unknown outcome
    rec = store.get(job.id)
    assert rec is not None and rec.status == "running" and store.segments(job.id) == []
    assert (rec.chunks_done, rec.frames_done, rec.seconds_done) == (0, 0, 0.0)
    with pytest.raises(ValueError, match="gap"):
        store.commit_segment(lease, _seg(2))
    store.commit_segment(lease, _seg(0, checksum="f" * 64))
    assert [s.checksum for s in store.segments(job.id)] == ["f" * 64]
    assert store.get(job.id).chunks_done == 1  # type: ignore[union-attr]


def test_retryable_error_requeues_until_attempts_run_out(store: JobStore) -> None:
    job = store.create(SPEC, tenant="t1")
    lease = store.claim(job.id, owner="w", lease_s=5)
    assert lease is not None and store.requeue(lease, code="sink_error", message="upload failed")
    lease = store.claim(job.id, owner="w", lease_s=5)
    assert lease is not None and not store.requeue(lease, code="sink_error", message="upload failed")
    rec = store.get(job.id)
    assert rec is not None and rec.status == "failed" and rec.error_code == "sink_error"


def test_retryable_error_with_cancel_pending_cancels(store: JobStore) -> None:
    job = store.create(SPEC, tenant="t1")
    lease = store.claim(job.id, owner="w", lease_s=5)
    assert lease is not None and store.request_cancel(job.id, tenant="t1")
    assert not store.requeue(lease, code="sink_error", message="upload failed")
    rec = store.get(job.id)
    assert rec is not None and rec.status == "cancelled" and rec.outputs_partial


def test_progress_at_moves_with_the_render_not_with_heartbeats(store: JobStore) -> None:
    """Issue 18 item 8: a stuck job heartbeats (updated_at moves) but its progress_at does not."""
    import time

    job = store.create(SPEC, tenant="t1")
    assert store.get(job.id).progress_at is None  # type: ignore[union-attr]
    lease = store.claim(job.id, owner="w1", lease_s=30)
    assert lease is not None

    def moved() -> datetime:
        rec = store.get(job.id)
        assert rec is not None and rec.progress_at is not None
        return rec.progress_at

    claimed = moved()
    time.sleep(0.01)
    assert store.heartbeat(lease) and moved() == claimed, "a bare heartbeat is not progress"
    assert store.heartbeat(lease, progress=Progress(chunks_done=0, frames_done=5))
    rendered = moved()
    assert rendered > claimed
    time.sleep(0.01)
    assert store.heartbeat(lease, progress=Progress(chunks_done=0, frames_done=5))
    assert moved() == rendered, "the same frame count again is not progress"
    time.sleep(0.01)
    store.commit_segment(lease, _seg(0))
    assert moved() > rendered
    rec = store.get(job.id)
    assert rec is not None and rec.updated_at >= rec.progress_at  # type: ignore[operator]


def test_a_row_whose_options_the_family_now_refuses_is_still_read(store: JobStore) -> None:
    """Options are stored as submitted and checked again by the render, not on every read: a row the
    deployed family no longer accepts (bounds narrowed, a row written behind the API) can still be
    listed, shown, claimed and failed by its render (tests/integration/test_jobs_worker.py)."""
    from sqlalchemy import update

    from worker.jobs.tables import JobRow

    job = store.create(SPEC.model_copy(update={"options": {"steps": 3}}), tenant="t1")
    assert job.spec.options == {"steps": 3}
    with store.engine.begin() as conn:
        conn.execute(update(JobRow).where(JobRow.id == job.id).values(spec={**SPEC.model_dump(mode="json"),
                                                                            "options": {"steps": 99}}))
    got = store.get(job.id)
    assert got is not None and got.spec.options == {"steps": 99}
    assert [j.id for j in store.list(tenant="t1")] == [job.id]
    assert store.claim(job.id, owner="w1", lease_s=30) is not None
