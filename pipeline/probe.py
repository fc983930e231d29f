"""Cheap checks of an input file before a job is queued, with the CLI's rules and messages.

Who calls: the HTTP API (``worker.api.media``) on every uploaded file at submit, so bad media is
refused there instead of failing later in a worker; the worker and ``longtake render`` still run
the full loaders of :mod:`pipeline.inputs` (the same rules). Torch-free: PIL and PyAV only.

* :func:`probe_image` is :func:`pipeline.inputs.load_reference_image` at the smallest accepted size:
  the size and pixel-format rules are checked from the header before any pixel is decoded (a
  20000x20000 image costs a header read), then the pixels are decoded once, which is what finds a
  truncated file. Same function as the render, so the rules cannot drift apart.
* :func:`probe_audio` opens the container, takes the duration from its header and decodes only the
  first second (a render decodes the whole file: hours of audio, not for a submit). A file whose
  header gives no duration is decoded up to the cap, never past it. ``longtake render`` runs the
  same probe before it imports torch, so a bad file fails in a blink with the render's words.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av

from pipeline.errors import InvalidInputError
from pipeline.inputs import (
    MIN_IMAGE_SIDE,
    _audio_error,
    _check_audio_path,
    _ffmpeg_reason,
    _open_audio,
    image_size,
    load_reference_image,
)

_PROBE_DECODE_S = 1.0
"""Seconds of audio decoded to prove the stream decodes (with a header duration)."""


def probe_image(path: Path) -> tuple[int, int]:
    """``(height, width)`` of a usable reference image; raise the CLI's ``InvalidInputError`` otherwise."""
    load_reference_image(path, MIN_IMAGE_SIDE, MIN_IMAGE_SIDE)
    return image_size(path)


@dataclass(frozen=True)
class AudioProbe:
    duration_s: float
    channels: int  # the render downmixes to mono (the CLI says so)


def probe_audio(path: Path, *, max_duration_s: float | None = None) -> AudioProbe:
    """Duration and channels of a usable driving audio file; raise ``InvalidInputError(field="audio")``
    naming the problem and the fix (what :meth:`pipeline.inputs.AudioSource.open` would raise), or
    the operator's cap when it is over it."""
    path = Path(path)
    _check_audio_path(path)
    with _open_audio(path) as container:
        stream = container.streams.audio[0]
        channels = 0
        header_s: float | None = None
        if stream.duration is not None and stream.time_base is not None:
            header_s = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            header_s = container.duration / av.time_base
        if header_s is not None and max_duration_s is not None and header_s > max_duration_s:
            raise _too_long(path, header_s, max_duration_s)
        decode_s = _PROBE_DECODE_S if header_s is not None else (max_duration_s or float("inf")) + 1.0
        decoded = 0.0
        try:
            for frame in container.decode(stream):
                if frame.samples and not channels:
                    channels = int(stream.codec_context.channels or len(frame.layout.channels))
                decoded += frame.samples / float(frame.sample_rate or 1)
                if decoded >= decode_s:
                    break
        except av.FFmpegError as e:
            raise _audio_error(path, f"is corrupt: decoding failed ({_ffmpeg_reason(e)})", "re-export the audio") from e
    if decoded <= 0.0:
        raise _audio_error(path, "contains no audio samples (zero length)", "use a non-empty recording")
    duration = header_s if header_s is not None else decoded
    if max_duration_s is not None and duration > max_duration_s:
        raise _too_long(path, duration, max_duration_s)
    return AudioProbe(duration_s=duration, channels=channels)


def _too_long(path: Path, seconds: float, limit: float) -> InvalidInputError:
    return _audio_error(
        path,
        f"is {seconds:.1f} s long, over this deployment's limit of {limit:g} s",
        "split it into shorter jobs, or ask the operator to raise LONGTAKE_MAX_AUDIO_S",
    )
