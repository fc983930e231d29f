"""Live audio: the on-disk feed a session's render reads while its audio is still arriving.

A live session's audio arrives while it renders (issue 13). The process that receives it (the
worker's session feeder; a test) appends it with :class:`LiveAudioWriter` into a *live directory*;
the render (on every rank, all on the same node) reads the same directory as it grows with
``pipeline.live_source.LiveAudioSource``. The directory is the whole contract between the two, so
``pipeline/`` needs no broker, and every rank sees the same timeline: the writer alone decides where
silence goes (the live clock), the readers only wait for bytes.

Layout of a live directory (all appends are whole frames; readers never see half of one):

``meta.json``
    ``{"version": 1, "sample_rate": int, "channels": int, "format": "s16le"}``, written (atomically)
    before any audio. ``format`` is interleaved signed 16-bit little-endian PCM.
``audio.pcm``
    The timeline's samples, appended in order: the sender's audio and the silence the live clock
    inserted, interleaved ``channels`` per frame.
``index.jsonl``
    One line per append, written *after* its bytes: ``{"end": frames, "t": unix_time, "silence":
    bool}`` — the timeline holds ``end`` frames from time ``t`` on (the arrival time of the audio,
    used for the per-chunk delay: publish time minus the arrival of the last frame the chunk needs).
    Readers trust ``index.jsonl``, not the file size, for how much audio there is.
``end.json``
    Written (atomically) once, last: ``{"reason": str, "frames": int, "silence_frames": int}``. After
    it nothing more is appended; ``reason`` is one of :data:`END_REASONS`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "s16le"
VERSION = 1
META, AUDIO, INDEX, END = "meta.json", "audio.pcm", "index.jsonl", "end.json"
END_REASONS = ("closed", "idle_timeout", "disconnected", "cancelled", "max_duration", "error")
"""Why a live feed ended: the sender closed it, nothing arrived for the idle timeout, the sender
went away without closing, the job was cancelled, the operator's maximum duration was reached, or
the feed broke (bad input)."""

MAX_SAMPLE_RATE = 192_000
MAX_CHANNELS = 8


class LiveFormatError(ValueError):
    """A live directory (or what was to be written into one) breaks the format; names the field."""


@dataclass(frozen=True)
class LiveMeta:
    sample_rate: int
    channels: int
    format: str = FORMAT

    def __post_init__(self) -> None:
        if not isinstance(self.sample_rate, int) or not 8000 <= self.sample_rate <= MAX_SAMPLE_RATE:
            raise LiveFormatError(f"sample_rate={self.sample_rate!r}: must be an integer from 8000 to "
                                  f"{MAX_SAMPLE_RATE} Hz (16000, 24000 and 48000 are typical)")
        if not isinstance(self.channels, int) or not 1 <= self.channels <= MAX_CHANNELS:
            raise LiveFormatError(f"channels={self.channels!r}: must be an integer from 1 to {MAX_CHANNELS}")
        if self.format != FORMAT:
            raise LiveFormatError(f"format={self.format!r}: only {FORMAT!r} (interleaved signed 16-bit "
                                  "little-endian PCM) is accepted")

    @property
    def frame_bytes(self) -> int:
        return 2 * self.channels

    @classmethod
    def read(cls, directory: Path) -> LiveMeta:
        data = json.loads((Path(directory) / META).read_text())
        if data.get("version") != VERSION:
            raise LiveFormatError(f"{directory / META}: version {data.get('version')!r}, expected {VERSION}")
        return cls(sample_rate=data["sample_rate"], channels=data["channels"], format=data["format"])


@dataclass(frozen=True)
class LiveEnd:
    reason: str
    frames: int
    silence_frames: int

    @classmethod
    def read(cls, directory: Path) -> LiveEnd | None:
        try:
            data = json.loads((Path(directory) / END).read_text())
        except FileNotFoundError:
            return None
        return cls(reason=data["reason"], frames=int(data["frames"]), silence_frames=int(data["silence_frames"]))


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class LiveAudioWriter:
    """Appends a live timeline into ``directory`` (created; must not hold a feed already).

    Thread-safe. ``write`` takes the sender's PCM (whole frames), ``write_silence`` what the live
    clock inserts; ``close(reason)`` ends the feed. Nothing is kept in memory: bytes go to the file.
    """

    def __init__(self, directory: Path, meta: LiveMeta) -> None:
        self.directory = Path(directory)
        self.meta = meta
        self.directory.mkdir(parents=True, exist_ok=True)
        if (self.directory / META).exists():
            raise LiveFormatError(f"{self.directory} already holds a live feed")
        self._lock = threading.Lock()
        self._audio = open(self.directory / AUDIO, "ab", buffering=0)  # noqa: SIM115 - held for the feed
        self._index = open(self.directory / INDEX, "a", buffering=1)  # noqa: SIM115 - line-buffered
        _write_atomic(self.directory / META, {"version": VERSION, "sample_rate": meta.sample_rate,
                                              "channels": meta.channels, "format": meta.format})
        self.frames = 0
        self.silence_frames = 0
        self.ended: LiveEnd | None = None

    @property
    def duration_s(self) -> float:
        return self.frames / self.meta.sample_rate

    def write(self, pcm: bytes, *, t: float | None = None) -> int:
        """Append the sender's PCM; returns the frames appended. Raises :class:`LiveFormatError`
        for a partial frame (nothing is written then)."""
        if len(pcm) % self.meta.frame_bytes:
            raise LiveFormatError(
                f"audio message of {len(pcm)} bytes is not a whole number of frames ({self.meta.frame_bytes} "
                f"bytes each: {self.meta.channels} channel(s) of 16-bit PCM); send whole frames")
        return self._append(bytes(pcm), silence=False, t=t)

    def write_silence(self, frames: int, *, t: float | None = None) -> int:
        if frames <= 0:
            return 0
        with self._lock:
            self.silence_frames += frames
        return self._append(bytes(frames * self.meta.frame_bytes), silence=True, t=t)

    def _append(self, data: bytes, *, silence: bool, t: float | None) -> int:
        n = len(data) // self.meta.frame_bytes
        if n == 0:
            return 0
        with self._lock:
            if self.ended is not None:
                raise LiveFormatError(f"the live feed in {self.directory} has ended ({self.ended.reason}); "
                                      "nothing can be appended after it")
            view = memoryview(data)
            while view:
                view = view[self._audio.write(view):]
            self.frames += n
            self._index.write(json.dumps({"end": self.frames, "t": time.time() if t is None else t,
                                          "silence": silence}) + "\n")
        return n

    def close(self, reason: str) -> LiveEnd:
        """End the feed (idempotent: a second close returns the first end)."""
        if reason not in END_REASONS:
            raise ValueError(f"reason={reason!r}: one of {END_REASONS}")
        with self._lock:
            if self.ended is None:
                self._audio.close()
                self._index.close()
                self.ended = LiveEnd(reason=reason, frames=self.frames, silence_frames=self.silence_frames)
                _write_atomic(self.directory / END, {"reason": reason, "frames": self.frames,
                                                     "silence_frames": self.silence_frames})
            return self.ended


class LiveClock:
    """The live clock of a session, over its :class:`LiveAudioWriter` (one per feed; thread-safe).

    The clock starts with the first audio (``feed``); from then on the timeline must keep up with
    the wall clock so viewers never see a stall: :meth:`tick` (called every few tens of
    milliseconds by the feeder, and by :meth:`feed` before each append) inserts silence whenever
    the timeline is more than ``max_lag_s`` behind the time elapsed since the start (the sender is
    late; the avatar listens), and late audio is then appended after that silence. Audio faster
    than real time is accepted up to ``max_ahead_s`` ahead of the clock: :meth:`ahead_s` tells the
    receiver when to stop reading from the sender (back-pressure) and :meth:`feed` refuses more.
    """

    def __init__(self, writer: LiveAudioWriter, *, max_lag_s: float, max_ahead_s: float) -> None:
        if max_lag_s <= 0 or max_ahead_s <= 0:
            raise ValueError(f"max_lag_s={max_lag_s}, max_ahead_s={max_ahead_s}: both must be > 0")
        self.writer = writer
        self.max_lag_s = max_lag_s
        self.max_ahead_s = max_ahead_s
        self.started_at: float | None = None  # time.monotonic() of the first audio
        self._lock = threading.Lock()

    def elapsed_s(self, now: float | None = None) -> float:
        if self.started_at is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.started_at

    def ahead_s(self, now: float | None = None) -> float:
        """How far the timeline runs ahead of the clock (negative: behind)."""
        return self.writer.duration_s - self.elapsed_s(now)

    def tick(self, now: float | None = None) -> int:
        """Insert the silence the clock owes; returns the frames inserted."""
        with self._lock:
            if self.started_at is None or self.writer.ended is not None:
                return 0
            now = time.monotonic() if now is None else now
            rate = self.writer.meta.sample_rate
            owed = int((self.elapsed_s(now) - self.max_lag_s) * rate) - self.writer.frames
            return self.writer.write_silence(owed) if owed > 0 else 0

    def would_overrun(self, frames: int, now: float | None = None) -> bool:
        """True when appending ``frames`` now would run more than ``max_ahead_s`` ahead of the
        clock (a receiver holds the audio back, or stops reading its sender, until it is False)."""
        if self.writer.frames == 0:
            return False  # the first audio starts the clock: never refused
        over = self.ahead_s(now) + frames / self.writer.meta.sample_rate - self.max_ahead_s
        return over > 0

    def feed(self, pcm: bytes, now: float | None = None, *, t: float | None = None) -> int:
        """Append the sender's audio (after any silence owed); returns the frames appended.
        ``t``: its arrival time (unix seconds) for the index, when it arrived before now (relayed).
        Raises :class:`LiveFormatError` when it would run more than ``max_ahead_s`` ahead."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self.started_at is None:
                self.started_at = now
        self.tick(now)
        frames = len(pcm) // self.writer.meta.frame_bytes
        if self.would_overrun(frames, now):
            raise LiveFormatError(
                f"audio arrives beyond the session's buffer of max_ahead_s={self.max_ahead_s:g} s ahead of "
                "real time; wait before sending more (the receiver stops reading when it is full)")
        return self.writer.write(pcm, t=t)
