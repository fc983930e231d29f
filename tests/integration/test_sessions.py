"""Live sessions (issue 13) end to end: the API under uvicorn on loopback, real PostgreSQL, Redis
(the Celery broker and the sessions' audio relay) and two Celery worker processes running the fake
renderer in live mode (tests/integration/fake_pipeline.py, real fMP4 fragments), into the
production delivery (segments, HLS playlist, final MP4 in a local object store).

The clients are real WebSocket clients (``websockets``) sending s16le PCM at real-time pace.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from jobs_harness import (
    REDIS_URL,
    ROOT,
    CeleryWorker,
    JobsEnv,
    drop_queue,
    free_port,
    make_env,
    settings_from_env,
)
from sqlalchemy import text
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from worker.api.app import create_app
from worker.delivery.keys import job_prefix, safe_key
from worker.delivery.s3_sink import PLAYLIST_NAME
from worker.jobs.db import make_engine
from worker.jobs.store import JobStore
from worker.settings import Settings

pytestmark = pytest.mark.integration

TOKEN_A = "session-token-a-0123456789"
TOKEN_B = "session-token-b-0123456789"
RATE = 16000
FRAME = 2  # mono s16le
FPS = 25
IDLE_S = 3.0


@dataclass
class Stack:
    url: str
    settings: Settings
    store: JobStore
    tmp: Path
    workers: list[CeleryWorker]
    metrics_ports: list[int]

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://")

    def create(self, token: str = TOKEN_A, **session: object) -> str:
        body = {"image": f"file://{self.tmp}/in/face.png",
                "session": {"sample_rate": RATE, "idle_timeout_s": IDLE_S, **session}}
        resp = httpx.post(f"{self.url}/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}"})
        assert resp.status_code == 201, resp.text
        return str(resp.json()["id"])

    def connect(self, job_id: str, token: str = TOKEN_A) -> ClientConnection:
        # entered by hand: the tests close it (or drop it) themselves, mid-function
        return connect(f"{self.ws_url}/v1/jobs/{job_id}/audio",
                       additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=10).__enter__()

    def job(self, job_id: str, token: str = TOKEN_A) -> dict[str, object]:
        resp = httpx.get(f"{self.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def wait(self, job_id: str, timeout: float = 30.0, token: str = TOKEN_A) -> dict[str, object]:
        """The job once it has ended, as its owner (``token``) reads it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id, token=token)
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return job
            time.sleep(0.1)
        logs = "\n".join(w.log_path.read_text()[-3000:] for w in self.workers)
        raise TimeoutError(f"job {job_id} still {self.job(job_id, token=token)['status']} after {timeout} s\n{logs}")

    def segments(self, job_id: str) -> list[tuple[int, int, int, float]]:
        """(index, first_frame, num_frames, duration_s) of the committed segments."""
        return [(s.index, s.first_frame, s.num_frames, s.duration_s) for s in self.store.segments(job_id)]

    def playlist(self, job_id: str, tenant: str = "tenant-a") -> str | None:
        path = self.tmp / "objects" / safe_key(job_prefix(tenant, job_id), PLAYLIST_NAME)
        return path.read_text() if path.exists() else None


@pytest.fixture(scope="module")
def stack(pg_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The API and two workers running the fake renderer (warmed by two plain jobs)."""
    yield from _stack(pg_template, tmp_path_factory.mktemp("sessions"), app="app", names=("w1", "w2"))


def _stack(pg_template: str, tmp: Path, *, app: str, names: tuple[str, ...]) -> Iterator[Stack]:
    from jobs_harness import PG_HOST, admin_engine

    name = f"sessions_{uuid.uuid4().hex[:10]}"
    admin = admin_engine()
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"'))
    db = f"{PG_HOST}/{name}"
    metrics_ports = {n: free_port() for n in names}
    env = make_env(tmp, db, REDIS_URL, session_max_ahead_s="2", session_max_lag_s="0.3",
                   session_message_max_bytes="65536", session_idle_max_s="30")
    from PIL import Image

    Image.new("RGB", (64, 64), (200, 120, 90)).save(tmp / "in" / "face.png")
    env["LONGTAKE_FAKE_LIVE_MEDIA"] = "1"
    settings = settings_from_env(env).model_copy(update={"api_tokens": {TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"}})
    workers = [CeleryWorker(n, {**env, "LONGTAKE_METRICS_PORT": str(port)}, tmp / f"{n}.log", app=app)
               for n, port in metrics_ports.items()]
    for w in workers:
        w.start()
    engine = make_engine(db)
    if app == "app":
        # warm both workers (their ranks start once, ~15 s on a loaded 2-core machine): two plain jobs
        warm = JobsEnv(tmp=tmp, settings=settings, env=env, store=JobStore(engine))
        warm.wait([warm.submit(seed=k, num_fragments=2, sleep_s=1.0) for k in (1, 2)], timeout=120)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings, engine=engine), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield Stack(f"http://127.0.0.1:{port}", settings, JobStore(engine), tmp, workers, list(metrics_ports.values()))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        for w in workers:
            w.stop()
        engine.dispose()
        drop_queue(REDIS_URL, settings.queue_name)
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def tone(seconds: float) -> bytes:
    import math

    n = int(seconds * RATE)
    return b"".join(int(8000 * math.sin(i / 8)).to_bytes(2, "little", signed=True) for i in range(n))


def expect(ws: ClientConnection, kind: str, timeout: float = 60.0) -> dict[str, object]:
    """The next server message of type ``kind`` (acks in between are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        if msg["type"] == kind:
            return dict(msg)
        assert msg["type"] == "ack", msg


def end_session(ws: ClientConnection) -> dict[str, object]:
    """Send `end`; the server's final ack (seconds received); close."""
    ws.send(json.dumps({"type": "end"}))
    while True:
        ack = expect(ws, "ack")
        if ack.get("final"):
            ws.close()
            return ack


def feed(ws: ClientConnection, seconds: float, *, step_s: float = 0.1) -> None:
    """``seconds`` of tone at real-time pace, in ``step_s`` messages."""
    pcm = tone(step_s)
    start = time.monotonic()
    for k in range(round(seconds / step_s)):
        ws.send(pcm)
        time.sleep(max(0.0, start + (k + 1) * step_s - time.monotonic()))


def open_session(stack: Stack, **session: object) -> tuple[str, ClientConnection]:
    job_id = stack.create(**session)
    ws = stack.connect(job_id)
    opened = expect(ws, "open")
    assert opened["sample_rate"] == RATE and opened["frame_bytes"] == FRAME
    expect(ws, "ready")
    return job_id, ws


def close_reason(ws: ClientConnection) -> tuple[dict[str, object], int | None]:
    """The error message the server sent, and its close code."""
    error: dict[str, object] = {}
    try:
        while True:
            msg = json.loads(ws.recv(timeout=10))
            if msg["type"] == "error":
                error = msg
    except ConnectionClosed as exc:
        return error, exc.rcvd.code if exc.rcvd is not None else None


def check_timeline(stack: Stack, job_id: str, duration_s: float) -> None:
    """Segments continuous from frame 0, covering the session's timeline within one frame."""
    segs = stack.segments(job_id)
    assert [s[0] for s in segs] == list(range(len(segs)))
    frame = 0
    for _, first, num, _ in segs:
        assert first == frame, segs
        frame += num
    assert abs(frame / FPS - duration_s) <= 1 / FPS + 1e-6, (frame, duration_s)


def test_session_happy_path_playlist_grows_and_final_mp4(stack: Stack) -> None:
    """Real-time feed: the playlist grows (no ENDLIST) while the session runs; `end` closes it; the
    job succeeds with the fed duration, end_reason closed, chunk delays in progress and Prometheus."""
    job_id, ws = open_session(stack)
    feed(ws, 1.6)
    mid = stack.playlist(job_id)
    assert mid is not None and "#EXT-X-ENDLIST" not in mid and mid.count(".m4s") >= 1, mid
    running = stack.job(job_id)
    assert running["status"] == "running" and running["progress"]["chunk_delay_s"] is not None  # type: ignore[index]
    feed(ws, 1.6)
    assert (stack.playlist(job_id) or "").count(".m4s") > mid.count(".m4s")
    assert end_session(ws)["received_s"] == 3.2
    job = stack.wait(job_id)
    session = job["session"]
    assert job["status"] == "succeeded", job
    assert session["end_reason"] == "closed" and session["audio_s"] == 3.2, session  # type: ignore[index]
    assert session["silence_s"] < 0.2, session  # type: ignore[index]
    check_timeline(stack, job_id, float(session["duration_s"]))  # type: ignore[index]
    assert 0 <= float(session["chunk_delay_max_s"]) < 2.0, session  # type: ignore[index]
    assert "#EXT-X-ENDLIST" in (stack.playlist(job_id) or "")
    final = Path(str(job["outputs"]["mp4"]).removeprefix("file://"))  # type: ignore[index]
    assert final.stat().st_size > 0
    counts = [float(ln.split()[-1]) for port in stack.metrics_ports
              for ln in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
              if ln.startswith("longtake_live_chunk_delay_seconds_count")]
    assert len(counts) == 2 and sum(counts) >= 8, counts  # one per published chunk
    with stack.store.engine.connect() as c:  # users polling SQL see the same report in the view
        viewed = c.execute(text("SELECT session FROM longtake_jobs_v WHERE job_id = :id"), {"id": job_id}).scalar()
    viewed = json.loads(viewed) if isinstance(viewed, str) else viewed
    assert viewed["end_reason"] == "closed" and viewed["audio_s"] == 3.2, viewed


def test_bursty_feed_inserts_silence_without_stalling(stack: Stack) -> None:
    """A gap of 2 s (five chunks): the timeline keeps moving (segments keep being published during
    the gap) and the inserted silence is reported; the later burst is placed after it."""
    job_id, ws = open_session(stack, latency="low")
    feed(ws, 1.0)
    time.sleep(0.5)
    before = len(stack.segments(job_id))
    time.sleep(1.5)  # the sender is silent; the avatar listens
    during = len(stack.segments(job_id))
    assert during >= before + 2, (before, during)
    ws.send(tone(1.0))  # a burst: 1 s at once
    end_session(ws)
    job = stack.wait(job_id)
    session = job["session"]
    assert job["status"] == "succeeded" and session["end_reason"] == "closed", job  # type: ignore[index]
    assert session["audio_s"] == 2.0 and 1.4 < float(session["silence_s"]) < 2.3, session  # type: ignore[index]
    assert abs(float(session["duration_s"]) - 2.0 - float(session["silence_s"])) < 1e-3  # type: ignore[index]
    check_timeline(stack, job_id, float(session["duration_s"]))  # type: ignore[index]


def test_abrupt_disconnect_publishes_partial_video_then_new_session(stack: Stack) -> None:
    """The sender's TCP connection drops without a close frame: the session ends within the idle
    timeout, marked disconnected, its video published; the next session on the workers succeeds."""
    job_id, ws = open_session(stack)
    feed(ws, 1.0)
    ws.socket.shutdown(socket.SHUT_RDWR)  # no close frame
    ws.socket.close()
    gone = time.monotonic()
    job = stack.wait(job_id, timeout=IDLE_S + 10)
    assert time.monotonic() - gone < IDLE_S + 3
    session = job["session"]
    assert job["status"] == "succeeded" and session["end_reason"] == "disconnected", job  # type: ignore[index]
    assert session["audio_s"] == 1.0 and job["outputs"].get("mp4"), job  # type: ignore[union-attr,index]
    check_timeline(stack, job_id, float(session["duration_s"]))  # type: ignore[index]

    again, ws2 = open_session(stack)
    feed(ws2, 0.8)
    end_session(ws2)
    assert stack.wait(again)["status"] == "succeeded"


def test_idle_timeout_ends_the_session_with_a_final_segment(stack: Stack) -> None:
    job_id, ws = open_session(stack)
    feed(ws, 0.8)
    ended = expect(ws, "ended", timeout=IDLE_S + 10)  # the sender stays connected but silent
    assert ended["status"] == "succeeded" and ended["end_reason"] == "idle_timeout", ended
    session = stack.job(job_id)["session"]
    assert session["audio_s"] == 0.8 and float(session["silence_s"]) > 2.0, session  # type: ignore[index]


def test_bad_input_is_refused_and_nothing_else_is_affected(stack: Stack) -> None:
    """Each bad input: a clear error naming the field and the fix, its close code, the session
    ended cleanly and the job saying why; meanwhile another tenant's session runs to its end."""
    good_id, good = open_session(stack)
    fed = threading.Thread(target=feed, args=(good, 6.0))
    fed.start()
    try:
        # a wrong sample format declared at open: refused at creation, nothing queued
        resp = httpx.post(f"{stack.url}/v1/jobs", headers={"Authorization": f"Bearer {TOKEN_B}"},
                          json={"image": f"file://{stack.tmp}/in/face.png",
                                "session": {"sample_rate": RATE, "format": "f32le"}})
        assert resp.status_code == 422 and "session.format" in resp.text and "s16le" in resp.text, resp.text

        # another tenant's session id: answered as a missing job, the session is untouched
        other = stack.connect(good_id, token=TOKEN_B)
        error, code = close_reason(other)
        assert code == 1008 and error["error"] == "not_found" and error["field"] == "job_id", error

        cases: list[tuple[float, object, int, str, str]] = [
            (0.4, b"\x01\x02\x03", 1007, "partial_frame", "whole frames"),  # garbage: half a frame
            (0.0, b"RIFF" + bytes(40), 1007, "not_pcm", "raw PCM"),  # a WAV file sent instead of PCM
            (0.4, "not json {", 1007, "invalid_json", '{"type": "end"}'),
            (0.4, bytes(70000), 1009, "message_too_large", "smaller messages"),
        ]
        for before_s, payload, want_code, want_error, fix in cases:
            job_id, ws = _open_b(stack)
            feed(ws, before_s)
            ws.send(payload)  # type: ignore[arg-type]
            error, code = close_reason(ws)
            assert code == want_code and error.get("error") == want_error, (error, code, stack.job(job_id, TOKEN_B))
            assert fix in str(error["message"]), error
            job = stack.wait(job_id, token=TOKEN_B)
            assert job["status"] == "failed" and job["error_code"] == "session_input", job
            assert job["session"]["end_reason"] == "error", job  # type: ignore[index]
            assert str(error["message"]) in str(job["error_message"]), job

        # audio after `end`: refused; the session itself had ended cleanly and succeeds
        job_id, ws = _open_b(stack)
        feed(ws, 0.4)
        ws.send(json.dumps({"type": "end"}))
        ws.send(tone(0.1))
        error, code = close_reason(ws)
        assert code == 1008 and error["error"] == "audio_after_end", error
        job = stack.wait(job_id, token=TOKEN_B)
        assert job["status"] == "succeeded" and job["session"]["end_reason"] == "closed", job  # type: ignore[index]
    finally:
        fed.join()
    end_session(good)
    job = stack.wait(good_id)
    assert job["status"] == "succeeded" and job["session"]["audio_s"] == 6.0, job  # type: ignore[index]
    check_timeline(stack, good_id, float(job["session"]["duration_s"]))  # type: ignore[index]


def _open_b(stack: Stack) -> tuple[str, ClientConnection]:
    job_id = stack.create(token=TOKEN_B)
    ws = stack.connect(job_id, token=TOKEN_B)
    expect(ws, "open")
    expect(ws, "ready")
    return job_id, ws


def test_second_sender_and_plain_jobs_are_refused(stack: Stack) -> None:
    job_id, ws = open_session(stack)
    second = stack.connect(job_id)
    error, code = close_reason(second)
    assert code == 1008 and error["error"] == "sender_exists" and "new session" in str(error["message"]), error
    end_session(ws)
    assert stack.wait(job_id)["status"] == "succeeded"
    unauth = connect(f"{stack.ws_url}/v1/jobs/{job_id}/audio", open_timeout=10).__enter__()
    error, code = close_reason(unauth)
    assert code == 1008 and error["error"] == "unauthorized", error


def test_audio_connections_take_from_the_tokens_rate_bucket(stack: Stack) -> None:
    """A WebSocket connection costs a token of the caller's bucket like any HTTP request: past the
    burst it is refused with 1013 `rate_limited`, naming the header and when to connect again.
    (An API of its own with a burst of 2, over the stack's database and broker.)"""
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    settings = stack.settings.model_copy(update={"api_rate_per_s": 0.01, "api_rate_burst": 2})
    missing = f"/v1/jobs/{uuid.uuid4()}/audio"
    auth = {"Authorization": f"Bearer {TOKEN_B}"}
    with TestClient(create_app(settings)) as client:
        replies = []
        for _ in range(3):
            with client.websocket_connect(missing, headers=auth) as ws:
                msg = ws.receive_json()
                while msg["type"] != "error":
                    msg = ws.receive_json()
                with pytest.raises(WebSocketDisconnect) as closed:
                    ws.receive_json()
                replies.append((msg["error"], closed.value.code))
        assert replies[:2] == [("not_found", 1008)] * 2 and replies[2] == ("rate_limited", 1013), replies
        assert client.get("/v1/jobs", headers=auth).status_code == 429  # the same bucket as HTTP
    assert "connect again after" in str(msg["message"]) and msg["field"] == "Authorization", msg


def test_longtake_live_streams_a_file_end_to_end(stack: Stack) -> None:
    """`longtake live --image PNG --audio-from WAV` in its own process: it prints the job and the
    preview URL, streams at real-time pace, ends the session at EOF and prints the outputs."""
    wav = stack.tmp / "speech.wav"
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", "sine=frequency=300:sample_rate=22050",
                    "-t", "1.5", "-ac", "1", str(wav)], check=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LONGTAKE_API_URL": stack.url, "LONGTAKE_API_TOKEN": TOKEN_A}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "worker.cli", "live", "--image", str(stack.tmp / "in" / "face.png"),
                          "--audio-from", str(wav), "--option", "steps=3", "--option", "audio_guidance=2"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert time.monotonic() - started >= 1.5  # real-time pace
    lines = out.stdout.splitlines()
    job_id = lines[0].split()[0]
    assert any("/preview.html?" in ln for ln in lines), out.stdout
    job = stack.wait(job_id)
    assert job["status"] == "succeeded" and job["session"]["end_reason"] == "closed", job  # type: ignore[index]
    assert job["session"]["audio_s"] == 1.5 and job["spec"]["session"]["sample_rate"] == 22050, job  # type: ignore[index]
    assert job["spec"]["options"] == {"steps": 3, "audio_guidance": 2.0}, job  # a session takes the job's options
    assert "mp4" in out.stdout and "closed" in out.stdout, out.stdout


def test_preview_page_plays_a_live_session_while_it_renders(stack: Stack) -> None:
    """The page `GET .../preview` names, in headless Chromium, while the session is being fed: it
    plays the segments published so far and keeps following the playlist ("live")."""
    from test_delivery_preview_page import CHROMIUM, page_state

    if CHROMIUM is None:
        pytest.skip("needs a headless Chromium")
    job_id, ws = open_session(stack)
    fed = threading.Thread(target=feed, args=(ws, 12.0))
    fed.start()
    try:
        # three segments in the playlist the page reads, however fast this machine renders (a fixed
        # 2 s gave one under load)
        deadline = time.monotonic() + 30
        while (stack.playlist(job_id) or "").count("#EXTINF") < 3:
            assert time.monotonic() < deadline, f"fewer than 3 segments listed after 30 s: {stack.playlist(job_id)}"
            time.sleep(0.1)
        resp = httpx.get(f"{stack.url}/v1/jobs/{job_id}/preview", headers={"Authorization": f"Bearer {TOKEN_A}"})
        page = resp.json()["page_url"]
        state, detail = page_state(page, stack.tmp / f"chrome-{job_id[:8]}")
        assert state == "live", detail
        segments = int(detail.split("rendering: ")[1].split()[0])
        assert segments >= 3 and stack.job(job_id)["status"] == "running", detail
        # a viewer who joins later starts at the live edge (the link's edge=3), not at segment 0
        time.sleep(3.0)
        assert "&edge=3" in page
        state, detail = page_state(page, stack.tmp / f"chrome-late-{job_id[:8]}")
        assert state == "live", detail
        joined = int(detail.split("joined live at segment ")[1].split(",")[0])
        total = int(detail.split("rendering: ")[1].split()[0])
        assert joined >= 1 and total - joined >= 3, detail
        playing_at = float(detail.split("playing at ")[1].split()[0])
        assert playing_at >= 0.9 * sum(s[3] for s in stack.segments(job_id)[:joined]), detail  # past segment 0
    finally:
        fed.join()
    end_session(ws)
    assert stack.wait(job_id)["status"] == "succeeded"


def test_cancel_ends_a_session_keeps_its_segments_and_tells_the_sender(stack: Stack) -> None:
    job_id, ws = open_session(stack)
    feed(ws, 1.0)
    resp = httpx.post(f"{stack.url}/v1/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {TOKEN_A}"})
    assert resp.status_code == 202, resp.text  # accepted: the worker stops the render between chunks
    ended = expect(ws, "ended", timeout=20)
    assert ended["status"] == "cancelled" and ended["end_reason"] == "cancelled", ended
    job = stack.wait(job_id)
    assert job["status"] == "cancelled" and job["session"]["end_reason"] == "cancelled", job  # type: ignore[index]
    segs = stack.segments(job_id)
    assert segs and [s[0] for s in segs] == list(range(len(segs))), segs  # what was rendered stays


def test_a_session_whose_worker_dies_fails_as_session_lost_and_the_next_one_runs(stack: Stack) -> None:
    """kill -9 of the worker rendering a session: its audio went to that worker, so the reaper
    fails the job (``session_lost``, segments kept as partial outputs) instead of requeueing it;
    a new session then runs on the other worker."""
    job_id, ws = open_session(stack)
    feed(ws, 1.0)
    owner = stack.store.get(job_id).lease_owner  # type: ignore[union-attr]
    victim = next(w for w in stack.workers if w.name == owner)
    victim.kill9()
    job = stack.wait(job_id, timeout=30)  # lease 3 s, reaper every 0.5 s on the survivor
    assert job["status"] == "failed" and job["error_code"] == "session_lost", job
    assert "not resumable" in str(job["error_message"]) and "new session" in str(job["error_message"]), job
    assert stack.segments(job_id), "the segments rendered before the death stay"
    try:
        ws.send(tone(0.1))
        ws.close()
    except ConnectionClosed:
        pass
    again, ws2 = open_session(stack)
    feed(ws2, 0.8)
    end_session(ws2)
    assert stack.wait(again)["status"] == "succeeded"
    # the module's other tests expect two workers: a fresh one under the dead one's name
    stack.workers.remove(victim)
    fresh = CeleryWorker(victim.name, victim.env, victim.log_path.with_name(f"{victim.name}-2.log"), app=victim.app)
    stack.workers.append(fresh.start())


@pytest.fixture(scope="module")
def real_stack(pg_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The API and one worker running the production app: the real pipeline on the embedded
    defaults (tiny family), as ``longtake worker`` runs it."""
    yield from _stack(pg_template, tmp_path_factory.mktemp("sessions-real"), app="real", names=("real",))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("latency", ["default", "low"])
def test_a_session_on_the_real_pipeline(real_stack: Stack, latency: str) -> None:
    """The real render follows the live directory: a burst, a gap longer than a chunk (tiny: 16
    frames = 0.64 s), another burst. The job succeeds; the final MP4 (ffprobe) lasts the fed audio
    plus the inserted silence within one frame; the segments are continuous from frame 0; every
    published chunk reported its delay."""
    job_id, ws = open_session(real_stack, latency=latency)
    feed(ws, 1.2)
    time.sleep(1.5)  # the sender is silent: the live clock inserts silence (max_lag_s = 0.3 here)
    feed(ws, 1.2)
    end_session(ws)
    job = real_stack.wait(job_id, timeout=240)
    session = job["session"]
    assert job["status"] == "succeeded", job
    assert session["end_reason"] == "closed" and session["audio_s"] == 2.4, session  # type: ignore[index]
    silence, duration = float(session["silence_s"]), float(session["duration_s"])  # type: ignore[index]
    assert 0.8 < silence < 1.6 and abs(duration - 2.4 - silence) < 1e-3, session
    final = Path(str(job["outputs"]["mp4"]).removeprefix("file://"))  # type: ignore[index]
    probed = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "format=duration", "-of", "csv=p=0",
                             str(final)], capture_output=True, text=True, check=True)
    assert abs(float(probed.stdout) - duration) <= 1 / FPS + 1e-3, (probed.stdout, session)
    check_timeline(real_stack, job_id, duration)
    assert session["chunk_delay_max_s"] is not None and float(session["chunk_delay_max_s"]) > 0, session  # type: ignore[index]
