"""render(live=True) on the tiny family, fed by a thread through LiveClock + LiveAudioWriter: the
video is the fed timeline (silence included) within a frame, the fragments are continuous, each
emission reports its audio delay, the result carries the feed's end."""

from __future__ import annotations

import subprocess
import threading
import time
import wave
from pathlib import Path

import pytest

from bench.inputs import DEMO_IMAGE
from pipeline.errors import InvalidInputError
from pipeline.live import LiveAudioWriter, LiveClock, LiveMeta
from pipeline.render import RenderProgress, RenderRequest, render
from pipeline.sinks import FileSink
from tests.unit.test_pipeline import RecordingSink

FPS = 25


def _feed(directory: Path, wav: Path, *, speed: float, gap_s: float) -> threading.Thread:
    """Send ``wav`` in 0.1 s messages at ``speed`` x real time, with one gap of ``gap_s`` in the
    middle (the live clock fills it with silence), then close."""
    with wave.open(str(wav)) as f:
        rate, channels, pcm = f.getframerate(), f.getnchannels(), f.readframes(f.getnframes())
    writer = LiveAudioWriter(directory, LiveMeta(rate, channels))
    clock = LiveClock(writer, max_lag_s=0.2, max_ahead_s=60.0)
    step = rate // 10 * 2 * channels

    def run() -> None:
        for i in range(0, len(pcm), step):
            clock.feed(pcm[i : i + step])
            if gap_s and i <= len(pcm) // 2 < i + step:
                deadline = time.monotonic() + gap_s
                while time.monotonic() < deadline:
                    clock.tick()
                    time.sleep(0.02)
            time.sleep(0.1 / speed)
        writer.close("closed")

    return threading.Thread(target=run, daemon=True)


@pytest.mark.parametrize(("use_i", "gap_s"), [(True, 0.0), (False, 1.5)], ids=["default", "low-latency+gap"])
def test_live_render_follows_the_feed_to_its_end(speech, tmp_path: Path, use_i: bool, gap_s: float) -> None:  # type: ignore[no-untyped-def]
    wav = speech(2.0)
    live = tmp_path / "live"
    feeder = _feed(live, wav, speed=4.0, gap_s=gap_s)
    feeder.start()
    progress: list[RenderProgress] = []
    sink, out = RecordingSink(), tmp_path / "out.mp4"
    t0 = time.time()
    result = render(RenderRequest(image=DEMO_IMAGE, audio=live, live=True, use_i_chunks=use_i),
                    [sink, FileSink(out)], on_progress=progress.append)
    wall = time.time() - t0
    feeder.join()

    assert result.live_end_reason == "closed"
    # the gap (longer than the lead the 4x feed had built up) became silence on the timeline
    assert (result.live_silence_s > 0.2) == bool(gap_s)
    assert result.live_fed_s == pytest.approx(2.0 + result.live_silence_s, abs=0.11)
    assert abs(result.num_frames - result.live_fed_s * FPS) <= 1  # the fed timeline within a frame
    # continuous timeline: every fragment starts where the one before ended
    frags = sink.fragments
    assert [f.index for f in frags] == list(range(len(frags))) and frags[-1].is_last
    assert all(b.first_frame == a.first_frame + a.num_frames for a, b in zip(frags, frags[1:], strict=False))
    assert frags[-1].first_frame + frags[-1].num_frames == result.num_frames
    probe = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "v", "-count_frames", "-show_entries",
                            "stream=nb_read_frames", "-of", "csv=p=0", str(out)], capture_output=True, text=True)
    assert int(probe.stdout.strip()) == result.num_frames
    # progress per emission, the counts so far, and a delay from the audio's arrival to delivery
    assert [p.emission_index for p in progress] == list(range(len(frags)))
    assert [p.num_emissions for p in progress[:-1]] == list(range(1, len(frags)))
    assert progress[-1].num_frames == progress[-1].frames_done == result.num_frames
    delays = [p.audio_delay_s for p in progress]
    assert all(d is not None and 0 < d < wall for d in delays), delays


def test_live_refuses_batch_mode_and_resume_state(tmp_path: Path) -> None:
    request = RenderRequest(image=DEMO_IMAGE, audio=tmp_path, live=True)
    with pytest.raises(InvalidInputError, match="mode='streaming'") as info:
        render(request, [], mode="batch")
    assert info.value.field == "mode"
    with pytest.raises(InvalidInputError, match="not resumable") as info:
        render(request, [], resume_state=b"x")
    assert info.value.field == "resume_state"
    with pytest.raises(InvalidInputError, match="not a live directory") as info:
        render(request, [])
    assert info.value.field == "audio"
