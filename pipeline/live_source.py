"""LiveAudioSource: the driving audio of a live session, read from a growing live directory.

The live counterpart of :class:`pipeline.inputs.AudioSource`, with the same read interface
(:class:`pipeline.inputs.AudioReader`): mono float32 at the rates the render asked for, kept in
unlinked temporary files and read back with ``os.pread`` (never mapped: constant resident memory,
however long the session). The audio is the live directory of ``pipeline.live``: the feeder appends
to it with ``LiveAudioWriter``; every rank of the render opens its own source over the same directory
and converts it independently.

Who calls what: ``render()`` opens one source per render attempt (``request.live``) and closes it
after; the pipeline's live loop calls :meth:`wait` before each step with the audio that step needs
and :meth:`arrival_time` for the delay of each emission; the stages call :meth:`read` and
:meth:`num_samples`; the encoder calls :meth:`wait` and :meth:`read` at its output rate.

Determinism across ranks. Ranks poll at different moments, so what a rank has *arrived* differs; what
the stages see must not. Hence:

* conversion is fed in fixed blocks of feed frames (:data:`BLOCK_S`), whatever the polling, and the
  resampler is flushed only at the end of the feed: every rank computes the same samples;
* :meth:`num_samples` is the *view*: the largest ``stop`` a :meth:`wait` asked for at that rate,
  cut at the feed's final length — a function of the plan, not of timing. :meth:`read` refuses
  samples past the view (a stage reading audio it did not declare, see
  ``ModelFamily.audio_lookahead_frames``) unless the view reaches the end of the feed (past it the
  audio is zeros, as for a file).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import av
import numpy as np

from pipeline.errors import CancelledError, InvalidInputError, LiveFeedError
from pipeline.inputs import _Track
from pipeline.live import AUDIO, INDEX, META, LiveEnd, LiveFormatError, LiveMeta

logger = logging.getLogger(__name__)

BLOCK_S = 0.01
"""Feed audio is converted in blocks of ``sample_rate // 100`` frames (10 ms at 16/48 kHz): at most
this much of the newest audio waits for its block to fill (the resampler's own delay is < 1 ms)."""
POLL_S = 0.005
"""Sleep between two looks at ``index.jsonl`` while waiting."""
STALL_TIMEOUT_S = 30.0
"""A wait fails (:class:`~pipeline.errors.LiveFeedError`) when the index has not grown for this long
and the feed has not ended: the feeder is gone (its live clock inserts silence, so a live feeder
always grows the index)."""
_LAYOUTS = {1: "mono", 2: "stereo", 3: "3.0", 4: "quad", 5: "5.0", 6: "5.1", 7: "6.1", 8: "7.1"}
"""FFmpeg's default layout per channel count (``av_channel_layout_default``): what it assumes for a
WAV of that many channels, so the downmix to mono is the one ``AudioSource`` does."""


class _GrowingTrack(_Track):
    """A track appended while it is read: an unlinked temporary file, samples appended under the
    source's lock and read at positions below ``num_samples`` from any thread."""

    def __init__(self) -> None:
        self.num_samples = 0
        self._file = tempfile.TemporaryFile(prefix="longtake-live-", suffix=".f32", buffering=0)  # noqa: SIM115
        self._lock = threading.Lock()

    def append(self, samples: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(samples, dtype=np.float32).tobytes())
        offset = self.num_samples * 4
        while data:
            n = os.pwrite(self._file.fileno(), data, offset)
            data, offset = data[n:], offset + n
        self.num_samples += len(samples)


class LiveAudioSource:
    """Mono float32 tracks of a live directory at ``rates``, growing as the feed grows.

    ``should_cancel`` is checked while waiting (a cancelled render raises
    :class:`~pipeline.errors.CancelledError` within :data:`POLL_S`); ``stall_timeout_s`` bounds a wait
    on a feed that neither grows nor ends.
    """

    def __init__(self, directory: Path, *, model_rate: int = 16000, output_rate: int = 48000,
                 should_cancel: Callable[[], bool] | None = None,
                 stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.path = Path(directory)
        if not (self.path / META).is_file():
            raise InvalidInputError(
                f"audio {str(self.path)!r} is not a live directory (no {META}); a live render "
                "(RenderRequest.live=True) takes the directory a pipeline.live.LiveAudioWriter writes", field="audio")
        try:
            self.meta = LiveMeta.read(self.path)
        except (LiveFormatError, ValueError, KeyError, TypeError) as exc:
            raise InvalidInputError(f"audio {str(self.path)!r}: bad {META} ({exc}); it must be written by "
                                    "pipeline.live.LiveAudioWriter", field="audio") from exc
        self.should_cancel = should_cancel
        self.stall_timeout_s = stall_timeout_s
        self._lock = threading.RLock()
        self._block = max(1, self.meta.sample_rate // 100)
        self._tracks = {rate: _GrowingTrack() for rate in sorted({model_rate, output_rate})}
        self._view = dict.fromkeys(self._tracks, 0)
        self._complete_view = dict.fromkeys(self._tracks, False)
        self._layout = _LAYOUTS[self.meta.channels]
        self._resamplers = {r: av.AudioResampler(format="flt", layout="mono", rate=r) for r in self._tracks}
        self._pcm = open(self.path / AUDIO, "rb", buffering=0)  # noqa: SIM115 - held for the render
        self._index = open(self.path / INDEX, "rb")  # noqa: SIM115 - held for the render
        self._partial = b""
        self._arrived = 0  # feed frames the index covers
        self._converted = 0  # feed frames fed to the resamplers
        self._arrivals: deque[tuple[int, float]] = deque()  # (end, t) index lines not passed yet
        self._passed = 0  # arrival_time was asked for this position: earlier lines are dropped
        self._last_growth = time.monotonic()
        self._closed = False
        self.end: LiveEnd | None = None  # the feed's end.json, once seen and fully converted

    # ------------------------------------------------------------------------- AudioReader

    def num_samples(self, rate: int) -> int:
        """The view at ``rate`` (see the module docstring): grows with :meth:`wait`, never by itself."""
        self._check(rate)
        return self._view[rate]

    @property
    def duration_s(self) -> float:
        """Seconds of feed the index covers so far (the whole feed once :attr:`ended`)."""
        return self._arrived / self.meta.sample_rate

    def read(self, start: int, stop: int, rate: int) -> np.ndarray:
        """Samples ``[start, stop)`` at ``rate``, zeros before 0 and past the end of the feed."""
        self._check(rate)
        if stop > self._view[rate] and not self._complete_view[rate]:
            raise RuntimeError(
                f"read of samples up to {stop} at {rate} Hz past the live audio released so far "
                f"({self._view[rate]}): the stage reads audio the plan did not wait for; the family's "
                "ModelFamily.audio_lookahead_frames must cover every sample its step stages read")
        return self._tracks[rate].read(start, stop)

    def wait(self, stop: int | None, rate: int, *, timeout_s: float | None = None) -> bool:
        """Block until samples ``[0, stop)`` at ``rate`` are converted, or the feed ended (``stop``
        None: until it ended). True then (the view covers ``stop``, cut at the end of the feed);
        False when ``timeout_s`` passed first. Raises ``CancelledError`` when ``should_cancel()``
        and ``LiveFeedError`` when the feed stalls for ``stall_timeout_s``."""
        self._check(rate)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.poll()
            with self._lock:
                have = self._tracks[rate].num_samples
                if self.end is not None and (stop is None or stop >= have):
                    self._view[rate], self._complete_view[rate] = have, True
                    return True
                if stop is not None and have >= stop:
                    self._view[rate] = max(self._view[rate], stop)
                    return True
            if self.should_cancel is not None and self.should_cancel():
                raise CancelledError(f"render cancelled while waiting for live audio ({self.path})")
            now = time.monotonic()
            if now - self._last_growth > self.stall_timeout_s:
                raise LiveFeedError(
                    f"live audio {str(self.path)!r} has not grown for {self.stall_timeout_s:g} s and has no "
                    "end.json: the feeder stopped without closing the feed (LiveAudioWriter.close)")
            if deadline is not None and now >= deadline:
                return False
            time.sleep(POLL_S)

    # ------------------------------------------------------------------------------ live

    @property
    def ended(self) -> bool:
        """The feed ended and every frame of it is converted (``end`` is set)."""
        return self.end is not None

    def available_frames(self) -> int:
        """Feed frames the index covers (after the last :meth:`poll`)."""
        return self._arrived

    def arrival_time(self, frames: int) -> float:
        """``time.time()`` at which the feed's timeline first held ``frames`` frames (the ``t`` of the
        first index line with ``end >= frames``); positions past the end of the feed give the last
        line's. Must be asked in non-decreasing order (the lines before are dropped: constant memory)
        and only for positions that have arrived."""
        with self._lock:
            if frames < self._passed:
                raise ValueError(f"arrival_time({frames}) after arrival_time({self._passed}): ask in order")
            self._passed = frames
            while len(self._arrivals) > 1 and self._arrivals[0][0] < frames:
                self._arrivals.popleft()
            if not self._arrivals or (self._arrivals[0][0] < frames and self.end is None):
                raise ValueError(f"arrival_time({frames}): the feed holds {self._arrived} frames so far")
            return self._arrivals[0][1]

    def poll(self) -> None:
        """Read the index lines appended since the last poll and convert the whole blocks they cover
        (everything, and flush, once ``end.json`` is there)."""
        with self._lock:
            if self._closed:
                raise ValueError(f"LiveAudioSource({str(self.path)!r}) is closed")
            if self.end is not None:
                return
            end = LiveEnd.read(self.path)  # before the index: after end.json nothing more is appended
            data = self._partial + self._index.read()
            lines = data.split(b"\n")
            self._partial = lines.pop()
            for line in lines:
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    arrived, t = int(entry["end"]), float(entry["t"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise LiveFeedError(f"live audio {str(self.path)!r}: bad {INDEX} line {line[:80]!r} ({exc})") \
                        from exc
                if arrived < self._arrived:
                    raise LiveFeedError(f"live audio {str(self.path)!r}: {INDEX} goes back from {self._arrived} "
                                        f"to {arrived} frames")
                self._arrived = arrived
                self._arrivals.append((arrived, t))
                self._last_growth = time.monotonic()
            if end is not None and end.frames != self._arrived:
                if self._partial or end.frames > self._arrived:
                    return  # end.json was written after lines we have not read whole yet: next poll
                raise LiveFeedError(f"live audio {str(self.path)!r}: end.json says {end.frames} frames, "
                                    f"the index {self._arrived}")
            target = self._arrived if end is not None else self._arrived - self._arrived % self._block
            self._convert(target, flush=end is not None)
            if end is not None:
                self.end = end
                logger.info("live audio %s ended (%s): %.2f s, %.2f s of it silence", self.path, end.reason,
                            end.frames / self.meta.sample_rate, end.silence_frames / self.meta.sample_rate)

    def _convert(self, target: int, *, flush: bool) -> None:
        fb = self.meta.frame_bytes
        while self._converted < target:
            # whole blocks from a block boundary (the tail block only at the end): the same blocks
            # on every rank, however they polled
            n = min(target - self._converted, self._block * 50)
            raw = os.pread(self._pcm.fileno(), n * fb, self._converted * fb)
            if len(raw) != n * fb:
                raise LiveFeedError(f"live audio {str(self.path)!r}: {AUDIO} holds fewer bytes than its index")
            pcm = np.frombuffer(raw, dtype="<i2")
            for start in range(0, n, self._block):
                block = pcm[start * self.meta.channels : (start + self._block) * self.meta.channels]
                frame = av.AudioFrame.from_ndarray(block.reshape(1, -1), format="s16", layout=self._layout)
                frame.sample_rate = self.meta.sample_rate
                for rate, resampler in self._resamplers.items():
                    self._append(rate, resampler.resample(frame))
            self._converted += n
        if flush:
            for rate, resampler in self._resamplers.items():
                self._append(rate, resampler.resample(None))

    def _append(self, rate: int, frames: list[av.AudioFrame]) -> None:
        for fr in frames:
            self._tracks[rate].append(fr.to_ndarray()[0])

    # ------------------------------------------------------------------------------ life

    def close(self) -> None:
        """Close the files (freeing the converted tracks' disk space). Idempotent."""
        with self._lock:
            self._closed = True
            for track in self._tracks.values():
                track.close()
            self._pcm.close()
            self._index.close()

    def __enter__(self) -> LiveAudioSource:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _check(self, rate: int) -> None:
        if self._closed:
            raise ValueError(f"LiveAudioSource({str(self.path)!r}) is closed")
        if rate not in self._tracks:
            raise ValueError(f"live audio is converted at {sorted(self._tracks)} Hz, not {rate} Hz")
