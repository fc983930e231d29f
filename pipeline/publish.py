"""Publisher: frames in, fMP4 fragments out to every sink — on a background thread when streaming.

The render loop hands each emission's frames to :meth:`Publisher.publish` and goes on with the next
chunk while the publisher encodes and delivers on its own :class:`~pipeline.lane.Lane` (a queue of
one emission: the loop waits only when the publisher is a whole emission behind, which bounds memory
to two emissions of frames). Errors raised by the encoder or a sink surface on the next ``publish``
or on ``finish``.

Who calls it: ``Pipeline.run`` only (from the render loop, or from the emission lane when emissions
overlap the next chunk). It owns the encoder; the sinks are the caller's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np

from pipeline.errors import RenderError, SinkError
from pipeline.lane import Lane
from pipeline.media_types import Fragment, FrameSink, InitSegment

log = logging.getLogger(__name__)


class FragmentEncoderLike(Protocol):
    """The part of :class:`pipeline.encode.FragmentEncoder` the publisher uses."""

    @property
    def init_segment(self) -> InitSegment: ...

    def encode(self, frames_THWC: np.ndarray, *, first_frame: int, index: int, is_last: bool,
               resume_state: bytes | None = None) -> Fragment: ...


@dataclass
class _Item:
    frames: np.ndarray
    first_frame: int
    index: int
    is_last: bool
    resume_state: bytes | None


class Publisher:
    def __init__(self, encoder: FragmentEncoderLike, sinks: Sequence[FrameSink], *, asynchronous: bool = True,
                 on_fragment: Callable[[Fragment], None] | None = None,
                 frame_tap: Callable[[int, np.ndarray], None] | None = None) -> None:
        self.encoder = encoder
        self.sinks = list(sinks)
        self.asynchronous = asynchronous
        self.on_fragment = on_fragment
        self.frame_tap = frame_tap  # sees (first_frame, frames) before encoding; must not keep them
        self.encode_s = 0.0
        self.sink_s = 0.0
        self.first_fragment_at: float | None = None  # perf_counter() when fragment 0 reached the sinks
        self.num_fragments = 0
        # (index, time.time()) of the latest deliveries: a live render's delay per emission; a few
        # fragments are in flight at most (one queued per lane), so a short window is enough
        self._delivered: deque[tuple[int, float]] = deque(maxlen=16)
        self._delivered_lock = threading.Lock()
        self._lane: Lane[_Item] = Lane("publisher", self._deliver)
        self._opened: list[FrameSink] = []

    def open(self) -> None:
        init = self.encoder.init_segment
        for sink in self.sinks:
            self._call_sink(sink, "open", partial(sink.open, init))
            self._opened.append(sink)
        if self.asynchronous:
            self._lane.start()

    def publish(self, frames_THWC: np.ndarray, *, first_frame: int, index: int, is_last: bool,
                resume_state: bytes | None) -> None:
        self._lane.raise_pending()
        if self.frame_tap is not None:
            self.frame_tap(first_frame, frames_THWC)
        item = _Item(frames_THWC, first_frame, index, is_last, resume_state)
        if self._lane.running:
            self._lane.submit(item)
        else:
            self._deliver(item)

    def delivered_at(self, index: int) -> float | None:
        """``time.time()`` when fragment ``index`` reached every sink (None: not yet, or long ago)."""
        with self._delivered_lock:
            return next((t for i, t in self._delivered if i == index), None)

    def drain(self) -> None:
        """Wait until every published emission is delivered (raises the first delivery error); the
        sinks stay open until :meth:`finish`."""
        self._lane.finish(ok=True)

    def finish(self, *, ok: bool) -> None:
        """Drain (when ``ok``), then close every opened sink. Raises the first delivery error."""
        error: BaseException | None = None
        try:
            self._lane.finish(ok=ok)
        except BaseException as exc:
            error = exc
        ok = ok and error is None
        close_error: BaseException | None = None
        for sink in self._opened:
            try:
                sink.close(ok=ok)
            except BaseException as exc:  # close every sink even if one fails
                log.error("sink %s failed to close: %s", type(sink).__name__, exc)
                close_error = close_error or exc
        self._opened.clear()
        if error is not None:
            raise error
        if close_error is not None:
            raise _as_sink_error(close_error, "close")

    def _deliver(self, item: _Item) -> None:
        t0 = time.perf_counter()
        fragment = self.encoder.encode(item.frames, first_frame=item.first_frame, index=item.index,
                                       is_last=item.is_last, resume_state=item.resume_state)
        t1 = time.perf_counter()
        self.encode_s += t1 - t0
        for sink in self.sinks:
            self._call_sink(sink, "write", partial(sink.write, fragment))
        self.sink_s += time.perf_counter() - t1
        if self.first_fragment_at is None:
            self.first_fragment_at = time.perf_counter()
        self.num_fragments += 1
        with self._delivered_lock:
            self._delivered.append((item.index, time.time()))
        if self.on_fragment is not None:
            self.on_fragment(fragment)

    def _call_sink(self, sink: FrameSink, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except RenderError:
            raise
        except Exception as exc:
            raise _as_sink_error(exc, f"{type(sink).__name__}.{what}") from exc


def _as_sink_error(exc: BaseException, where: str) -> SinkError:
    if isinstance(exc, SinkError):
        return exc
    return SinkError(f"output sink failed in {where}: {exc}")
