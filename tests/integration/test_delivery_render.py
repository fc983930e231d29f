"""End to end with the real pipeline: render() on the tiny preset feeding the S3 sink (moto_server)
and the KVS preview (stand-in) at once; then a crashed attempt resumed through the same sink."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.inputs import DEMO_IMAGE, speech_wav
from pipeline.media_types import Fragment, InitSegment
from pipeline.render import RenderRequest, render
from tests.integration.delivery_media import decode_frames, ffprobe_duration
from tests.integration.kvs_standin import ACCESS_KEY, REGION, SECRET_KEY, KVSStandIn
from tests.integration.s3_fixtures import MotoServer, moto_s3  # noqa: F401
from worker.delivery.keys import job_prefix
from worker.delivery.kvs.putmedia import PutMediaClient
from worker.delivery.kvs.sink import KVSPreviewSink
from worker.delivery.s3_sink import S3ProgressiveSink
from worker.delivery.segment import SegmentRecord

pytestmark = pytest.mark.integration


class Recorder:
    """Keeps what render() emitted and when (test-only: a real sink must not keep fragments)."""

    def __init__(self) -> None:
        self.init: InitSegment | None = None
        self.fragments: list[Fragment] = []
        self.write_at: list[float] = []

    def open(self, init: InitSegment) -> None:
        self.init = init

    def write(self, fragment: Fragment) -> None:
        self.fragments.append(fragment)
        self.write_at.append(time.monotonic())

    def close(self, *, ok: bool) -> None:
        pass


@pytest.fixture
def standin() -> Iterator[KVSStandIn]:
    server = KVSStandIn(streams={"job-preview"})
    try:
        yield server
    finally:
        server.stop()


def test_render_to_s3_and_kvs(moto_s3: MotoServer, standin: KVSStandIn, tmp_path: Path) -> None:  # noqa: F811
    torch.set_num_threads(1)
    audio = speech_wav(tmp_path / "a.wav", 2.6, seed=0)
    store = moto_s3.store()
    commit_at: dict[int, float] = {}
    commits: list[SegmentRecord] = []

    def on_commit(seg: SegmentRecord) -> None:
        commit_at[seg.index] = time.monotonic()
        commits.append(seg)

    s3 = S3ProgressiveSink(store, job_prefix("acme", "e2e-render"), on_commit=on_commit)
    kvs = KVSPreviewSink(PutMediaClient("job-preview", region=REGION, endpoint_url=standin.url,
                                        access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY))
    rec = Recorder()
    result = render(RenderRequest(image=DEMO_IMAGE, audio=audio, seed=3), [rec, s3, kvs])

    n = len(rec.fragments)
    assert n >= 3 and rec.init is not None
    # the first segment was durable in S3 before the render handed over its second fragment
    assert commit_at[0] < rec.write_at[1]
    assert [c.index for c in commits] == list(range(n))
    mp4 = rec.init.data + b"".join(f.data for f in rec.fragments)
    out = tmp_path / "final.mp4"
    store.download_to(s3.final_key, out)
    assert out.read_bytes() == mp4
    assert abs(ffprobe_duration(out) - result.duration_s) < 0.1
    assert decode_frames(out) == result.num_frames
    assert s3.counters.media_bytes <= 2.02 * len(mp4)
    # every resume state went up with its segment
    assert all(c.state_key and store.get_bytes(c.state_key) == rec.fragments[c.index].resume_state
               for c in commits if rec.fragments[c.index].resume_state is not None)
    # the live preview got every fragment, decodable, in order
    assert kvs.status == "done", kvs.error
    assert kvs.acked == list(range(n))
    assert [p.video_frames for p in standin.state.persisted] == [f.num_frames for f in rec.fragments]


@pytest.mark.slow
def test_render_crash_and_resume(moto_s3: MotoServer, tmp_path: Path) -> None:  # noqa: F811
    """Attempt 1 dies committing fragment 3 (after 0-2 are committed); attempt 2 resumes from the committed
    state with a new sink: the final MP4 equals an uninterrupted render's bytes."""
    torch.set_num_threads(1)
    audio = speech_wav(tmp_path / "a.wav", 2.6, seed=0)
    request = RenderRequest(image=DEMO_IMAGE, audio=audio, seed=3)
    clean = Recorder()
    render(request, [clean])
    assert clean.init is not None
    expected = clean.init.data + b"".join(f.data for f in clean.fragments)

    store = moto_s3.store()
    prefix = job_prefix("acme", "e2e-resume")
    commits: list[SegmentRecord] = []

    class Crash(Exception):
        pass

    def commit_three_then_die(seg: SegmentRecord) -> None:
        # in the sink's own commit, not in a progress callback: the lanes may have published every
        # fragment by the time the caller's thread sees the third one's progress
        if len(commits) >= 3:
            raise Crash("worker died")
        commits.append(seg)

    first = S3ProgressiveSink(store, prefix, on_commit=commit_three_then_die)
    with pytest.raises(Exception) as died:
        render(request, [first])
    assert "worker died" in str(died.value) or isinstance(died.value.__cause__, Crash)
    assert not store.exists(first.final_key)
    done = list(commits)
    last = done[-1]
    assert last.state_key is not None
    second = S3ProgressiveSink(store, prefix, committed=done, on_commit=commits.append)
    render(request, [second], resume_state=store.get_bytes(last.state_key))
    assert store.get_bytes(second.final_key) == expected
    assert [c.index for c in commits] == list(range(len(clean.fragments)))
    assert second.counters.segment_bytes == sum(len(f.data) for f in clean.fragments[last.index + 1:])
