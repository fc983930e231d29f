"""The audio WebSocket of a live session (issue 13): ``/v1/jobs/{id}/audio``.

Who calls what: the router is included by :func:`worker.api.app.create_app`; a client (``longtake
live``, a browser, a script) creates a job whose spec has ``session`` (``POST /v1/jobs``), then
connects here and streams PCM. The message format, close codes and limits are in docs/sessions.md;
in short:

- authentication: ``Authorization: Bearer <token>``, or (browsers cannot set headers on a
  WebSocket) the subprotocol ``bearer.<token>`` next to ``longtake.audio.v1``; never the query
  string (proxies log it). Another tenant's job is answered exactly like a missing one;
- one sender per session, ever (:meth:`worker.jobs.store.JobStore.open_audio`): sessions are not
  resumable;
- server -> client JSON: ``open`` (the format the session expects), ``ready`` (a worker runs the
  session: audio sent now is rendered on the live clock), ``ack`` (about once a second: seconds
  received, seconds ahead of real time), ``ended`` (the job ended: its status and end reason) and
  ``error`` (``error``, ``field``, ``message`` naming the fix) right before the close;
- client -> server: binary messages of whole s16le frames (at most
  ``Settings.session_message_max_bytes``), and the text message ``{"type": "end"}``.

Back-pressure: :class:`SenderPace` follows the session's live clock from the sender's side; while
the sender is more than ``session_max_ahead_s`` ahead of real time the socket is not read, so TCP
flow control slows the sender down (nothing is refused). Accepted audio goes to the session's relay
(:class:`worker.jobs.session_relay.SessionRelay`) with its arrival time; the relay's end record says
how the sender ended: ``closed`` (its ``end``, or a normal close 1000), ``disconnected`` (any other
close, a dropped connection) or ``error`` (bad input: the job fails with that message).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketState

from worker.api.auth import AuthError
from worker.api.deps import API_PREFIX, JOB_ID_RE, Deps
from worker.api.gate import TokenBucket
from worker.client import TERMINAL_STATUSES
from worker.jobs.records import JobRecord
from worker.jobs.session_relay import SessionRelay

logger = logging.getLogger(__name__)

router = APIRouter()

T = TypeVar("T")

SUBPROTOCOL = "longtake.audio.v1"
BEARER_SUBPROTOCOL = "bearer."
CLOSE_NORMAL = 1000
CLOSE_BAD_DATA = 1007
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_SERVER_ERROR = 1011
CLOSE_TRY_LATER = 1013
STATUS_POLL_S = 0.5
ACK_EVERY_S = 1.0
END_GRACE_S = 30.0  # after the sender's `end`, how long the socket waits for its close


class SenderPace:
    """The session's live clock as the API sees it from the sender's side (the worker's
    :class:`pipeline.live.LiveClock` runs the same arithmetic over the live directory): the clock
    starts with the first audio; when the sender is late by more than ``max_lag_s`` the timeline
    is padded with (the worker's) silence; :meth:`ahead_s` is how far the timeline runs ahead of
    real time."""

    def __init__(self, *, max_lag_s: float) -> None:
        self.max_lag_s = max_lag_s
        self.started_at: float | None = None
        self.timeline_s = 0.0
        self.received_s = 0.0

    def add(self, seconds: float, now: float) -> None:
        if self.started_at is None:
            self.started_at = now
        self.timeline_s = max(self.timeline_s, now - self.started_at - self.max_lag_s) + seconds
        self.received_s += seconds

    def ahead_s(self, now: float) -> float:
        return 0.0 if self.started_at is None else self.timeline_s - (now - self.started_at)


class _Refused(Exception):
    """Ends the connection: an ``error`` message, then the close ``close_code``."""

    def __init__(self, close_code: int, error: str, field: str, message: str, *, relay_end: bool = True) -> None:
        super().__init__(message)
        self.close_code, self.error, self.field, self.message = close_code, error, field, message
        self.relay_end = relay_end  # tell the worker the stream broke (once the relay is open)


@router.websocket(f"{API_PREFIX}/jobs/{{job_id}}/audio", name="job_audio")
async def job_audio(websocket: WebSocket, job_id: str) -> None:
    deps = cast(Deps, websocket.app.state.deps)
    offered = [str(p) for p in websocket.scope.get("subprotocols", [])]
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-relay") as pool:
        await _Connection(deps, websocket, job_id, offered, pool).serve()


class _Connection:
    """One sender's connection (see the module doc)."""

    def __init__(
        self, deps: Deps, ws: WebSocket, job_id: str, offered: list[str], pool: ThreadPoolExecutor
    ) -> None:
        self.deps, self.ws, self.job_id, self.offered, self.pool = deps, ws, job_id, offered, pool
        self.relay: SessionRelay | None = None
        self.relay_ended = False
        self.rec: JobRecord | None = None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Blocking work (database, broker) on this connection's one thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _send(self, message: dict[str, object]) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:
            try:
                await self.ws.send_text(json.dumps(message))
            except Exception as exc:  # the client went away: its disconnect is read next
                logger.info("session %s: send failed: %s", self.job_id, exc)

    async def _close(self, code: int) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:
            try:
                await self.ws.close(code)
            except Exception as exc:
                logger.info("session %s: close failed: %s", self.job_id, exc)

    async def _end_relay(self, reason: str, message: str | None = None) -> None:
        if self.relay is not None and not self.relay_ended:
            self.relay_ended = True
            await self._call(self.relay.send_end, reason, message)

    async def serve(self) -> None:
        try:
            await self._serve()
        except _Refused as exc:
            logger.info("session %s: refused (%s, close %d): %s", self.job_id, exc.error, exc.close_code, exc.message)
            if exc.relay_end:
                await self._end_relay("error", exc.message)
            await self._send({"type": "error", "error": exc.error, "field": exc.field, "message": exc.message})
            await self._close(exc.close_code)
        except Exception:
            logger.exception("session %s: the audio stream broke in the API", self.job_id)
            message = "the API could not relay the audio (see its log); the session ends, start a new one"
            try:
                await self._end_relay("error", message)
            except Exception:
                logger.exception("session %s: could not end the relay", self.job_id)
            await self._send({"type": "error", "error": "server_error", "field": "(server)", "message": message})
            await self._close(CLOSE_SERVER_ERROR)
        finally:
            if self.relay is not None:
                relay = self.relay
                rec = await self._call(self.deps.store.get, self.job_id)
                if rec is None or rec.status in TERMINAL_STATUSES:
                    await self._call(relay.delete)  # nobody reads it any more
                await self._call(relay.close)

    # ------------------------------------------------------------------ before the audio
    def _tenant(self) -> str:
        auth = self.ws.headers.get("authorization")
        if auth is None:
            tokens = [p[len(BEARER_SUBPROTOCOL) :] for p in self.offered if p.startswith(BEARER_SUBPROTOCOL)]
            auth = f"Bearer {tokens[0]}" if tokens else None
        try:
            tenant = self.deps.auth.tenant_for(auth)
        except AuthError as exc:
            raise _Refused(
                CLOSE_POLICY, "unauthorized", "Authorization",
                f"{exc.message} (a browser, which cannot set headers on a WebSocket, offers the "
                f"subprotocols '{SUBPROTOCOL}' and 'bearer.<token>')",
                relay_end=False,
            ) from exc
        # a connection costs one token of the caller's bucket, like any request (worker/api/gate.py)
        wait = cast(TokenBucket, self.ws.app.state.rate_bucket).take(str(auth).split()[-1])
        if wait > 0:
            s = self.deps.settings
            raise _Refused(
                CLOSE_TRY_LATER, "rate_limited", "Authorization",
                f"Authorization: over {s.api_rate_per_s:g} requests/s (burst {s.api_rate_burst}) for your "
                f"token on this API process; connect again after {max(1, math.ceil(wait))} s",
                relay_end=False,
            )
        return tenant

    async def _open(self) -> JobRecord:
        tenant = self._tenant()
        not_found = _Refused(
            CLOSE_POLICY, "not_found", "job_id",
            f"job {self.job_id[:64]!r} not found for your tenant; connect to the id POST /v1/jobs returned",
            relay_end=False,
        )
        if not JOB_ID_RE.match(self.job_id):
            raise not_found
        rec = await self._call(self.deps.store.get, self.job_id)
        if rec is None or rec.tenant != tenant:
            raise not_found  # another tenant's job is answered as a missing one
        if rec.spec.session is None:
            raise _Refused(
                CLOSE_POLICY, "not_a_session", "session",
                f"job {rec.id} was submitted with an audio file, not as a live session; create a job "
                'with "session": {"sample_rate": ...} (and no audio) to stream its audio here',
                relay_end=False,
            )
        if rec.status in TERMINAL_STATUSES:
            raise _Refused(CLOSE_POLICY, "session_ended", "job_id",
                           f"session {rec.id} has ended ({rec.status}); start a new session", relay_end=False)
        if not await self._call(lambda: self.deps.store.open_audio(rec.id, tenant=tenant)):
            raise _Refused(
                CLOSE_POLICY, "sender_exists", "job_id",
                f"session {rec.id} already had its audio stream opened (one sender per session; a "
                "session is not resumable after a disconnect); start a new session",
                relay_end=False,
            )
        return rec

    async def _wait_ready(self, rec: JobRecord) -> JobRecord:
        """Until a worker runs the session's render (the worker's report says ``ready``); the audio
        is only read from then on, so the live clock starts when the render can follow it."""
        deadline = time.monotonic() + self.deps.settings.session_ready_timeout_s
        job_id, tenant = rec.id, rec.tenant
        while rec.status == "queued" or (rec.status == "running" and not (rec.session_state or {}).get("ready")):
            if time.monotonic() > deadline:
                await self._call(lambda: self.deps.store.request_cancel(job_id, tenant=tenant))
                raise _Refused(
                    CLOSE_TRY_LATER, "no_worker", "job_id",
                    f"no worker picked session {rec.id} up within session_ready_timeout_s="
                    f"{self.deps.settings.session_ready_timeout_s:g} s; the session was cancelled, try "
                    "again later (or ask the operator to add workers)",
                    relay_end=False,
                )
            await asyncio.sleep(0.2)
            got = await self._call(self.deps.store.get, rec.id)
            assert got is not None
            rec = got
        if rec.status != "running":
            raise _Refused(CLOSE_POLICY, "session_ended", "job_id",
                           f"session {rec.id} ended ({rec.status}: {rec.error_message}) before it started",
                           relay_end=False)
        return rec

    # ------------------------------------------------------------------ the audio
    async def _serve(self) -> None:
        s = self.deps.settings
        rec = await self._open()
        session = rec.spec.session
        assert session is not None
        frame_bytes = 2 * session.channels
        await self._send({
            "type": "open", "job_id": rec.id, "sample_rate": session.sample_rate, "channels": session.channels,
            "format": session.format, "frame_bytes": frame_bytes, "max_message_bytes": s.session_message_max_bytes,
            "max_ahead_s": s.session_max_ahead_s, "idle_timeout_s": session.idle_timeout_s,
        })
        self.relay = await self._call(
            lambda: SessionRelay(s.broker_url, s.queue_name, rec.id, socket_timeout_s=s.broker_socket_timeout_s)
        )
        rec = await self._wait_ready(rec)
        await self._send({"type": "ready", "job_id": rec.id})

        pace = SenderPace(max_lag_s=s.session_max_lag_s)
        rate = session.sample_rate
        ended_at: float | None = None  # the sender's `end`
        next_check = time.monotonic() + STATUS_POLL_S
        last_ack = 0.0
        first = True
        receiving: asyncio.Task[Any] | None = None
        while True:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + STATUS_POLL_S
                got = await self._call(self.deps.store.get, rec.id)
                if got is None or got.status in TERMINAL_STATUSES:
                    if receiving is not None:
                        receiving.cancel()
                    state = (got.session_state or {}) if got is not None else {}
                    await self._send({"type": "ended", "status": got.status if got else "gone",
                                      "end_reason": state.get("end_reason"),
                                      "received_s": round(pace.received_s, 3)})
                    await self._close(CLOSE_NORMAL)
                    return
            if ended_at is not None and now - ended_at > END_GRACE_S:
                await self._close(CLOSE_NORMAL)
                return
            if receiving is None:
                if ended_at is None and pace.ahead_s(now) > s.session_max_ahead_s:
                    # back-pressure: leave the socket unread until the clock catches up
                    await asyncio.sleep(min(0.1, pace.ahead_s(now) - s.session_max_ahead_s))
                    continue
                receiving = asyncio.ensure_future(self.ws.receive())
            done, _ = await asyncio.wait({receiving}, timeout=0.1)
            if not done:
                continue
            message = receiving.result()
            receiving = None
            if message["type"] == "websocket.disconnect":
                if ended_at is None:
                    code = int(message.get("code") or 1005)
                    await self._end_relay("closed" if code == CLOSE_NORMAL else "disconnected")
                    logger.info("session %s: sender gone (close %d) after %.1f s of audio",
                                rec.id, code, pace.received_s)
                return
            data: bytes | None = message.get("bytes")
            text: str | None = message.get("text")
            size = len(data) if data is not None else len((text or "").encode())
            if size > s.session_message_max_bytes:
                raise _Refused(
                    CLOSE_TOO_BIG, "message_too_large", "(message)",
                    f"(message): {size} bytes is over the limit of {s.session_message_max_bytes} "
                    "(LONGTAKE_SESSION_MESSAGE_MAX_BYTES); send the audio in smaller messages (20-100 ms each)",
                )
            if data is not None:
                if ended_at is not None:
                    raise _Refused(CLOSE_POLICY, "audio_after_end", "(message)",
                                   "(message): audio after the `end` message; the session's audio has "
                                   "ended, start a new session to send more", relay_end=False)
                if first and data[:4] in (b"RIFF", b"RIFX", b"OggS", b"fLaC", b"ID3\x03", b"ID3\x04"):
                    raise _Refused(
                        CLOSE_BAD_DATA, "not_pcm", "(message)",
                        "(message): the audio starts with a file header (WAV/Ogg/FLAC/MP3), not raw "
                        f"PCM; send the samples only, as {session.format} at {rate} Hz, {session.channels} "
                        "channel(s) (e.g. `ffmpeg -i in.wav -f s16le -ar RATE -ac CH -`)",
                    )
                if len(data) % frame_bytes:
                    raise _Refused(
                        CLOSE_BAD_DATA, "partial_frame", "(message)",
                        f"(message): {len(data)} bytes is not a whole number of {frame_bytes}-byte frames "
                        f"({session.channels} channel(s) of 16-bit PCM); send whole frames in every message",
                    )
                first = False
                if data:
                    pace.add(len(data) / frame_bytes / rate, now)
                    await self._call(_send_audio, self.relay, data, time.time())
                if now - last_ack >= ACK_EVERY_S:
                    last_ack = now
                    await self._send({"type": "ack", "received_s": round(pace.received_s, 3),
                                      "ahead_s": round(pace.ahead_s(now), 3)})
                continue
            control = _control(text or "")
            if control == "end":
                if ended_at is not None:
                    continue  # a repeated end changes nothing
                ended_at = now
                await self._end_relay("closed")
                await self._send({"type": "ack", "received_s": round(pace.received_s, 3), "final": True})
                continue
            raise _Refused(
                CLOSE_POLICY, "unknown_message", "type",
                f"type: {control!r} is not a message this stream takes; send binary PCM frames and, at the "
                'end, the text message {"type": "end"}',
            )


def _send_audio(relay: SessionRelay, data: bytes, arrived: float) -> None:
    relay.send_audio(data, t=arrived)


def _control(text: str) -> str:
    """The ``type`` of a text (control) message; refuses anything that is not such a JSON object."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise _Refused(
            CLOSE_BAD_DATA, "invalid_json", "(message)",
            f'(message): a text message must be JSON such as {{"type": "end"}} ({str(exc)[:80]}); send '
            "audio as binary messages",
        ) from exc
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise _Refused(CLOSE_BAD_DATA, "invalid_message", "type",
                       'type: a control message is a JSON object with a "type", e.g. {"type": "end"}')
    return str(data["type"])
