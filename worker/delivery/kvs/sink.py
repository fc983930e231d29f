"""Live preview to Amazon Kinesis Video Streams, as a FrameSink that never fails the render.

Who calls what: the worker adds a :class:`KVSPreviewSink` next to the S3 sink when a job asks for a
KVS preview. On the render thread, ``write`` remuxes the fragment into one MKV cluster (video
keyframe first) and hands it to the sender thread through a queue of ``max_queued`` clusters; when
the queue is full for longer than one fragment's duration the cluster is dropped (counted in
``num_dropped``) — a live preview must not slow the render. The sender thread keeps one PutMedia
session open, sends clusters as HTTP chunks and tracks their ACKs:

- PERSISTED: the fragment is done (``acked`` lists fragment indices in ack order);
- ERROR with a retriable id (or the connection dropping): a new session is opened and every
  fragment not yet PERSISTED is sent again, at most ``max_retries`` times per fragment;
- ERROR with a fatal id, or retries exhausted: the preview stops (``status == "stopped"``,
  ``error`` says why) and later writes are ignored.

Nothing here raises into the render: ``open``/``write``/``close`` log and record problems instead.
The sink keeps only clusters that are queued or sent-but-unacknowledged (at most ``max_unacked``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from pipeline.media_types import Fragment, InitSegment
from worker.delivery.kvs.mkv import Cluster, MkvStreamWriter
from worker.delivery.kvs.putmedia import AckEvent, PutMediaClient, PutMediaConnection, PutMediaError

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True)
class _Queued:
    index: int
    cluster: Cluster


class KVSPreviewSink:
    """FrameSink publishing fragments to a KVS stream over our PutMedia client (see module doc)."""

    def __init__(
        self,
        client: PutMediaClient,
        *,
        max_retries: int = 3,
        max_queued: int = 2,
        max_unacked: int = 32,
        ack_timeout_s: float = 30.0,
        producer_start_s: float | None = None,
    ) -> None:
        self.client = client
        self.max_retries = max_retries
        self.max_unacked = max_unacked
        self.ack_timeout_s = ack_timeout_s
        self.producer_start_s = producer_start_s if producer_start_s is not None else time.time()
        self.status = "idle"  # idle | streaming | done | stopped
        self.error: str | None = None
        self.acked: list[int] = []
        self.events: list[AckEvent] = []
        self.num_dropped = 0
        self.num_sessions = 0
        self.bytes_sent = 0
        self._mkv: MkvStreamWriter | None = None
        self._in: queue.Queue[object] = queue.Queue(maxsize=max(1, max_queued))
        self._acks: queue.Queue[tuple[int, AckEvent]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._session = -1  # ACKs of older sessions are ignored

    # ------------------------------------------------------------------ FrameSink (render thread)
    def open(self, init: InitSegment) -> None:
        try:
            self._mkv = MkvStreamWriter(init.data)
        except ValueError as exc:
            self._stop(f"cannot remux the init segment for KVS: {exc}")
            return
        self.status = "streaming"
        self._thread = threading.Thread(target=self._run, name="kvs-preview", daemon=True)
        self._thread.start()

    def write(self, fragment: Fragment) -> None:
        if self._stopped.is_set() or self._mkv is None:
            return
        try:
            cluster = self._mkv.cluster(fragment.data)
        except ValueError as exc:
            self._stop(f"fragment {fragment.index} cannot be remuxed for KVS: {exc}")
            return
        try:
            self._in.put(_Queued(fragment.index, cluster), timeout=max(0.05, fragment.duration_s))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KVS preview is behind; dropped fragment %d", fragment.index)

    def close(self, *, ok: bool) -> None:
        if self._thread is None:
            return
        deadline = time.monotonic() + self.ack_timeout_s + 5
        while not self._stopped.is_set() and time.monotonic() < deadline:
            try:
                self._in.put(_STOP, timeout=0.2)
                break
            except queue.Full:
                continue
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._stop("KVS preview did not finish in time")

    # ------------------------------------------------------------------ sender thread
    def _stop(self, reason: str) -> None:
        if not self._stopped.is_set():
            logger.warning("KVS live preview stopped: %s (the render continues)", reason)
            self.error = reason
            self.status = "stopped"
            self._stopped.set()

    def _connect(self, unacked: OrderedDict[int, _Queued], *, end_body: bool) -> PutMediaConnection:
        assert self._mkv is not None
        session = self.num_sessions
        self.num_sessions += 1
        self._session = session
        conn = self.client.connect(producer_start_s=self.producer_start_s,
                                   on_ack=lambda ev: self._acks.put((session, ev)))
        try:
            conn.send(self._mkv.header())
            for item in unacked.values():  # resend everything not yet persisted, in order
                conn.send(item.cluster.data)
            if end_body:
                conn.end_body()
        except PutMediaError:
            # the service ended this session while we were still resending (an ERROR ack on an early
            # fragment): the reader reports why, and the loop counts the attempt and reconnects
            pass
        return conn

    def _close_conn(self, conn: PutMediaConnection | None) -> None:
        if conn is not None:
            conn.abort()
            self.bytes_sent += conn.bytes_sent

    def _run(self) -> None:
        unacked: OrderedDict[int, _Queued] = OrderedDict()
        by_timecode: dict[int, int] = {}
        attempts: dict[int, int] = {}
        conn: PutMediaConnection | None = None
        finishing = False
        finish_deadline = 0.0
        try:
            while not self._stopped.is_set():
                reconnect = self._drain_acks(unacked, by_timecode)
                if self._stopped.is_set():
                    break
                if finishing and not unacked:
                    self.status = "done"
                    break
                if reconnect is not None:
                    self._close_conn(conn)
                    conn = None
                    for idx in unacked:
                        attempts[idx] = attempts.get(idx, 0) + 1
                        if attempts[idx] > self.max_retries:
                            self._stop(f"fragment {idx} failed {self.max_retries + 1} times: {reconnect}")
                    if self._stopped.is_set():
                        break
                if conn is None and (unacked or not finishing):
                    conn = self._connect(unacked, end_body=finishing)
                if finishing:
                    if time.monotonic() > finish_deadline:
                        self._stop(f"{len(unacked)} fragments not acknowledged within {self.ack_timeout_s:g} s")
                        break
                    time.sleep(0.02)
                    continue
                try:
                    item = self._in.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is _STOP:
                    finishing = True
                    finish_deadline = time.monotonic() + self.ack_timeout_s
                    if conn is not None:
                        try:
                            conn.end_body()
                        except PutMediaError:
                            pass  # the reader reports CLOSED; the loop reconnects and resends
                    continue
                assert isinstance(item, _Queued)
                unacked[item.index] = item
                by_timecode[item.cluster.timecode_ms] = item.index
                if len(unacked) > self.max_unacked:
                    dropped, _ = unacked.popitem(last=False)
                    logger.warning("KVS preview: fragment %d never acknowledged; giving up on it", dropped)
                if conn is not None:
                    try:
                        conn.send(item.cluster.data)
                    except PutMediaError:
                        pass  # the reader reports CLOSED; the loop reconnects and resends
        except PutMediaError as exc:
            self._stop(f"KVS unreachable: {exc}" if exc.retryable else str(exc))
        except Exception as exc:  # the preview must never take the render down; record why it stopped
            logger.exception("KVS preview failed")
            self._stop(f"{type(exc).__name__}: {exc}")
        finally:
            if conn is not None and self.status == "done":
                conn.wait_closed(5.0)
            self._close_conn(conn)

    def _fragment_of(self, ev: AckEvent, unacked: OrderedDict[int, _Queued], by_timecode: dict[int, int]) -> int | None:
        """Which fragment an ACK is about: by the cluster timecode we sent (RELATIVE) or that plus the
        producer start (if the service reports absolute times); else the oldest unacknowledged one,
        since KVS acknowledges fragments in order."""
        tc = ev.fragment_timecode
        if tc is None:
            return None
        for cand in (tc, tc - round(self.producer_start_s * 1000)):
            if cand in by_timecode:
                return by_timecode[cand]
        return next(iter(unacked), None)

    def _drain_acks(self, unacked: OrderedDict[int, _Queued], by_timecode: dict[int, int]) -> str | None:
        """Apply the ACKs received so far; returns why a reconnect is needed (or None)."""
        reconnect: str | None = None
        while True:
            try:
                session, ev = self._acks.get_nowait()
            except queue.Empty:
                return reconnect
            if session != self._session:
                continue  # late news from a session we already replaced
            self.events.append(ev)
            idx = self._fragment_of(ev, unacked, by_timecode)
            if ev.event_type == "PERSISTED" and idx is not None and idx in unacked:
                del unacked[idx]
                self.acked.append(idx)
            elif ev.event_type == "ERROR":
                what = f"KVS error {ev.error_id} {ev.error_code} on fragment {idx}"
                if not ev.retriable:
                    self._stop(what)
                    return None
                logger.warning("%s; reconnecting", what)
                reconnect = what
            elif ev.event_type == "CLOSED":
                if ev.error_code is not None and ev.error_code.startswith("4") and ev.error_code != "429":
                    self._stop(ev.detail or "PutMedia rejected")
                    return None
                if unacked:
                    reconnect = reconnect or (ev.detail or "PutMedia session ended")
