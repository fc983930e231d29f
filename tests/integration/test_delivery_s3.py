"""S3ProgressiveSink against a real moto_server over HTTP: progressive segments, playlist at every
step, one final MP4 byte-equal to init + fragments, bytes-sent budgets, resume reusing parts."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx
import pytest

from pipeline.errors import SinkError
from pipeline.media_types import Fragment
from tests.integration.delivery_media import Sample, decode_frames, ffprobe_duration, make_sample
from tests.integration.s3_fixtures import MotoServer, moto_s3, s3_store  # noqa: F401
from worker.api.preview import playlist_with_urls
from worker.delivery.keys import job_prefix, safe_key
from worker.delivery.local_store import LocalObjectStore
from worker.delivery.object_store import ObjectStore
from worker.delivery.s3_sink import MultipartState, S3ProgressiveSink
from worker.delivery.s3_store import S3ObjectStore
from worker.delivery.segment import SegmentRecord
from worker.errors import LeaseLostError, StorageError

pytestmark = pytest.mark.integration

PREFIX = job_prefix("acme", "6f1c1d3e-0000-4000-8000-000000000001")


def check_playlist(store: ObjectStore, sink: S3ProgressiveSink, *, min_segments: int = 0) -> list[str]:
    """The playlist parses, references only uploaded segments, in index order."""
    if not store.exists(sink.playlist_key):
        assert min_segments == 0
        return []
    text = store.get_bytes(sink.playlist_key).decode()
    lines = text.strip().split("\n")
    assert lines[0] == "#EXTM3U"
    assert "#EXT-X-PLAYLIST-TYPE:EVENT" in lines and '#EXT-X-MAP:URI="init.mp4"' in lines
    assert store.exists(sink.init_key)
    uris = [ln for ln in lines if ln and not ln.startswith("#")]
    extinf = [ln for ln in lines if ln.startswith("#EXTINF:")]
    assert len(extinf) == len(uris)
    target = int(next(ln for ln in lines if ln.startswith("#EXT-X-TARGETDURATION:")).split(":")[1])
    for ln in extinf:
        assert 0 < float(ln[8:].rstrip(",")) <= target
    assert uris == [f"seg_{i:05d}.m4s" for i in range(len(uris))]
    for u in uris:
        assert store.exists(sink.prefix + u), f"playlist references {u} before it is uploaded"
    assert len(uris) >= min_segments
    return uris


def run_render(sink: S3ProgressiveSink, sample: Sample, *, start: int = 0, stop: int | None = None,
               pace_s: float = 0.0, on_step=None) -> list[float]:  # type: ignore[no-untyped-def]
    """Feed fragments like the render does (optionally paced); returns each write()'s duration."""
    sink.open(sample.init)
    waits = []
    for frag in sample.fragments[start:stop]:
        t0 = time.monotonic()
        sink.write(frag)
        waits.append(time.monotonic() - t0)
        if pace_s:
            time.sleep(pace_s)
        if on_step is not None:
            on_step(frag.index)
    return waits


def verify_final(store: ObjectStore, sink: S3ProgressiveSink, sample: Sample, tmp_path: Path) -> None:
    out = tmp_path / "final.mp4"
    store.download_to(sink.final_key, out)
    assert out.read_bytes() == sample.mp4
    assert abs(ffprobe_duration(out) - sample.duration_s) < 0.1
    assert decode_frames(out) == sum(f.num_frames for f in sample.fragments)


def test_small_render_preview_on(s3_store: S3ObjectStore, tmp_path: Path) -> None:  # noqa: F811
    sample = make_sample(6.0)
    commits: list[SegmentRecord] = []

    def on_commit(seg: SegmentRecord) -> None:
        # durable before commit: the segment and its resume state are already readable
        assert s3_store.get_bytes(seg.key) == sample.fragments[seg.index].data
        assert seg.state_key and s3_store.get_bytes(seg.state_key) == sample.fragments[seg.index].resume_state
        assert seg.checksum == hashlib.sha256(sample.fragments[seg.index].data).hexdigest()
        commits.append(seg)

    sink = S3ProgressiveSink(s3_store, PREFIX, on_commit=on_commit, preview=True)

    def step(index: int) -> None:
        # one emission of render time has passed since fragment `index` was written: it must be in
        # S3 before the render hands over the next one
        assert s3_store.exists(f"{PREFIX}seg_{index:05d}.m4s")
        uris = check_playlist(s3_store, sink, min_segments=1)
        assert index + 1 - len(uris) <= sink.counters.num_playlist_skips

    waits = run_render(sink, sample, pace_s=0.6, on_step=step)
    assert max(waits) < 0.5  # write() hands over and returns; uploads run on the sink thread
    sink.close(ok=True)
    assert [c.index for c in commits] == list(range(len(sample.fragments)))
    uris = check_playlist(s3_store, sink, min_segments=len(sample.fragments))
    assert len(uris) == len(sample.fragments)
    assert s3_store.get_bytes(sink.playlist_key).decode().rstrip().endswith("#EXT-X-ENDLIST")
    verify_final(s3_store, sink, sample, tmp_path)
    assert sink.counters.num_parts == 0 and sink.counters.final_put_bytes == len(sample.mp4)
    assert sink.counters.media_bytes <= 2.02 * len(sample.mp4)
    assert not s3_store.exists(sink.state_object_key)

    # a player without credentials follows the presigned playlist over plain HTTP (the rewrite
    # the API's preview route serves when segments go straight to the store)
    signed = playlist_with_urls(
        s3_store.get_bytes(sink.playlist_key).decode(),
        lambda name: s3_store.presign_get(safe_key(PREFIX, name), 600),
    )
    urls = [ln for ln in signed.splitlines() if ln.startswith("http")]
    init_url = signed.split('#EXT-X-MAP:URI="', 1)[1].split('"', 1)[0]
    assert len(urls) == len(sample.fragments)
    assert httpx.get(init_url).content == sample.init.data
    assert httpx.get(urls[4]).content == sample.fragments[4].data


@pytest.mark.parametrize("preview", [False, True])
def test_big_render_multipart(moto_s3: MotoServer, tmp_path: Path, preview: bool) -> None:  # noqa: F811
    store = moto_s3.store()
    sample = make_sample(6.0, gop=12, big=True)
    commits: list[SegmentRecord] = []
    states: list[MultipartState] = []
    sink = S3ProgressiveSink(store, PREFIX, on_commit=commits.append, preview=preview, on_multipart=states.append)
    run_render(sink, sample, pace_s=0.05)
    # wait until the upload thread has drained what the render handed over
    deadline = time.monotonic() + 60
    while sink.backlog_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    parts_before_close = sink.counters.num_parts
    t0 = time.monotonic()
    sink.close(ok=True)
    close_s = time.monotonic() - t0
    assert sink.counters.num_parts >= 3
    assert sink.counters.num_parts - parts_before_close <= 1, "only the last part may be left for close()"
    assert close_s < 10
    verify_final(store, sink, sample, tmp_path)
    assert [c.index for c in commits] == list(range(len(sample.fragments)))
    assert [len(s.parts) for s in states] == list(range(1, len(states) + 1))
    mp4 = len(sample.mp4)
    if preview:
        assert sink.counters.media_bytes <= 2.02 * mp4
        check_playlist(store, sink, min_segments=len(sample.fragments))
    else:
        assert sink.counters.media_bytes <= 1.01 * mp4
        assert store.bytes_sent - sink.counters.state_bytes <= 1.01 * mp4
        assert all(c.key == sink.final_key for c in commits)
        assert commits[-1].state_key is not None
        assert not store.exists(sink.playlist_key)
    assert sink.counters.part_bytes == mp4
    assert not store.exists(sink.state_object_key)
    assert sink.outputs()["mp4"] == f"s3://{store.bucket}/{sink.final_key}"


@pytest.mark.parametrize("preview", [True, False])
def test_resume_reuses_segments_and_parts(moto_s3: MotoServer, tmp_path: Path, preview: bool) -> None:  # noqa: F811
    store = moto_s3.store()
    sample = make_sample(6.0, gop=12, big=True)
    commits: list[SegmentRecord] = []
    first = S3ProgressiveSink(store, PREFIX, on_commit=commits.append, preview=preview)
    run_render(first, sample, stop=9)
    first.close(ok=False)  # the attempt dies: nothing final, the multipart upload stays open
    assert not store.exists(first.final_key)
    mp = first.multipart_state
    assert mp is not None and len(mp.parts) >= 1
    sent_parts = sum(p.nbytes for p in mp.parts)
    resume_from = commits[-1].index + 1
    assert resume_from == (9 if preview else mp.parts[-1].last_index + 1)

    second_commits: list[SegmentRecord] = []
    # the job row provides the committed segments; the multipart state is read back from the store
    second = S3ProgressiveSink(store, PREFIX, committed=list(commits), on_commit=second_commits.append,
                               preview=preview)
    run_render(second, sample, start=resume_from)
    second.close(ok=True)
    verify_final(store, second, sample, tmp_path)
    assert [c.index for c in second_commits] == list(range(resume_from, len(sample.fragments)))
    mp4 = len(sample.mp4)
    assert second.counters.part_bytes == mp4 - sent_parts, "parts of the first attempt were re-sent"
    assert second.counters.init_bytes == 0
    if preview:
        assert second.counters.segment_bytes == sum(len(f.data) for f in sample.fragments[resume_from:])
        assert second.counters.downloaded_bytes == sum(
            len(f.data) for f in sample.fragments[mp.parts[-1].last_index + 1: resume_from])
        check_playlist(store, second, min_segments=len(sample.fragments))
    total = first.counters.media_bytes + second.counters.media_bytes
    assert total <= (2.02 if preview else 1.01) * mp4


def test_write_out_of_order_and_lease_loss(s3_store: S3ObjectStore) -> None:  # noqa: F811
    sample = make_sample(6.0)

    class LeaseLostError(Exception):
        pass

    def on_commit(seg: SegmentRecord) -> None:
        if seg.index == 1:
            raise LeaseLostError("lease of job gone")

    sink = S3ProgressiveSink(s3_store, PREFIX, on_commit=on_commit)
    sink.open(sample.init)
    with pytest.raises(SinkError, match="expects 0"):
        sink.write(sample.fragments[1])
    sink.write(sample.fragments[0])
    sink.write(sample.fragments[1])
    with pytest.raises(SinkError, match="on_commit for segment 1 failed") as info:
        for f in sample.fragments[2:]:
            sink.write(f)
            time.sleep(0.1)
        sink.close(ok=True)
    assert info.value.retryable is False
    assert not s3_store.exists(sink.final_key)


def test_local_store_embedded_default(tmp_path: Path) -> None:
    """Same sink on the local-directory store, with a tiny part size so the multipart path runs."""
    store = LocalObjectStore(tmp_path / "objects")
    sample = make_sample(6.0)
    commits: list[SegmentRecord] = []
    sink = S3ProgressiveSink(store, PREFIX, on_commit=commits.append, part_min_bytes=64 * 1024)
    run_render(sink, sample)
    sink.close(ok=True)
    assert sink.counters.num_parts >= 3
    assert (tmp_path / "objects" / sink.final_key).read_bytes() == sample.mp4
    check_playlist(store, sink, min_segments=len(sample.fragments))
    assert sink.outputs()["hls"].startswith("file://")


def test_playlist_budget_long_render(tmp_path: Path) -> None:
    """1,000 small segments: full playlist rewrites would cost ~18 MB (O(n^2)); the budget keeps the
    upload within 2.02x while the playlist still advances and ends complete."""
    store = LocalObjectStore(tmp_path / "objects")
    base = make_sample(6.0)
    frags = [
        Fragment(index=i, data=base.fragments[i % 9].data, first_frame=16 * i, num_frames=16,
                 start_s=0.64 * i, duration_s=0.64, is_last=i == 999)
        for i in range(1000)
    ]
    sample = Sample(base.init, tuple(frags), base.fps, 0.64 * 1000)
    seen: list[int] = []
    sink = S3ProgressiveSink(store, PREFIX, on_commit=lambda seg: None)
    sink.open(sample.init)
    for f in sample.fragments:
        sink.write(f)
        if f.index % 125 == 124:
            while sink.backlog_bytes:
                time.sleep(0.01)
            seen.append(len(check_playlist(store, sink, min_segments=1)))
    sink.close(ok=True)
    assert sink.counters.media_bytes <= 2.02 * len(sample.mp4)
    assert seen == sorted(seen) and seen[-1] >= 900, seen  # the preview lags by a few dozen segments at most
    assert len(check_playlist(store, sink)) == 1000
    assert sink.counters.num_playlist_skips > 0
    assert store.get_bytes(sink.final_key) == sample.mp4


def test_s3_store_over_http_and_no_retry_on_4xx(moto_s3: MotoServer, tmp_path: Path) -> None:  # noqa: F811
    store = moto_s3.store()
    key = PREFIX + "x/obj.bin"
    store.put_bytes(key, b"payload", content_type="application/octet-stream")
    assert store.exists(key) and store.get_bytes(key) == b"payload"
    assert store.list(PREFIX) == [key]
    assert httpx.get(store.presign_get(key, 60)).content == b"payload"
    assert store.uri(key) == f"s3://{store.bucket}/{key}"
    upload = store.create_multipart(PREFIX + "mp.bin")
    etag = store.upload_part(PREFIX + "mp.bin", upload, 1, b"a" * 100)
    assert [(p.part_number, p.etag) for p in store.list_parts(PREFIX + "mp.bin", upload)] == [(1, etag)]
    store.abort_multipart(PREFIX + "mp.bin", upload)
    store.delete(key)
    assert not store.exists(key)

    # a base prefix from the URL scopes every key
    scoped = moto_s3.store(store.bucket, base_prefix="env/prod")
    scoped.put_bytes(key, b"scoped")
    assert store.get_bytes("env/prod/" + key) == b"scoped"

    # 4xx (here NoSuchBucket) is not retried: one request, non-retryable error, sink fails at once
    missing = moto_s3.store("no-such-bucket-" + store.bucket[-8:], max_attempts=5)
    with pytest.raises(StorageError) as info:
        missing.put_bytes(key, b"x")
    assert not info.value.retryable and missing.num_requests == 1
    sink = S3ProgressiveSink(missing, PREFIX, on_commit=lambda seg: None)
    sample = make_sample(6.0)
    sink.open(sample.init)
    t0 = time.monotonic()
    with pytest.raises(SinkError, match="NoSuchBucket") as sink_info:
        for frag in sample.fragments:
            sink.write(frag)
            time.sleep(0.05)
        sink.close(ok=True)
    assert time.monotonic() - t0 < 5 and sink_info.value.retryable is False


@pytest.mark.parametrize("preview", [True, False])
def test_resume_from_an_older_state_resends_nothing(moto_s3: MotoServer, tmp_path: Path, preview: bool) -> None:  # noqa: F811
    """States are stored every ``state_every`` segments: a retry restarts after the newest stored
    state and re-makes committed fragments, which the sink verifies by checksum and never re-sends."""
    store = moto_s3.store()
    sample = make_sample(6.0, gop=12, big=True)
    commits: list[SegmentRecord] = []
    first = S3ProgressiveSink(store, PREFIX, on_commit=commits.append, preview=preview, state_every=4)
    run_render(first, sample, stop=11)
    first.close(ok=False)
    with_state = [c for c in commits if c.state_key is not None]
    assert with_state and all(c.index % 4 == 0 for c in with_state)
    restart = with_state[-1].index + 1
    assert restart <= commits[-1].index + 1
    states = [k for k in store.list(PREFIX) if k.rsplit("/", 1)[-1].startswith("state_")]
    assert len(states) == len(with_state)

    second_commits: list[SegmentRecord] = []
    second = S3ProgressiveSink(store, PREFIX, committed=list(commits), on_commit=second_commits.append,
                               preview=preview, state_every=4)
    run_render(second, sample, start=restart)  # re-makes restart..last committed, then goes on
    second.close(ok=True)
    verify_final(store, second, sample, tmp_path)
    assert [c.index for c in second_commits] == list(range(commits[-1].index + 1, len(sample.fragments)))
    if preview:
        assert second.counters.segment_bytes == sum(len(f.data) for f in sample.fragments[commits[-1].index + 1:])

    # a re-made fragment that differs from what was committed is refused, not published
    third = S3ProgressiveSink(store, PREFIX + "x/", committed=list(commits), on_commit=lambda c: None,
                              preview=preview, state_every=4)
    third.open(sample.init)
    bad = sample.fragments[restart]
    with pytest.raises(SinkError, match="does not reproduce committed segment"):
        third.write(type(bad)(bad.index, bad.data + b"!", bad.first_frame, bad.num_frames, bad.start_s,
                              bad.duration_s))
    third.close(ok=False)


def test_discard_removes_an_interrupted_render_before_a_fresh_one(moto_s3: MotoServer, tmp_path: Path) -> None:  # noqa: F811
    """A retry whose resume state the render refused starts over (docs/jobs.md, "Resume"): a fresh
    sink deletes what attempt 1 left — its multipart upload (aborted) and state, its segments and
    resume states, the playlist naming them — then delivers the new render whole; no object of
    attempt 1 is left. Every write is fenced: a sink whose lease is lost stops deleting."""
    store = moto_s3.store()
    sample = make_sample(6.0, gop=12, big=True)
    commits: list[SegmentRecord] = []
    first = S3ProgressiveSink(store, PREFIX, on_commit=commits.append, key_tag="a1-")
    run_render(first, sample, stop=9)
    first.close(ok=False)
    mp = first.multipart_state
    assert mp is not None and mp.parts and store.exists(first.state_object_key)
    names = lambda: sorted(k.rsplit("/", 1)[-1] for k in store.list(PREFIX))  # noqa: E731
    assert [n for n in names() if n.startswith("a1-")] == sorted(
        [f"a1-seg_{i:05d}.m4s" for i in range(9)] + [f"a1-state_{i:05d}.bin" for i in range(9)])

    calls: list[int] = []

    def lost_after_one() -> None:  # the lease is lost after the abort: no delete may follow
        calls.append(1)
        if len(calls) > 1:
            raise LeaseLostError("lease of job gone")

    stale = S3ProgressiveSink(store, PREFIX, on_commit=lambda c: None, key_tag="a2-", fence=lost_after_one)
    with pytest.raises(LeaseLostError):
        stale.discard(commits)
    assert [n for n in names() if n.startswith("a1-")] and store.exists(first.state_object_key)

    fences: list[int] = []
    fresh_commits: list[SegmentRecord] = []
    fresh = S3ProgressiveSink(store, PREFIX, on_commit=fresh_commits.append, key_tag="a2-",
                              fence=lambda: fences.append(1))
    fresh.discard(commits)
    assert fences, "the deletes are fenced"
    assert names() == ["init.mp4"]  # rewritten by the fresh render (its own output size)
    with pytest.raises(StorageError):
        store.list_parts(mp.key, mp.upload_id)  # aborted: its parts cost nothing any more
    with pytest.raises(SinkError, match="fresh sink"):
        S3ProgressiveSink(store, PREFIX, committed=commits, on_commit=lambda c: None).discard(commits)
    run_render(fresh, sample)
    fresh.close(ok=True)
    verify_final(store, fresh, sample, tmp_path)
    assert [c.index for c in fresh_commits] == list(range(len(sample.fragments)))
    assert fresh.counters.part_bytes == len(sample.mp4)
    assert not [n for n in names() if n.startswith("a1-")]
    listed = [ln for ln in store.get_bytes(fresh.playlist_key).decode().splitlines() if ln and ln[0] != "#"]
    assert listed == [f"a2-seg_{i:05d}.m4s" for i in range(len(sample.fragments))]
