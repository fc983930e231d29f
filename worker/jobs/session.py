"""The worker side of a live session (issue 13): the feeder that turns the relayed audio into the
live directory the render follows, on the live clock.

Who calls what: :class:`worker.jobs.tasks.JobWorker` builds one :class:`SessionFeeder` per session
attempt before the render starts (the constructor writes the live directory's ``meta.json``, so the
render finds it), ``start()``s it next to the render, feeds each render progress to
:meth:`SessionFeeder.on_progress` and, once the render has returned, ``stop()``s it and records
:meth:`SessionFeeder.report` on the job row.

The feeder's thread loops every ``tick_s`` (50 ms): it reads the relay
(:class:`worker.jobs.session_relay.SessionRelay`), appends the sender's PCM with
:class:`pipeline.live.LiveAudioWriter` (stamped with its arrival at the API) and lets
:class:`pipeline.live.LiveClock` insert silence whenever the sender is late by more than
``max_lag_s``. Audio more than ``max_ahead_s`` ahead of the clock is held (and the relay left
unread) until the clock catches up. The feed ends, with ``end.json``, on the first of:

- the sender's end record: ``closed`` (its ``end`` message), ``disconnected`` (the socket dropped),
  ``error`` (bad input; the message is the job's error);
- ``idle_timeout``: nothing from the sender for ``idle_timeout_s`` since the render started (or since
  its last message; silence is rendered meanwhile);
- ``max_duration``: the timeline reached ``max_s`` (the last message is cut there);
- ``cancelled``: the job was cancelled, or the lease lost (``stop_reason``).

Audio already relayed when the sender ends is fed first (nothing accepted is lost).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from pipeline.live import LiveAudioWriter, LiveClock, LiveMeta
from pipeline.request import RenderProgress
from worker.jobs import metrics
from worker.jobs.session_relay import RelayRecord, SessionRelay
from worker.logging import job_context
from worker.spec import SessionSpec

log = logging.getLogger(__name__)


class SessionFeeder(threading.Thread):
    """Feeds one session's live directory from its relay (see the module doc). Daemon thread."""

    def __init__(
        self,
        job_id: str,
        live_dir: Path,
        spec: SessionSpec,
        relay_factory: Callable[[], SessionRelay],
        *,
        max_s: float,
        max_ahead_s: float,
        max_lag_s: float,
        stop_reason: Callable[[], str | None],
        tick_s: float = 0.05,
    ) -> None:
        super().__init__(name=f"session-{job_id[:8]}", daemon=True)
        self.job_id = job_id
        self.spec = spec
        self.writer = LiveAudioWriter(live_dir, LiveMeta(sample_rate=spec.sample_rate, channels=spec.channels))
        self.clock = LiveClock(self.writer, max_lag_s=max_lag_s, max_ahead_s=max_ahead_s)
        self.max_s = max_s
        self.tick_s = tick_s
        self._relay_factory = relay_factory
        self._stop_reason = stop_reason
        self._halt = threading.Event()
        self._pending: deque[RelayRecord] = deque()
        self._lock = threading.Lock()
        self.error: str | None = None  # the sender's error (end record "error"), for the job row
        self.ready = False  # set by the task once the render has started (the API then says `ready`)
        self.audio_frames = 0
        self.num_chunks = 0
        self.delay_last_s: float | None = None
        self.delay_max_s: float | None = None
        self._delay_sum_s = 0.0

    # ------------------------------------------------------------------ what the task reads
    @property
    def end_reason(self) -> str | None:
        return self.writer.ended.reason if self.writer.ended is not None else None

    def on_progress(self, p: RenderProgress) -> None:
        """One emission published: record its audio delay (job row, Prometheus)."""
        if p.audio_delay_s is None:
            return
        delay = max(0.0, p.audio_delay_s)
        metrics.LIVE_CHUNK_DELAY.observe(delay)
        with self._lock:
            self.num_chunks += 1
            self.delay_last_s = delay
            self.delay_max_s = delay if self.delay_max_s is None else max(self.delay_max_s, delay)
            self._delay_sum_s += delay

    def report(self) -> dict[str, object]:
        """The session's state for ``jobs.session_state`` (docs/sessions.md, "What the job row says")."""
        rate = self.spec.sample_rate
        with self._lock:
            mean = self._delay_sum_s / self.num_chunks if self.num_chunks else None
            return {
                "ready": self.ready,
                "end_reason": self.end_reason,
                "audio_s": round(self.audio_frames / rate, 4),
                "silence_s": round(self.writer.silence_frames / rate, 4),
                "duration_s": round(self.writer.frames / rate, 4),
                "chunk_delay_s": _round(self.delay_last_s),
                "chunk_delay_max_s": _round(self.delay_max_s),
                "chunk_delay_mean_s": _round(mean),
                "error": self.error,
            }

    def stop(self, reason: str = "cancelled") -> None:
        """End the feed (if it has not ended) and the thread; the render then finishes what it has."""
        self._halt.set()
        self.join(timeout=10)
        self.writer.close(reason)

    # ------------------------------------------------------------------ the thread
    def run(self) -> None:
        with job_context(self.job_id):
            try:
                relay = self._relay_factory()
            except Exception as exc:
                log.exception("session: the relay is unreachable")
                self.error = f"the session's audio relay (the broker) is unreachable: {exc}"
                self.writer.close("error")
                return
            try:
                self._loop(relay)
            except Exception as exc:
                log.exception("session feeder failed")
                self.error = self.error or f"the session feeder failed: {type(exc).__name__}: {exc}"
                self.writer.close("error")
            finally:
                relay.delete()
                relay.close()
            log.info("session ended: %s", self.report(), extra={"session": self.report()})

    def _loop(self, relay: SessionRelay) -> None:
        last_heard = time.monotonic()
        sender_end: RelayRecord | None = None
        while not self._halt.is_set() and self.writer.ended is None:
            now = time.monotonic()
            stop = self._stop_reason()
            if stop is not None:
                self.writer.close("cancelled")
                return
            if not self.ready:
                last_heard = now  # the idle timeout counts from the render's start (the API's `ready`)
            self.clock.tick(now)
            if self.writer.duration_s >= self.max_s:
                self.writer.close("max_duration")
                return
            self._feed_pending(now)
            if sender_end is not None and not self._pending:
                if sender_end.reason == "error":
                    self.error = sender_end.message or "the sender's stream broke"
                self.writer.close(sender_end.reason or "error")
                return
            if sender_end is None and not self._pending:
                record = relay.receive(self.tick_s)
                if record is not None:
                    last_heard = time.monotonic()
                    if record.kind == "end":
                        sender_end = record
                    elif record.data:
                        self._pending.append(record)
                    continue
                if time.monotonic() - last_heard >= self.spec.idle_timeout_s:
                    self.writer.close("idle_timeout")
                    return
            else:
                self._halt.wait(self.tick_s)

    def _feed_pending(self, now: float) -> None:
        """Append held audio while the clock allows (at most ``max_ahead_s`` ahead of it)."""
        meta = self.writer.meta
        while self._pending:
            record = self._pending[0]
            frames = len(record.data) // meta.frame_bytes
            room = int((self.max_s - self.writer.duration_s) * meta.sample_rate)
            if self.clock.would_overrun(frames, now):
                return  # the sender is ahead: wait for the clock (the relay stays unread meanwhile)
            data = record.data[: max(0, room) * meta.frame_bytes]
            self._pending.popleft()
            if data:
                # stamped with its arrival at the API: the per-chunk delay counts the relay too
                self.audio_frames += self.clock.feed(data, now, t=record.t)
            if len(data) < len(record.data):
                self._pending.clear()  # past max_s: the rest of the session's audio is not rendered
                self.writer.close("max_duration")
                return


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
