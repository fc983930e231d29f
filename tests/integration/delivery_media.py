"""Real fMP4 test media for the delivery tests: ffmpeg encodes a fragmented MP4 (H.264 track 1 +
AAC track 2, one fragment per keyframe) and :func:`split_fmp4` cuts it into the init segment and
per-fragment byte ranges by walking the top-level boxes, which is what the encoder hands to sinks."""

from __future__ import annotations

import functools
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.media_types import Fragment, InitSegment


def top_level_boxes(data: bytes) -> list[tuple[str, int, int]]:
    """(type, start, end) of each top-level ISO-BMFF box."""
    out, pos = [], 0
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if size == 1:
            size = struct.unpack(">Q", data[pos + 8:pos + 16])[0]
        elif size == 0:
            size = len(data) - pos
        if size < 8 or pos + size > len(data):
            raise ValueError(f"bad box {kind!r} size {size} at {pos}")
        out.append((kind.decode("latin-1"), pos, pos + size))
        pos += size
    return out


def split_fmp4(data: bytes) -> tuple[bytes, list[bytes]]:
    """init (everything before the first moof) and one bytes per moof(+mdat) pair."""
    boxes = top_level_boxes(data)
    first_moof = next(i for i, b in enumerate(boxes) if b[0] == "moof")
    init = data[: boxes[first_moof][1]]
    frags: list[bytes] = []
    start = None
    for kind, s, e in boxes[first_moof:]:
        if kind == "moof":
            if start is not None:
                frags.append(data[start:s])
            start = s
        end = e
        if kind == "mfra":
            end = s
            break
    assert start is not None
    frags.append(data[start:end])
    return init, frags


@dataclass(frozen=True)
class Sample:
    init: InitSegment
    fragments: tuple[Fragment, ...]
    fps: int
    duration_s: float

    @property
    def mp4(self) -> bytes:
        return self.init.data + b"".join(f.data for f in self.fragments)


@functools.lru_cache(maxsize=8)
def make_sample(seconds: float = 6.0, *, gop: int = 16, fps: int = 25, size: int = 256, big: bool = False) -> Sample:
    """Encode ``seconds`` of testsrc + sine. ``big`` adds noise and lossless coding (~3 MB/s) so
    multipart thresholds are crossed; otherwise ~20 kB/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "x.mp4"
        video = f"testsrc2=size={size}x{size}:rate={fps}" + (",noise=alls=60:allf=t" if big else "")
        codec = ["-preset", "ultrafast", "-qp", "0"] if big else []
        subprocess.run(
            ["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", video, "-f", "lavfi", "-i",
             "sine=frequency=440:sample_rate=48000", "-t", str(seconds), "-c:v", "libx264", *codec,
             "-g", str(gop), "-keyint_min", str(gop), "-sc_threshold", "0", "-bf", "0", "-c:a", "aac",
             "-movflags", "+frag_keyframe+empty_moov+default_base_moof", "-f", "mp4", str(out)],
            check=True,
        )
        data = out.read_bytes()
    init_b, frag_bs = split_fmp4(data)
    init = InitSegment(init_b, size, size, fps, 48000, "avc1.640015", "mp4a.40.2")
    frags = []
    frame = 0
    for i, b in enumerate(frag_bs):
        n = min(gop, round(seconds * fps) - frame)
        frags.append(Fragment(index=i, data=b, first_frame=frame, num_frames=n, start_s=frame / fps,
                              duration_s=n / fps, is_last=i == len(frag_bs) - 1,
                              resume_state=f"state-{i}".encode() * 8))
        frame += n
    return Sample(init, tuple(frags), fps, seconds)


def ffprobe_duration(path: Path) -> float:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-show_entries", "format=duration", "-of", "csv=p=0", str(path)],
        check=True, capture_output=True, text=True,
    ).stdout
    return float(out.strip())


def decode_frames(path: Path) -> int:
    """Decode the whole file with ffmpeg and count video frames (fails on a corrupt stream)."""
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-count_frames", "-select_streams", "v:0", "-show_entries",
         "stream=nb_read_frames", "-of", "csv=p=0", str(path)],
        check=True, capture_output=True, text=True,
    ).stdout
    return int(out.strip())
