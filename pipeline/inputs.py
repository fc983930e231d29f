"""Loading and validating a render's inputs: the reference image, the driving audio, the output path.

Called once per render attempt before any model runs, so a bad input fails fast with an
:class:`~pipeline.errors.InvalidInputError` that names the field, the file, what is wrong and the fix.

* :func:`load_reference_image` -> HxWx3 uint8 RGB, centre-cropped to the target aspect, Lanczos-resized.
  Transparency, CMYK and 16-bit channels are rejected with the command that fixes them: each would
  need a guess (which background, which colour profile) that silently changes the person's look.
  An alpha channel that is fully opaque (alpha 255 everywhere) is no transparency and is dropped.
* :class:`AudioSource` decodes the audio file once into two mono float32 tracks (model rate for
  features, output rate for AAC) kept in temporary files, so a multi-hour input costs disk, not RAM.
  The pipeline reads windows of it per chunk, the encoder its fragment's span, both with positioned
  reads (``os.pread``): nothing of the file is mapped, so none of it counts in the resident set.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol, runtime_checkable

import av
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from pipeline.errors import InvalidInputError
from pipeline.sinks import HLS_FAILED_MARKER, HLS_INIT, HLS_PLAYLIST

logger = logging.getLogger(__name__)

MIN_IMAGE_SIDE = 64
MAX_IMAGE_SIDE = 8192
MAX_IMAGE_PIXELS = 40_000_000
_SUPPORTED_HINT = "use an 8-bit RGB or grayscale PNG, JPEG, WebP, BMP, GIF or TIFF without transparency"


def _image_error(path: Path, problem: str, fix: str = _SUPPORTED_HINT) -> InvalidInputError:
    return InvalidInputError(f"reference image {str(path)!r} {problem}; {fix}", field="image")


def image_size(path: Path) -> tuple[int, int]:
    """``(height, width)`` of the image at ``path`` as displayed (EXIF orientation applied), from its
    header only; errors as :func:`load_reference_image` (which ``render()`` calls next)."""
    path = Path(path)
    try:
        with Image.open(path) as im:
            w, h = im.size
            orientation = im.getexif().get(0x0112, 1)
    except (OSError, SyntaxError, ValueError, EOFError, UnidentifiedImageError, Image.DecompressionBombError):
        load_reference_image(path, MIN_IMAGE_SIDE, MIN_IMAGE_SIDE)  # raises the error that names the fix
        raise
    return (w, h) if orientation in (5, 6, 7, 8) else (h, w)


def load_reference_image(path: Path, height: int, width: int) -> np.ndarray:
    """Open ``path`` and return a ``(height, width, 3)`` uint8 RGB array.

    Size limits are checked from the header before any pixel is decoded. EXIF orientation is applied.
    """
    path = Path(path)
    if not path.exists():
        raise _image_error(path, "does not exist", "check the path")
    if path.is_dir():
        raise _image_error(path, "is a directory, not an image file", "pass the image file inside it")
    try:
        with warnings.catch_warnings():
            # Pillow warns (and beyond 2x its limit raises) on decompression bombs; our own limits below
            # are stricter, so turn its warning into the error path too.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                w, h = im.size
                _check_image_size(path, w, h)
                _check_pixel_format(path, im)  # from the header, before decoding pixels
                im.load()
                rgb = _to_rgb(path, ImageOps.exif_transpose(im) or im)
    except InvalidInputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _image_error(
            path,
            f"is too large to decode safely, larger than the maximum of {MAX_IMAGE_SIDE} per side and "
            f"{MAX_IMAGE_PIXELS} pixels ({e})",
            f"downscale it to at most {MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE}",
        ) from e
    except UnidentifiedImageError as e:
        raise _image_error(path, "is not a recognised image (unknown format or not an image at all)") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise _image_error(path, f"is corrupt or truncated ({e})", "re-export the image") from e
    src_w, src_h = rgb.size
    # Largest centred box with the target aspect, then one Lanczos resample from that box.
    scale = min(src_w / width, src_h / height)
    box_w, box_h = width * scale, height * scale
    left, top = (src_w - box_w) / 2, (src_h - box_h) / 2
    out = rgb.resize((width, height), Image.Resampling.LANCZOS, box=(left, top, left + box_w, top + box_h))
    return np.asarray(out, dtype=np.uint8).copy()


def _check_image_size(path: Path, w: int, h: int) -> None:
    if min(w, h) < MIN_IMAGE_SIDE:
        raise _image_error(
            path,
            f"is {w}x{h} pixels, smaller than the minimum of {MIN_IMAGE_SIDE} on each side",
            f"use an image at least {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE} (ideally as large as the output)",
        )
    if max(w, h) > MAX_IMAGE_SIDE or w * h > MAX_IMAGE_PIXELS:
        raise _image_error(
            path,
            f"is {w}x{h} pixels, larger than the maximum of {MAX_IMAGE_SIDE} per side "
            f"and {MAX_IMAGE_PIXELS} pixels",
            f"downscale it to at most {MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE}",
        )


def _is_sixteen_bit(im: Image.Image) -> bool:
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        return True
    # 16-bit RGB(A) PNGs open as "RGB"/"RGBA" with a ";16" raw mode: Pillow would silently drop bits.
    return any(";16" in str(getattr(t, "args", "")) for t in getattr(im, "tile", None) or [])


def _check_pixel_format(path: Path, im: Image.Image) -> None:
    """Accept 8-bit RGB, grayscale and palette images; reject what we would have to guess about.

    Transparency (checked on the pixels by :func:`_to_rgb`: a fully opaque alpha channel is
    accepted), CMYK and 16-bit channels are rejected rather than converted: flattening onto a
    background we pick, converting CMYK without the printer's colour profile, or dropping bits all
    change the person's appearance silently, and identity is what the product is about.
    """
    mode = im.mode
    if mode in ("RGBa", "La"):  # premultiplied alpha: only ever transparent data
        raise _transparency_error(path, mode)
    if mode == "CMYK":
        raise _image_error(
            path, "is CMYK (print colours)",
            "convert it to sRGB with its colour profile, e.g. `convert IMAGE -colorspace sRGB OUT.png`")
    if _is_sixteen_bit(im):
        raise _image_error(
            path, "has 16 bits per channel",
            "save it with 8 bits per channel, e.g. `convert IMAGE -depth 8 OUT.png`")


def _has_alpha(im: Image.Image) -> bool:
    return im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info)


def _transparency_error(path: Path, mode: str) -> InvalidInputError:
    return _image_error(
        path, f"has transparent pixels (an alpha channel, mode {mode}, below fully opaque)",
        "flatten it onto the opaque background you want and save it as RGB, e.g. "
        "`convert IMAGE -background white -alpha remove -alpha off OUT.png`")


def _drop_opaque_alpha(path: Path, im: Image.Image) -> Image.Image:
    """An image with an alpha channel that is fully opaque everywhere (most screenshots and exports)
    as its colour channels; any pixel below alpha 255 is refused (which background would we pick?).
    Called by :func:`_to_rgb` after the pixels are loaded."""
    rgba = im.convert("RGBA") if im.mode in ("P", "PA") else im
    if int(np.asarray(rgba.getchannel("A")).min()) < 255:
        raise _transparency_error(path, im.mode)
    return rgba.convert("RGB") if rgba.mode == "RGBA" else rgba.convert("L")


def _to_rgb(path: Path, im: Image.Image) -> Image.Image:
    if _has_alpha(im):
        im = _drop_opaque_alpha(path, im)
    mode = im.mode
    if mode == "F":
        raise _image_error(path, "is a floating-point image (mode F) with no defined range")
    if mode in ("1", "L", "P", "YCbCr", "RGB"):
        return im.convert("RGB")
    raise _image_error(path, f"has unsupported pixel mode {mode!r}")


# ------------------------------------------------------------------------------------------- audio


def _audio_error(path: Path, problem: str, fix: str) -> InvalidInputError:
    return InvalidInputError(f"audio {str(path)!r} {problem}; {fix}", field="audio")


_AUDIO_FIX = "use a WAV, MP3, M4A/AAC, FLAC or Ogg file with an audio track"


@runtime_checkable
class AudioReader(Protocol):
    """The driving audio as the stages and the encoder read it: :class:`AudioSource` (a file, whole
    from the start) and ``pipeline.live_source.LiveAudioSource`` (a live feed, growing)."""

    def read(self, start: int, stop: int, rate: int) -> np.ndarray:
        """Mono float32 samples ``[start, stop)`` at ``rate``, zero outside the audio."""
        ...

    def num_samples(self, rate: int) -> int:
        """Length of the audio in samples at ``rate`` (live: what the render has waited for so far)."""
        ...

    def wait(self, stop: int | None, rate: int, *, timeout_s: float | None = None) -> bool:
        """Block until samples ``[0, stop)`` at ``rate`` can be read, or the audio is complete
        (``stop`` None: until it is complete); False if ``timeout_s`` passed first."""
        ...


class AudioSource:
    """The driving audio, decoded once, mono float32 at two rates, on disk.

    Created by the worker/CLI with :meth:`open` before the render, read by the audio-feature stage
    (``model_rate``) and the encoder (``output_rate``), from two threads, closed after the render.
    :meth:`read` returns new arrays read with ``os.pread`` from the open files: the tracks are never
    memory-mapped, because file-backed pages a process touched stay in its resident set — with a
    mapping (and ``madvise(DONTNEED)`` of each window read) the kernel's fault-around mapped the
    neighbouring, already-read pages back in, and RSS grew by ~48 MB per 10 minutes of video
    (docs/benchmarks.md, "Memory as users run it"). On POSIX the temp files are unlinked as soon as
    they are opened: the disk space lives exactly as long as the descriptors, and a killed worker
    leaks nothing. Elsewhere they are deleted by :meth:`close`.
    """

    def __init__(self, path: Path, tracks: dict[int, _Track], files: list[Path]) -> None:
        self.path = path
        self._tracks = tracks
        self._files = files
        self._closed = False

    @classmethod
    def open(cls, path: Path, model_rate: int = 16000, output_rate: int = 48000) -> AudioSource:
        path = Path(path)
        _check_audio_path(path)
        rates = sorted({model_rate, output_rate})
        tmpdir = Path(tempfile.gettempdir())
        files: list[Path] = []
        writers: dict[int, BinaryIO] = {}
        tracks: dict[int, _Track] = {}
        try:
            for rate in rates:
                fd, name = tempfile.mkstemp(prefix=f"longtake-audio-{rate}-", suffix=".f32", dir=tmpdir)
                files.append(Path(name))
                writers[rate] = os.fdopen(fd, "wb")
            _decode_into(path, writers)
            for f in writers.values():
                f.close()
            for rate, file in zip(rates, files, strict=True):
                n = file.stat().st_size // 4
                if n == 0:
                    raise _audio_error(
                        path, "contains no audio samples (zero length)", "use a non-empty recording"
                    )
                tracks[rate] = _Track(file, n)
            if os.name == "posix":
                for file in files:
                    file.unlink()
                files = []
        except BaseException:
            for f in writers.values():
                f.close()
            for track in tracks.values():
                track.close()
            for file in files:
                file.unlink(missing_ok=True)
            raise
        source = cls(path, tracks, files)
        logger.info("decoded audio %s: %.2f s", path, source.duration_s)
        return source

    def num_samples(self, rate: int) -> int:
        return self._track(rate).num_samples

    @property
    def duration_s(self) -> float:
        rate = max(self._tracks)
        return self.num_samples(rate) / rate

    def read(self, start: int, stop: int, rate: int) -> np.ndarray:
        """Samples ``[start, stop)`` at ``rate`` as a new float32 array, zeros outside ``[0, n)``."""
        return self._track(rate).read(start, stop)

    def wait(self, stop: int | None, rate: int, *, timeout_s: float | None = None) -> bool:
        """A file's audio is complete from the start: nothing to wait for."""
        self._track(rate)
        return True

    def close(self) -> None:
        """Close the files (and with them free the disk space). Idempotent."""
        self._closed = True
        for track in self._tracks.values():
            track.close()
        self._tracks.clear()  # closed before unlinking (Windows would refuse otherwise)
        for file in self._files:
            file.unlink(missing_ok=True)
        self._files = []

    def __enter__(self) -> AudioSource:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _track(self, rate: int) -> _Track:
        if self._closed:
            raise ValueError(f"AudioSource({str(self.path)!r}) is closed")
        if rate not in self._tracks:
            raise ValueError(f"audio was decoded at {sorted(self._tracks)} Hz, not {rate} Hz")
        return self._tracks[rate]


class _Track:
    """One decoded track: an open file of float32 samples, read at positions (thread-safe)."""

    def __init__(self, file: Path, num_samples: int) -> None:
        self.num_samples = num_samples
        self._file = open(file, "rb", buffering=0)  # noqa: SIM115 - held open for the render
        self._lock = threading.Lock()  # only where there is no os.pread (one shared file offset)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Samples ``[start, stop)`` as a new float32 array, zeros outside ``[0, num_samples)``."""
        if stop < start:
            raise ValueError(f"read(start={start}, stop={stop}): stop must be >= start")
        out = np.zeros(stop - start, dtype=np.float32)
        lo, hi = max(start, 0), min(stop, self.num_samples)
        if hi > lo:
            self.read_into(out[lo - start : hi - start], lo)
        return out

    def read_into(self, out: np.ndarray, first: int) -> None:
        view = out.data.cast("B")  # out: a contiguous float32 slice of the result
        offset, done = first * 4, 0
        while done < len(view):
            if hasattr(os, "preadv"):
                n = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            else:  # pragma: no cover - not POSIX
                with self._lock:
                    self._file.seek(offset + done)
                    n = self._file.readinto(view[done:]) or 0
            if n <= 0:
                raise OSError(f"decoded audio file ended at byte {offset + done}, expected {offset + len(view)}")
            done += n

    def close(self) -> None:
        self._file.close()


def _check_audio_path(path: Path) -> None:
    if not path.exists():
        raise _audio_error(path, "does not exist", "check the path")
    if path.is_dir():
        raise _audio_error(path, "is a directory, not an audio file", "pass the audio file inside it")


def _ffmpeg_reason(e: BaseException) -> str:
    """FFmpeg's own words for ``e`` without PyAV's "[Errno 1094995529]" (an AVERROR code) or the
    repeated file name: e.g. "Invalid data found when processing input"."""
    text = getattr(e, "strerror", None) or str(e)
    return re.sub(r"^\[Errno -?\d+\]\s*", "", str(text)).split(": '")[0].strip()


def _open_audio(path: Path) -> av.container.InputContainer:
    """``av.open`` of ``path`` with its first audio stream checked; the caller closes it."""
    try:
        container = av.open(str(path), mode="r")
    except (av.FFmpegError, UnicodeDecodeError) as e:
        raise _audio_error(path, f"is not a readable audio file ({_ffmpeg_reason(e)})", _AUDIO_FIX) from e
    if not container.streams.audio:
        kind = "is a video without an audio track" if container.streams.video else "has no audio stream"
        if container.format.name.endswith("_pipe") or container.format.name == "image2":
            kind = f"is an image ({container.format.name.removesuffix('_pipe')}), not audio"
        container.close()
        raise _audio_error(path, kind, _AUDIO_FIX)
    return container


def _decode_into(path: Path, writers: dict[int, BinaryIO]) -> None:
    """Decode the first audio stream of ``path``, resample to mono float32 per rate, append to files."""
    with _open_audio(path) as container:
        stream = container.streams.audio[0]
        resamplers = {rate: av.AudioResampler(format="flt", layout="mono", rate=rate) for rate in writers}
        try:
            for frame in container.decode(stream):
                frame.pts = None  # resample by sample count; gaps/jitter in pts must not insert silence
                for rate, resampler in resamplers.items():
                    _write(writers[rate], resampler.resample(frame))
            for rate, resampler in resamplers.items():
                _write(writers[rate], resampler.resample(None))
        except av.FFmpegError as e:
            raise _audio_error(path, f"is corrupt: decoding failed ({_ffmpeg_reason(e)})",
                               "re-export the audio") from e


def _write(f: BinaryIO, frames: list[av.AudioFrame]) -> None:
    for fr in frames:
        f.write(np.ascontiguousarray(fr.to_ndarray()[0], dtype=np.float32).tobytes())


# ------------------------------------------------------------------------------------------ output


def validate_output_path(path: Path, *, overwrite: bool = False) -> Path:
    """Check an ``.mp4`` output path before rendering; creates the parent directory. Returns it absolute.

    The one rule for every output (:func:`validate_hls_directory` too): an existing output is
    refused unless ``overwrite`` (``longtake render --force``); it is replaced only when the new
    render succeeds (``FileSink`` renames over it).
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise InvalidInputError(
            f"output {str(path)!r} is a directory; pass a file path such as {str(path / 'out.mp4')!r} "
            "(or use the HLS directory output)",
            field="out",
        )
    if path.suffix.lower() != ".mp4":
        raise InvalidInputError(
            f"output {str(path)!r} must end in .mp4 (the file is a fragmented MP4); rename it",
            field="out",
        )
    if path.exists() and not overwrite:
        raise InvalidInputError(
            f"output {str(path)!r} already exists; pass --force to overwrite it (it is replaced only "
            "when the new render succeeds), or choose another path",
            field="out",
        )
    _ensure_writable_dir(path.parent, path)
    return path.resolve()


def _is_hls_output(name: str) -> bool:
    """A file an :class:`~pipeline.sinks.HLSDirectorySink` writes (``--force`` may remove it)."""
    return name in (HLS_PLAYLIST, HLS_INIT, HLS_FAILED_MARKER) or bool(re.fullmatch(r"seg_\d{5}\.m4s", name))


def validate_hls_directory(path: Path, *, overwrite: bool = False) -> Path:
    """Check an HLS output directory: missing (created), empty, or — with ``overwrite`` — holding an
    earlier render's playlist and segments, which are removed. Returns it absolute.

    Same rule as :func:`validate_output_path`. Files that are not HLS output are never removed: a
    directory holding any is refused even with ``overwrite``.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise InvalidInputError(
            f"HLS output {str(path)!r} is a file; pass a directory path for the playlist and segments",
            field="hls",
        )
    _ensure_writable_dir(path, path)
    present = sorted(p.name for p in path.iterdir())
    if not present:
        return path.resolve()
    foreign = [name for name in present if not _is_hls_output(name)]
    if foreign:
        raise InvalidInputError(
            f"HLS output directory {str(path)!r} holds files that are not HLS output "
            f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); pass a new or empty directory",
            field="hls",
        )
    if not overwrite:
        raise InvalidInputError(
            f"HLS output directory {str(path)!r} already holds a render ({len(present)} files); pass "
            "--force to replace it, or a new or empty directory",
            field="hls",
        )
    for name in present:
        (path / name).unlink()
    return path.resolve()


def _ensure_writable_dir(directory: Path, target: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidInputError(
            f"output {str(target)!r}: cannot create directory {str(directory)!r} ({e.strerror}); "
            "choose a location you can write to",
            field="out",
        ) from e
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InvalidInputError(
            f"output {str(target)!r}: directory {str(directory)!r} is not writable; "
            "choose a location you can write to",
            field="out",
        )
