"""The relay of a live session's audio from the API to the worker that renders it (issue 13).

Who calls what: the API's WebSocket route (:mod:`worker.api.sessions`) opens a :class:`SessionRelay`
per connection and calls :meth:`SessionRelay.send_audio` for each PCM message it accepts, then
:meth:`SessionRelay.send_end` once (``closed``, ``disconnected`` or ``error``); the worker's
:class:`worker.jobs.session.SessionFeeder` opens the same relay and calls
:meth:`SessionRelay.receive` in its loop, and :meth:`SessionRelay.delete` when the session ends.

Transport: one queue per session on the Celery broker (kombu ``SimpleQueue`` named
``<queue_name>.session.<job_id>``), so the relay works wherever the render queue does: Redis in
production (a list: LPUSH/BRPOP), the SQLite-backed broker of ``longtake up``, and kombu's
in-memory transport in a single process. A session needs no other server.

Bounded: the relay holds what the API accepted and the worker has not fed yet. The API stops
reading the WebSocket once the sender is ``session_max_ahead_s`` ahead of real time (its own
:class:`worker.api.sessions.SenderPace`), so what waits here is at most that, plus the audio that
arrived while the worker was starting the render.

Records carry their arrival time at the API (``t``, unix seconds): the per-chunk delay is counted
from there, so API and worker hosts must share a clock (NTP), as leases already require.

Not thread-safe: one relay per thread (kombu connections are not shared across threads).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import kombu

log = logging.getLogger(__name__)

# kombu ships no type information: its objects are Any here, as Celery's are elsewhere
_Connection: Any = kombu.Connection

RelayEnd = Literal["closed", "disconnected", "error"]
RELAY_ENDS: tuple[RelayEnd, ...] = ("closed", "disconnected", "error")

# how often a non-Redis broker (SQLite for `longtake up`) is polled for new audio: the relay's share
# of the session's latency on such a broker
_POLL_S = 0.02


@dataclass(frozen=True)
class RelayRecord:
    """One record of the relay: PCM (``kind="audio"``, ``data``) or the sender's end (``kind="end"``,
    ``reason``, ``message`` for an ``error``). ``t``: when the API received it (unix seconds)."""

    kind: Literal["audio", "end"]
    t: float
    data: bytes = b""
    reason: RelayEnd | None = None
    message: str | None = None


def relay_queue_name(queue_name: str, job_id: str) -> str:
    return f"{queue_name}.session.{job_id}"


class SessionRelay:
    """One end of a session's relay (see the module doc). A context manager; ``close`` releases
    the broker connection, ``delete`` also removes the queue and what is left in it."""

    def __init__(self, broker_url: str, queue_name: str, job_id: str, *, socket_timeout_s: float = 10.0) -> None:
        options: dict[str, Any] = {}
        if broker_url.startswith(("redis://", "rediss://")):
            options = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s}
        self.name = relay_queue_name(queue_name, job_id)
        self._conn: Any = _Connection(broker_url, transport_options=options)
        # kombu's polling transports (the SQLite broker) sleep this long when a queue is empty
        self._conn.transport.polling_interval = _POLL_S
        self._queue: Any = self._conn.SimpleQueue(self.name, no_ack=True, queue_opts={"durable": False},
                                             exchange_opts={"durable": False})

    def __enter__(self) -> SessionRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_audio(self, pcm: bytes, *, t: float | None = None) -> None:
        self._queue.put(bytes(pcm), headers={"kind": "audio", "t": time.time() if t is None else t},
                        content_type="application/octet-stream", content_encoding="binary")

    def send_end(self, reason: RelayEnd, message: str | None = None) -> None:
        if reason not in RELAY_ENDS:
            raise ValueError(f"reason={reason!r}: one of {RELAY_ENDS}")
        self._queue.put(b"", headers={"kind": "end", "t": time.time(), "reason": reason, "message": message or ""},
                        content_type="application/octet-stream", content_encoding="binary")

    def receive(self, timeout_s: float) -> RelayRecord | None:
        """The next record, or None when none arrives within ``timeout_s``."""
        try:
            msg = self._queue.get(block=True, timeout=timeout_s)
        except self._queue.Empty:
            return None
        headers = msg.headers or {}
        kind = headers.get("kind")
        t = float(headers.get("t") or time.time())
        if kind == "end":
            reason: RelayEnd = "error"
            for known in RELAY_ENDS:
                if headers.get("reason") == known:
                    reason = known
            if headers.get("reason") != reason:
                log.error("relay %s: end record with reason %r; treated as an error", self.name, headers.get("reason"))
            return RelayRecord(kind="end", t=t, reason=reason, message=headers.get("message") or None)
        if kind != "audio":
            log.error("relay %s: record of unknown kind %r dropped", self.name, kind)
            return None
        body = msg.body
        return RelayRecord(kind="audio", t=t, data=body if isinstance(body, bytes) else bytes(body))

    def delete(self) -> None:
        """Remove the queue (what the worker will never read: a session that ended)."""
        try:
            self._queue.clear()
            self._queue.queue.delete()
        except Exception as exc:  # a broker outage leaves a small queue behind, not a broken session
            log.warning("relay %s: could not delete its queue: %s", self.name, exc)

    def close(self) -> None:
        try:
            self._queue.close()
        finally:
            self._conn.release()
