"""The parent side of the rank pipe (``pipeline.placement.relay.SinkRelay``): order, and what it
gives back after each fragment."""

from __future__ import annotations

import pytest

from pipeline.media_types import Fragment, InitSegment
from pipeline.placement import relay as relay_mod
from pipeline.placement.relay import SinkClosed, SinkRelay
from pipeline.request import RenderProgress


class _Recorder:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def open(self, init: InitSegment) -> None:
        self.calls.append("open")

    def write(self, fragment: Fragment) -> None:
        self.calls.append(f"write {fragment.index}")

    def close(self, *, ok: bool) -> None:
        self.calls.append(f"close {ok}")


def _fragment(i: int) -> Fragment:
    return Fragment(index=i, data=b"x" * 1000, first_frame=10 * i, num_frames=10, start_s=0.4 * i,
                    duration_s=0.4, resume_state=b"s" * 300_000)


def test_the_free_heap_goes_back_once_per_fragment_after_the_sinks_took_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The worker process allocates each fragment and its resume state on its threads' arenas; the
    # trim after each one is what keeps its resident set from stepping up over a long job
    # (docs/benchmarks.md, "The worker's heap"). Without it this test sees no "trim" at all.
    calls: list[str] = []
    monkeypatch.setattr(relay_mod, "release_free_heap", lambda: calls.append("trim"))
    relay = SinkRelay([_Recorder(calls)], on_fragment=lambda f: calls.append(f"seen {f.index}"),
                      on_progress=lambda p: calls.append("progress"))
    relay.on_event(InitSegment(data=b"init", width=64, height=64, fps=25, sample_rate=48000,
                                 video_codec="avc1.64001e", audio_codec="mp4a.40.2"))
    for i in range(3):
        relay.on_event(_fragment(i))
        relay.on_event(RenderProgress(emission_index=i, num_emissions=3, frames_done=10 * (i + 1),
                                      num_frames=30, elapsed_s=1.0))
    relay.on_event(SinkClosed(ok=True))
    assert calls == ["open"] + [c for i in range(3) for c in (f"seen {i}", f"write {i}", "trim", "progress")] + [
        "close True"
    ]
    assert relay.opened and relay.closed
