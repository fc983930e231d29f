"""What flows from the encoder to the sinks: an init segment once, then fMP4 fragments.

The encoder (``pipeline/encode.py``) produces these; every :class:`FrameSink` (file, HLS directory,
S3 progressive upload, KVS live preview) consumes them. Sinks never see raw frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class InitSegment:
    """``ftyp`` + ``moov`` of a CMAF-style fragmented MP4 (H.264 video track 1, AAC audio track 2).

    Identical for every attempt of a job with the same output settings, so a resumed render can
    reuse the one already stored.
    """

    data: bytes = field(repr=False)
    width: int
    height: int
    fps: int
    sample_rate: int
    video_codec: str  # RFC 6381 codec string, e.g. "avc1.64001e"
    audio_codec: str  # e.g. "mp4a.40.2"


@dataclass(frozen=True)
class Fragment:
    """One ``moof`` + ``mdat`` pair: the frames of one emission (see ``pipeline.schedule``) and
    their audio, starting with a video keyframe, decodable on its own after the init segment.

    ``index`` is the emission index on the job's timeline (0, 1, 2, …), stable across resumes.
    ``resume_state`` is the rolling-state snapshot taken right after this emission (bytes from
    ``RollingState.snapshot``); a worker that commits this fragment stores it so a retry can
    continue from here. ``is_last`` marks the final fragment of the render.
    """

    index: int
    data: bytes = field(repr=False)
    first_frame: int
    num_frames: int
    start_s: float
    duration_s: float
    is_last: bool = False
    resume_state: bytes | None = field(default=None, repr=False)


@runtime_checkable
class FrameSink(Protocol):
    """Receives the encoded output of one render attempt.

    Called by the pipeline on its own thread, in this order: ``open`` once, ``write`` for each
    fragment in index order, then ``close`` once (also when the render fails or is cancelled).
    ``write`` may block for back-pressure but should return within about one fragment's worth of
    time; it must not keep a reference to anything but the bytes it still has to deliver.
    ``close(ok=False)`` must leave nothing that looks like a finished output.
    A sink raises :class:`pipeline.errors.SinkError` (retryable or not) when it cannot deliver.
    """

    def open(self, init: InitSegment) -> None: ...

    def write(self, fragment: Fragment) -> None: ...

    def close(self, *, ok: bool) -> None: ...
