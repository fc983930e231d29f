"""The open-ended chunk plan of a live render (pipeline/schedule.py LiveChunkPlan, pipeline/live_run.py):
the steps released as the audio grows are exactly ChunkPlan's for the final length."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pipeline.errors import InvalidInputError
from pipeline.live import LiveAudioWriter, LiveMeta
from pipeline.live_run import LiveSchedule
from pipeline.live_source import LiveAudioSource
from pipeline.schedule import ChunkPlan, ChunkStep, FrameGrid, LiveChunkPlan, PlanError, frames_for_audio

WAN_GRID = FrameGrid(stride=4, causal_first=True, reference_is_first=True)
SHAPES = [  # (L, C, e, reference_frame, grid, audio look-ahead)
    (16, 4, 4, False, FrameGrid(), 2),  # the tiny preset
    (5, 2, 3, True, FrameGrid(), 0),
    (4, 1, 2, False, WAN_GRID, 7),  # wan's tiny preset
]


def _walk(live: LiveChunkPlan, num_video: int) -> tuple[list[ChunkStep], ChunkPlan]:
    """What LiveSchedule releases for a feed that ends with ``num_video`` video frames of audio:
    growing plans while the audio reaches a chunk's release point, the final plan after."""
    out: list[ChunkStep] = []
    final = live.final(num_video)
    k = 0
    while k < final.num_n_chunks:
        plan = live.growing(k) if live.release_video_frames(k) <= num_video else final
        assert plan is final or k < final.num_n_chunks - 1  # released early only when not the last chunk
        for step in plan.chunk_steps(k):
            if step.emission is not None:  # a growing plan never cuts an emission
                assert plan.video_frames(step.emission.frames) == final.video_frames(step.emission.frames)
            out.append(step)
        k += 1
    return out, final


@pytest.mark.parametrize("use_i", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=["tiny", "reference-slot", "wan-grid"])
def test_released_steps_equal_the_whole_plan_for_every_final_length(
        use_i: bool, shape: tuple[int, int, int, bool, FrameGrid, int]) -> None:
    L, C, e, ref, grid, ahead = shape
    live = LiveChunkPlan(L, C, e, use_i_chunks=use_i, reference_frame=ref, grid=grid, audio_lookahead_frames=ahead)
    for num_video in range(1, 12 * L * grid.stride):
        steps, final = _walk(live, num_video)
        whole = ChunkPlan(grid.timeline_frames(num_video), L, C, e, use_i_chunks=use_i, reference_frame=ref,
                          grid=grid, num_video_frames=0 if grid.is_identity else num_video)
        assert steps == whole.steps, num_video
        assert final == whole and list(final.released()) == [r for r in whole.released()]


def test_release_point_is_the_chunk_end_plus_the_look_ahead_and_at_least_one_frame() -> None:
    assert LiveChunkPlan(16, 4, 4, audio_lookahead_frames=2).release_video_frames(0) == 18
    assert LiveChunkPlan(16, 4, 4, audio_lookahead_frames=0).release_video_frames(1) == 33
    assert LiveChunkPlan(4, 1, 2, grid=WAN_GRID, audio_lookahead_frames=7).release_video_frames(0) == 13 + 7
    assert LiveChunkPlan(16, 4, 4).lookahead_video_frames == LiveChunkPlan(16, 4, 4, use_i_chunks=False).lookahead_video_frames
    with pytest.raises(PlanError, match="audio_lookahead_frames"):
        LiveChunkPlan(16, 4, 4, audio_lookahead_frames=-1)
    with pytest.raises(PlanError, match="interp_frames"):
        LiveChunkPlan(16, 4, 16)


def test_schedule_over_a_growing_feed_releases_the_whole_plan_with_arrival_times(tmp_path: Path) -> None:
    writer = LiveAudioWriter(tmp_path / "live", LiveMeta(16000, 1))
    seconds = 2.3  # 57.5 frames: four full chunks of 16 and a short last one

    def feed() -> None:
        for _ in range(int(seconds * 10)):
            writer.write(b"\x00\x01" * 1600)
            time.sleep(0.005)
        writer.write(b"\x00\x01" * int(16000 * seconds - writer.frames))
        writer.close("closed")

    plan = LiveChunkPlan(16, 4, 4, audio_lookahead_frames=2)
    with LiveAudioSource(tmp_path / "live") as source:
        thread = threading.Thread(target=feed)
        thread.start()
        t0 = time.time()
        released = list(LiveSchedule(plan, source, 16000, 25).released())
        thread.join()
    whole = ChunkPlan(frames_for_audio(int(16000 * seconds), 16000, 25), 16, 4, 4)
    assert [r.step for r in released] == whole.steps
    assert [r.index for r in released] == list(range(len(whole.steps)))
    assert sum(r.is_last_emission for r in released) == 1 and released[-1].is_last_emission
    arrivals = [r.arrival_t for r in released]
    assert all(a is not None and t0 - 1 < a <= time.time() for a in arrivals)
    assert arrivals == sorted(arrivals)  # type: ignore[type-var]
    assert any(not r.is_final for r in released)  # some chunks ran before the feed ended


def test_a_feed_closed_before_any_audio_names_the_field(tmp_path: Path) -> None:
    LiveAudioWriter(tmp_path / "live", LiveMeta(16000, 1)).close("disconnected")
    with LiveAudioSource(tmp_path / "live") as source, pytest.raises(InvalidInputError, match="before any audio"):
        list(LiveSchedule(LiveChunkPlan(16, 4, 4), source, 16000, 25).released())
