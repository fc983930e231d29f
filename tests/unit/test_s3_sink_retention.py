"""What the S3 progressive sink keeps per committed fragment (issue 16: flat worker memory).

A 2-hour job commits ~7,000 fragments in one attempt; the sink used to keep a ``SegmentRecord``
(plus its key, state key and hex checksum strings) for each, ~0.5 kB a fragment, which alone was
half the worker process's growth (``tests/integration/worker_retention.py`` measures the whole
worker). Counted here with tracemalloc between two part boundaries of one render into a store that
keeps nothing, so what is alive at the end and was allocated after the start is what the sink keeps.
"""

from __future__ import annotations

import builtins
import gc
import threading
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

from pipeline.media_types import Fragment, InitSegment
from worker.delivery.object_store import PartInfo
from worker.delivery.s3_sink import S3ProgressiveSink
from worker.delivery.segment import SegmentRecord

FRAGMENT_BYTES = 1000
PER_PART = 50  # fragments per part of the final MP4


class _NullStore:
    """An ObjectStore that keeps nothing (counts the part bytes it was sent)."""

    def __init__(self) -> None:
        self.part_bytes = 0
        self.lock = threading.Lock()

    def put_bytes(self, key: str, data: bytes, *, content_type: str | None = None) -> None:
        pass

    def get_bytes(self, key: str) -> bytes:
        raise AssertionError(key)

    def download_to(self, key: str, path: Path) -> None:
        raise AssertionError(key)

    def exists(self, key: str) -> bool:
        return False

    def delete(self, key: str) -> None:
        pass

    def list(self, prefix: str) -> builtins.list[str]:
        return []

    def presign_get(self, key: str, expires_s: int = 3600) -> str:
        return key

    def uri(self, key: str) -> str:
        return f"null://{key}"

    def create_multipart(self, key: str, *, content_type: str | None = None) -> str:
        return "upload-1"

    def upload_part(self, key: str, upload_id: str, part_number: int, data: bytes) -> str:
        with self.lock:
            self.part_bytes += len(data)
        return f'"etag-{part_number}"'

    def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        pass

    def abort_multipart(self, key: str, upload_id: str) -> None:
        pass

    def list_parts(self, key: str, upload_id: str) -> builtins.list[PartInfo]:
        return []


def _fragment(i: int) -> Fragment:
    return Fragment(index=i, data=i.to_bytes(4, "big") * (FRAGMENT_BYTES // 4), first_frame=16 * i,
                    num_frames=16, start_s=0.64 * i, duration_s=0.64, is_last=False,
                    resume_state=b"state" * 40)


def test_the_sink_keeps_no_object_per_committed_fragment() -> None:
    store = _NullStore()
    commits: list[int] = []  # the index only: SegmentRecords handed to on_commit are not kept
    done = threading.Condition()

    def on_commit(seg: SegmentRecord) -> None:
        with done:
            commits.append(seg.index)
            done.notify_all()

    init = InitSegment(data=b"I" * FRAGMENT_BYTES, width=64, height=64, fps=25, sample_rate=16000,
                       video_codec="avc1.64001e", audio_codec="mp4a.40.2")
    sink = S3ProgressiveSink(store, "t/j/", on_commit=on_commit, part_min_bytes=PER_PART * FRAGMENT_BYTES,
                             state_every=8, key_tag="a1-")
    sink.open(init)

    def write_until(n: int) -> None:
        for i in range(len(commits), n):
            sink.write(_fragment(i))
        with done:
            assert done.wait_for(lambda: len(commits) == n, timeout=60)
        while sink.backlog_bytes:  # the commit comes before the fragment joins its part
            threading.Event().wait(0.01)
        # at a part boundary: the pending run of the final MP4 is empty
        assert store.part_bytes == FRAGMENT_BYTES * (n + 1), (n, store.part_bytes)

    a, b = 4 * PER_PART - 1, 24 * PER_PART - 1  # counts of fragments that end a part (init in part 1)
    write_until(a)
    gc.collect()
    tracemalloc.start(1)
    try:
        write_until(b)
        gc.collect()
        snap = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    sink.close(ok=True)
    kept = snap.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__),
                               tracemalloc.Filter(False, __file__)])
    per_fragment = sum(s.size for s in kept.statistics("filename")) / (b - a)
    # the playlist's text (~40 bytes a segment) and one UploadedPart per 50 fragments; before the
    # fix ~520 bytes (a SegmentRecord and three strings per fragment)
    assert per_fragment < 100, (per_fragment, [str(s) for s in kept.statistics("lineno")[:8]])
