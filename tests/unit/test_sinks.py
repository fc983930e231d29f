"""FileSink and HLSDirectorySink with real encoded fragments: what is on disk at every step is valid and
never looks finished before ``close(ok=True)``."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pipeline.encode import FragmentEncoder
from pipeline.errors import SinkError
from pipeline.inputs import AudioSource
from pipeline.media_types import Fragment, FrameSink, InitSegment
from pipeline.sinks import (
    HLS_FAILED_MARKER,
    FileSink,
    HLSDirectorySink,
    hls_target_duration,
    render_hls_playlist,
)

FPS = 25


@pytest.fixture(scope="module")
def encoded(tmp_path_factory: pytest.TempPathFactory) -> tuple[InitSegment, list[Fragment]]:
    """1.1 s of 64x64 video + tone in fragments of 8 frames (0.32 s)."""
    wav = tmp_path_factory.mktemp("sinks") / "tone.wav"
    subprocess.run(
        ["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", "sine=frequency=500:duration=1.1", str(wav)],
        check=True,
    )
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (1, 64, 64, 3), dtype=np.uint8)
    with AudioSource.open(wav) as audio:
        enc = FragmentEncoder(64, 64, FPS, audio)
        num_frames, fragments = 28, []
        for index, first in enumerate(range(0, num_frames, 8)):
            count = min(8, num_frames - first)
            frames = np.roll(np.repeat(base, count, axis=0), first, axis=2)
            fragments.append(
                enc.encode(frames, first_frame=first, index=index, is_last=first + count >= num_frames)
            )
    return enc.init_segment, fragments


def probe_frames(path: Path) -> int:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-count_frames", "-select_streams", "v", "-show_streams", "-of", "json", str(path)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return int(json.loads(out.stdout)["streams"][0]["nb_read_frames"])


def test_sinks_implement_the_protocol(tmp_path: Path) -> None:
    assert isinstance(FileSink(tmp_path / "a.mp4"), FrameSink)
    assert isinstance(HLSDirectorySink(tmp_path / "h"), FrameSink)


def test_file_sink_grows_a_playable_partial_and_renames_on_success(
    encoded: tuple[InitSegment, list[Fragment]], tmp_path: Path
) -> None:
    init, fragments = encoded
    out = tmp_path / "out.mp4"
    partial = tmp_path / "out.mp4.partial"
    sink = FileSink(out)
    sink.open(init)
    frames_so_far = 0
    for fragment in fragments:
        sink.write(fragment)
        frames_so_far += fragment.num_frames
        assert not out.exists()
        assert probe_frames(partial) == frames_so_far  # a player can follow the partial file
    sink.close(ok=True)
    assert not partial.exists()
    assert out.read_bytes() == init.data + b"".join(f.data for f in fragments)
    assert probe_frames(out) == 28


def test_file_sink_failure_leaves_nothing(
    encoded: tuple[InitSegment, list[Fragment]], tmp_path: Path
) -> None:
    init, fragments = encoded
    out = tmp_path / "out.mp4"
    out.write_bytes(b"an older finished render")  # untouched by a failed attempt
    sink = FileSink(out)
    sink.open(init)
    sink.write(fragments[0])
    sink.close(ok=False)
    assert list(tmp_path.iterdir()) == [out] and out.read_bytes() == b"an older finished render"
    sink = FileSink(out)
    sink.open(init)
    with pytest.raises(SinkError, match="expected 1"):
        sink.write(fragments[0]), sink.write(fragments[2])
    sink.close(ok=False)


def test_file_sink_unwritable_location_raises_sink_error(
    encoded: tuple[InitSegment, list[Fragment]], tmp_path: Path
) -> None:
    sink = FileSink(tmp_path / "missing_dir" / "out.mp4")
    with pytest.raises(SinkError, match="missing_dir"):
        sink.open(encoded[0])


PLAYLIST_TAG = re.compile(
    r"^#(EXTM3U|EXT-X-VERSION:\d+|EXT-X-PLAYLIST-TYPE:EVENT|EXT-X-INDEPENDENT-SEGMENTS|EXT-X-TARGETDURATION:\d+"
    r'|EXT-X-MEDIA-SEQUENCE:\d+|EXT-X-MAP:URI="[^"]+"|EXTINF:\d+(\.\d+)?,|EXT-X-ENDLIST)$'
)


def parse_playlist(text: str) -> tuple[dict[str, str], list[tuple[str, float]], bool]:
    """A strict little parser: every line a known tag or a segment URI right after its EXTINF."""
    assert text.startswith("#EXTM3U\n") and text.endswith("\n")
    tags: dict[str, str] = {}
    segments: list[tuple[str, float]] = []
    pending: float | None = None
    ended = False
    for line in text.splitlines():
        assert not ended, "nothing may follow EXT-X-ENDLIST"
        if line.startswith("#"):
            assert PLAYLIST_TAG.match(line), line
            assert pending is None, "EXTINF must be followed by its URI"
            name, _, value = line[1:].partition(":")
            if name == "EXTINF":
                pending = float(value.rstrip(","))
            elif name == "EXT-X-ENDLIST":
                ended = True
            else:
                tags[name] = value
        else:
            assert pending is not None, f"URI {line!r} without EXTINF"
            segments.append((line, pending))
            pending = None
    assert pending is None
    assert tags["EXT-X-VERSION"] == "7" and tags["EXT-X-MAP"] == 'URI="init.mp4"'
    target = int(tags["EXT-X-TARGETDURATION"])
    assert all(int(d + 0.5) <= target for _, d in segments)
    return tags, segments, ended


def test_hls_directory_playlist_is_valid_at_every_step(
    encoded: tuple[InitSegment, list[Fragment]], tmp_path: Path
) -> None:
    init, fragments = encoded
    directory = tmp_path / "hls"
    sink = HLSDirectorySink(directory, target_duration=hls_target_duration(8 / FPS))
    sink.open(init)
    assert (directory / "init.mp4").read_bytes() == init.data
    _, segments, ended = parse_playlist((directory / "index.m3u8").read_text())
    assert segments == [] and not ended
    for k, fragment in enumerate(fragments):
        sink.write(fragment)
        tags, segments, ended = parse_playlist((directory / "index.m3u8").read_text())
        assert not ended and tags["EXT-X-TARGETDURATION"] == "1"
        assert [uri for uri, _ in segments] == [f"seg_{i:05d}.m4s" for i in range(k + 1)]
        for uri, duration in segments:  # everything listed is fully written
            index = int(uri[4:9])
            assert (directory / uri).read_bytes() == fragments[index].data
            assert duration == pytest.approx(fragments[index].duration_s)
        assert not list(directory.glob(".*.tmp"))
    sink.close(ok=True)
    _, segments, ended = parse_playlist((directory / "index.m3u8").read_text())
    assert ended and len(segments) == len(fragments)
    assert not (directory / HLS_FAILED_MARKER).exists()
    assert probe_frames(directory / "index.m3u8") == 28
    result = subprocess.run(
        ["ffmpeg", "-v", "error", "-i", str(directory / "index.m3u8"), "-f", "null", "-"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_hls_directory_failure_is_marked(encoded: tuple[InitSegment, list[Fragment]], tmp_path: Path) -> None:
    init, fragments = encoded
    directory = tmp_path / "hls"
    sink = HLSDirectorySink(directory)  # target duration derived from the first segment
    sink.open(init)
    assert not (directory / "index.m3u8").exists()
    sink.write(fragments[0])
    tags, _, _ = parse_playlist((directory / "index.m3u8").read_text())
    assert tags["EXT-X-TARGETDURATION"] == "2"
    sink.close(ok=False)
    _, segments, ended = parse_playlist((directory / "index.m3u8").read_text())
    assert not ended and len(segments) == 1
    assert "failed" in (directory / HLS_FAILED_MARKER).read_text()


def test_render_hls_playlist_is_pure_and_checks_target_duration() -> None:
    text = render_hls_playlist([("a.m4s", 2.0), ("b.m4s", 1.5)], 2, ended=True, init_uri="https://x/init.mp4")
    tags, segments, ended = parse_playlist(text.replace("https://x/init.mp4", "init.mp4"))
    assert segments == [("a.m4s", 2.0), ("b.m4s", 1.5)] and ended
    assert render_hls_playlist([("a.m4s", 2.0)], 2, ended=False) == render_hls_playlist(
        [("a.m4s", 2.0)], 2, ended=False
    )
    with pytest.raises(ValueError, match="TARGETDURATION"):
        render_hls_playlist([("a.m4s", 2.6)], 2, ended=False)
    assert hls_target_duration(2.0) == 2 and hls_target_duration(2.01) == 3
