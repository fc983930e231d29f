"""The live directory's writer side (pipeline/live.py): what a session's render reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.live import END_REASONS, LiveAudioWriter, LiveClock, LiveEnd, LiveFormatError, LiveMeta


def test_appends_whole_frames_indexes_each_append_and_ends_once(tmp_path: Path) -> None:
    w = LiveAudioWriter(tmp_path / "live", LiveMeta(sample_rate=16000, channels=2))
    assert LiveMeta.read(tmp_path / "live") == LiveMeta(16000, 2)
    assert w.write(b"\x01\x00\x02\x00" * 10, t=100.0) == 10
    assert w.write_silence(5, t=101.0) == 5
    with pytest.raises(LiveFormatError, match="not a whole number of frames"):
        w.write(b"\x00" * 6)
    assert w.frames == 15 and w.silence_frames == 5
    assert (tmp_path / "live" / "audio.pcm").stat().st_size == 15 * 4
    lines = [json.loads(x) for x in (tmp_path / "live" / "index.jsonl").read_text().splitlines()]
    assert lines == [{"end": 10, "t": 100.0, "silence": False}, {"end": 15, "t": 101.0, "silence": True}]
    assert LiveEnd.read(tmp_path / "live") is None
    end = w.close("idle_timeout")
    assert w.close("closed") == end == LiveEnd("idle_timeout", 15, 5) == LiveEnd.read(tmp_path / "live")
    with pytest.raises(LiveFormatError, match="has ended"):
        w.write(b"\x00" * 4)


@pytest.mark.parametrize(
    ("meta", "field"),
    [
        ({"sample_rate": 100, "channels": 1}, "sample_rate"),
        ({"sample_rate": 16000, "channels": 0}, "channels"),
        ({"sample_rate": 16000, "channels": 1, "format": "f32le"}, "format"),
    ],
)
def test_bad_declarations_name_the_field(meta: dict[str, object], field: str) -> None:
    with pytest.raises(LiveFormatError, match=field):
        LiveMeta(**meta)  # type: ignore[arg-type]


def test_a_directory_holds_one_feed_and_close_takes_known_reasons(tmp_path: Path) -> None:
    w = LiveAudioWriter(tmp_path, LiveMeta(24000, 1))
    with pytest.raises(LiveFormatError, match="already holds"):
        LiveAudioWriter(tmp_path, LiveMeta(24000, 1))
    with pytest.raises(ValueError, match="reason"):
        w.close("because")
    assert w.ended is None, "a refused reason does not end the feed"
    assert all(w.close(r).reason == "closed" for r in ("closed", *END_REASONS))  # the first close wins


def test_the_live_clock_inserts_silence_when_the_sender_is_late_and_bounds_the_lead(tmp_path: Path) -> None:
    w = LiveAudioWriter(tmp_path, LiveMeta(8000, 1))
    clock = LiveClock(w, max_lag_s=0.5, max_ahead_s=2.0)
    assert clock.tick(now=5.0) == 0, "no clock before the first audio"
    clock.feed(b"\x00\x00" * 8000, now=10.0)  # 1 s of audio at t=0
    assert clock.tick(now=11.2) == 0, "behind by 0.2 s only: within max_lag_s"
    assert clock.tick(now=12.0) == 4000 and w.frames == 12000, "behind by 1 s: silence up to lag 0.5 s"
    clock.feed(b"\x00\x00" * 8000, now=12.0)  # late audio lands after the silence
    assert w.frames == 20000 and w.silence_frames == 4000
    clock.feed(b"\x00\x00" * 8000, now=12.1)  # 3.5 s of timeline at 2.1 s: 1.4 s ahead
    with pytest.raises(LiveFormatError, match="max_ahead_s"):
        clock.feed(b"\x00\x00" * 8000, now=12.1)
    assert w.frames == 28000


def test_relayed_audio_keeps_its_arrival_time_and_the_first_audio_is_never_held(tmp_path: Path) -> None:
    w = LiveAudioWriter(tmp_path, LiveMeta(8000, 1))
    clock = LiveClock(w, max_lag_s=0.5, max_ahead_s=1.0)
    assert not clock.would_overrun(8000 * 5, now=1.0), "the first audio starts the clock"
    clock.feed(b"\x00\x00" * 8000 * 5, now=1.0, t=1234.5)
    assert json.loads((tmp_path / "index.jsonl").read_text().splitlines()[-1])["t"] == 1234.5
    assert clock.would_overrun(1, now=1.0) and not clock.would_overrun(8000, now=6.0)
