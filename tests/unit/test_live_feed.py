"""The live directory's writer side (pipeline/live.py): what a session's render reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.live import END_REASONS, LiveAudioWriter, LiveEnd, LiveFormatError, LiveMeta


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
    assert "disconnected" in END_REASONS
