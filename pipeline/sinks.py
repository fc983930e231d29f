"""The sinks that need no network: a growing MP4 file and an HLS directory.

Both implement :class:`pipeline.media_types.FrameSink`; the pipeline calls ``open(init)``, ``write``
per fragment in index order, then ``close(ok=...)`` once, on its own thread. Neither keeps fragment bytes
after ``write`` returns: each fragment goes to disk and is fsync'd before ``write`` returns, so whatever a
crash leaves behind is a playable prefix.

:func:`render_hls_playlist` is pure and shared with the S3 delivery sink (worker/), which publishes
the same EVENT playlist next to its uploaded segments.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from pipeline.errors import SinkError
from pipeline.media_types import Fragment, InitSegment

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
HLS_PLAYLIST = "index.m3u8"
HLS_INIT = "init.mp4"
HLS_FAILED_MARKER = "FAILED"


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sink_error(what: str, path: Path, e: OSError) -> SinkError:
    # Stays retryable (SinkError's default): a full disk or read-only mount may not be there when the
    # job is retried, possibly on another machine.
    return SinkError(f"{what} {str(path)!r} failed: {e.strerror or e}; check free space and permissions")


class FileSink:
    """Writes ``init + fragments`` to ``<path>.partial`` as they arrive; renames to ``path`` on success.

    While rendering, ``<path>.partial`` is a valid fragmented MP4 a player can open and follow. On
    ``close(ok=True)`` it is renamed to ``path`` (atomically replacing an older file); on
    ``close(ok=False)`` it is deleted, so no file that looks finished is left behind.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.partial_path = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self._file: BinaryIO | None = None
        self._next_index: int | None = None

    def open(self, init: InitSegment) -> None:
        try:
            self._file = open(self.partial_path, "wb")  # noqa: SIM115 - held open across write() calls
            self._append(init.data)
        except OSError as e:
            raise _sink_error("writing", self.partial_path, e) from e

    def write(self, fragment: Fragment) -> None:
        if self._file is None:
            raise SinkError(f"FileSink({str(self.path)!r}).write called before open or after close")
        if self._next_index is not None and fragment.index != self._next_index:
            raise SinkError(
                f"FileSink got fragment {fragment.index}, expected {self._next_index}", field="out"
            )
        self._next_index = fragment.index + 1
        try:
            self._append(fragment.data)
        except OSError as e:
            raise _sink_error("writing", self.partial_path, e) from e

    def _append(self, data: bytes) -> None:
        assert self._file is not None
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self, *, ok: bool) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()
        if ok:
            if file is None:
                raise SinkError(f"FileSink({str(self.path)!r}) closed with ok=True but was never opened")
            try:
                os.replace(self.partial_path, self.path)
                _fsync_dir(self.path.parent)
            except OSError as e:
                raise _sink_error("renaming to", self.path, e) from e
            logger.info("wrote %s", self.path)
        else:
            self.partial_path.unlink(missing_ok=True)
            logger.info("render failed: removed %s", self.partial_path)


def render_hls_playlist(
    segments: Sequence[tuple[str, float]], target_duration: int, *, ended: bool, init_uri: str = HLS_INIT
) -> str:
    """An HLS v7 EVENT media playlist for fMP4 segments ``(uri, duration_s)`` in order.

    ``target_duration`` (whole seconds) must be >= every segment duration rounded to the nearest
    integer (RFC 8216 4.3.3.1); :func:`hls_target_duration` computes it. ``ended`` adds
    ``#EXT-X-ENDLIST`` (the render finished; players stop polling). The text is
    :func:`hls_playlist_head` + one :func:`hls_playlist_entry` per segment (+ :data:`HLS_ENDLIST`),
    which is how the S3 sink keeps a long render's playlist: as its text, appended per segment.
    """
    for uri, duration in segments:
        if _rounded(duration) > target_duration:
            raise ValueError(
                f"segment {uri} lasts {duration:.3f} s, more than TARGETDURATION {target_duration}"
            )
    body = "".join(hls_playlist_entry(uri, duration) for uri, duration in segments)
    return hls_playlist_head(target_duration, init_uri) + body + (HLS_ENDLIST if ended else "")


HLS_ENDLIST = "#EXT-X-ENDLIST\n"


def hls_playlist_head(target_duration: int, init_uri: str = HLS_INIT) -> str:
    """The lines of an EVENT playlist before its segments (see :func:`render_hls_playlist`)."""
    return (
        "#EXTM3U\n#EXT-X-VERSION:7\n#EXT-X-PLAYLIST-TYPE:EVENT\n#EXT-X-INDEPENDENT-SEGMENTS\n"
        f'#EXT-X-TARGETDURATION:{target_duration}\n#EXT-X-MEDIA-SEQUENCE:0\n#EXT-X-MAP:URI="{init_uri}"\n'
    )


def hls_playlist_entry(uri: str, duration_s: float) -> str:
    """One segment's lines in an EVENT playlist (see :func:`render_hls_playlist`)."""
    return f"#EXTINF:{duration_s:.6f},\n{uri}\n"


def _rounded(seconds: float) -> int:
    return int(seconds + 0.5)  # RFC 8216 rounds to the nearest integer; round() would round half to even


def hls_target_duration(max_segment_s: float) -> int:
    """The smallest valid ``EXT-X-TARGETDURATION`` for segments up to ``max_segment_s`` long."""
    return max(1, math.ceil(max_segment_s))


def hls_segment_name(index: int) -> str:
    return f"seg_{index:05d}.m4s"


class HLSDirectorySink:
    """``directory/init.mp4``, ``seg_00000.m4s`` …, and ``index.m3u8`` rewritten after each segment.

    ``target_duration`` fixes ``EXT-X-TARGETDURATION`` for the whole render (it must not change in an
    EVENT playlist); pass :func:`hls_target_duration` of the longest emission the schedule can make.
    ``None`` derives it from the first segment (1 s of headroom) and publishes the first playlist
    then; a longer segment later is an error. The playlist is replaced atomically (temp file + rename), so a player polling it always
    sees a complete playlist that lists only fully written segments. ``close(ok=True)`` adds
    ``#EXT-X-ENDLIST``; ``close(ok=False)`` leaves the playlist without it and writes a ``FAILED``
    marker file (explaining why), so nobody mistakes the directory for a finished render.
    """

    def __init__(self, directory: Path, *, target_duration: int | None = None) -> None:
        self.directory = Path(directory)
        self.target_duration = target_duration
        self._segments: list[tuple[str, float]] = []
        self._opened = False

    def open(self, init: InitSegment) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / HLS_FAILED_MARKER).unlink(missing_ok=True)
            self._write_file(HLS_INIT, init.data)
            self._opened = True
            if self.target_duration is not None:  # else the first segment fixes it; publish then
                self._publish(ended=False)
        except OSError as e:
            raise _sink_error("writing HLS output in", self.directory, e) from e

    def write(self, fragment: Fragment) -> None:
        if not self._opened:
            raise SinkError(f"HLSDirectorySink({str(self.directory)!r}).write called before open")
        if fragment.index != len(self._segments):
            raise SinkError(f"HLSDirectorySink got fragment {fragment.index}, expected {len(self._segments)}")
        if self.target_duration is None:
            self.target_duration = hls_target_duration(fragment.duration_s) + 1
        if _rounded(fragment.duration_s) > self.target_duration:
            raise SinkError(
                f"fragment {fragment.index} lasts {fragment.duration_s:.3f} s, longer than the HLS target "
                f"duration {self.target_duration} s; pass a larger target_duration to HLSDirectorySink",
                field="out",
            )
        name = hls_segment_name(fragment.index)
        try:
            self._write_file(name, fragment.data)
            self._segments.append((name, fragment.duration_s))
            self._publish(ended=False)
        except OSError as e:
            raise _sink_error("writing HLS segment in", self.directory, e) from e

    def close(self, *, ok: bool) -> None:
        try:
            if ok:
                if not self._opened:
                    raise SinkError(
                        f"HLSDirectorySink({str(self.directory)!r}) closed with ok=True but never opened"
                    )
                self._publish(ended=True)
            else:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._write_file(
                    HLS_FAILED_MARKER,
                    b"This render failed; the playlist is incomplete and has no EXT-X-ENDLIST.\n",
                )
        except OSError as e:
            raise _sink_error("finishing HLS output in", self.directory, e) from e
        self._opened = False

    def _publish(self, *, ended: bool) -> None:
        text = render_hls_playlist(self._segments, self.target_duration or 1, ended=ended)
        self._write_file(HLS_PLAYLIST, text.encode())

    def _write_file(self, name: str, data: bytes) -> None:
        """Write ``name`` atomically: a reader sees the old file or the complete new one."""
        final = self.directory / name
        tmp = self.directory / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(self.directory)
