"""A local stand-in for the Kinesis Video Streams PutMedia wire protocol (test code; AWS cannot be
reached here). The client under test (worker.delivery.kvs.putmedia) is the real one.

``KVSStandIn`` is an HTTP/1.1 server on 127.0.0.1 that:
- serves GetDataEndpoint (``POST /getDataEndpoint``, JSON, as boto3's ``kinesisvideo`` client sends
  it) and answers with its own URL, and GetHLSStreamingSessionURL (a URL for LIVE playback);
- checks the SigV4 signature of every request against the known test credentials, recomputed here
  from scratch (hmac/hashlib, not botocore), and the clock skew;
- for ``POST /putMedia`` checks the KVS headers, answers 200 at once with a chunked ACK stream, then
  reads the chunked MKV body incrementally: EBML header, Segment of unknown size, Info, Tracks, then
  Clusters; each cluster must start with a track-1 keyframe SimpleBlock and have a timecode above the
  previous persisted one; it is decoded with PyAV (header + that cluster) to prove its frames are
  valid, and ACKed BUFFERING -> RECEIVED -> PERSISTED (JSON, one per line) as it arrives;
- can inject an ERROR ack for the n-th cluster it receives (``inject={n: error_id}``); like KVS it
  then ends the session.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import BinaryIO
from urllib.parse import quote

import av

ACCESS_KEY = "AKIDKVSSTANDIN0000"
SECRET_KEY = "kvs-standin-secret-key"
REGION = "us-west-2"

EBML_ID, SEGMENT_ID, INFO_ID, TRACKS_ID, CLUSTER_ID = 0x1A45DFA3, 0x18538067, 0x1549A966, 0x1654AE6B, 0x1F43B675
TIMECODE_ID, SIMPLE_BLOCK_ID, DOC_TYPE_ID = 0xE7, 0xA3, 0x4282


# ---------------------------------------------------------------------------------------------- EBML
def read_vint(stream: BinaryIO, *, keep_marker: bool) -> tuple[int, bytes] | None:
    """(value, raw bytes) of an EBML vint; None at clean EOF. Unknown size -> value -1."""
    first = stream.read(1)
    if not first:
        return None
    b0 = first[0]
    length = 1
    while length <= 8 and not b0 & (0x80 >> (length - 1)):
        length += 1
    if length > 8:
        raise ValueError(f"bad EBML vint lead byte {b0:#x}")
    rest = stream.read(length - 1)
    if len(rest) != length - 1:
        raise ValueError("truncated EBML vint")
    raw = first + rest
    value = int.from_bytes(raw, "big")
    if keep_marker:
        return value, raw
    value &= (1 << (7 * length)) - 1
    if value == (1 << (7 * length)) - 1:
        return -1, raw
    return value, raw


def read_element_header(stream: BinaryIO) -> tuple[int, int, bytes] | None:
    """(element id, payload size or -1, raw header bytes); None at EOF."""
    got = read_vint(stream, keep_marker=True)
    if got is None:
        return None
    eid, raw_id = got
    size = read_vint(stream, keep_marker=False)
    if size is None:
        raise ValueError("EOF inside an element header")
    return eid, size[0], raw_id + size[1]


def iter_children(payload: bytes) -> list[tuple[int, bytes]]:
    out, bio = [], io.BytesIO(payload)
    while (h := read_element_header(bio)) is not None:
        eid, size, _ = h
        out.append((eid, bio.read(size)))
    return out


def find(payload: bytes, eid: int) -> list[bytes]:
    return [p for i, p in iter_children(payload) if i == eid]


def parse_simple_block(payload: bytes) -> tuple[int, int, int, bytes]:
    """(track number, relative timecode, flags, frame data)."""
    bio = io.BytesIO(payload)
    track = read_vint(bio, keep_marker=False)
    assert track is not None
    rel = int.from_bytes(bio.read(2), "big", signed=True)
    flags = bio.read(1)[0]
    return track[0], rel, flags, bio.read()


def decode_mkv(data: bytes) -> tuple[int, int]:
    """Decode an MKV byte string with PyAV; (video frames, audio frames)."""
    nv = na = 0
    with av.open(io.BytesIO(data), format="matroska") as c:
        for packet in c.demux():
            for frame in packet.decode():
                if isinstance(frame, av.VideoFrame):
                    nv += 1
                else:
                    na += 1
    return nv, na


# ---------------------------------------------------------------------------------------------- SigV4
def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def verify_sigv4(method: str, path: str, headers: dict[str, str], body_sha256: str | None, *,
                 service: str) -> str | None:
    """None if the request is signed with the test credentials, else the reason it is not."""
    auth = headers.get("authorization", "")
    if not auth.startswith("AWS4-HMAC-SHA256 "):
        return "missing AWS4-HMAC-SHA256 Authorization"
    fields = dict(p.strip().split("=", 1) for p in auth[len("AWS4-HMAC-SHA256 "):].split(","))
    akid, date, region, svc, term = fields["Credential"].split("/")
    if akid != ACCESS_KEY:
        return f"unknown access key {akid}"
    if (region, svc, term) != (REGION, service, "aws4_request"):
        return f"bad credential scope {region}/{svc}/{term}"
    amz_date = headers.get("x-amz-date", "")
    when = datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    if abs((datetime.now(UTC) - when).total_seconds()) > 300 or not amz_date.startswith(date):
        return f"x-amz-date {amz_date} out of range"
    signed = fields["SignedHeaders"].split(";")
    if "host" not in signed:
        return "host header not signed"
    payload_hash = headers.get("x-amz-content-sha256") or body_sha256
    if payload_hash is None:
        return "no payload hash"
    canonical = "\n".join([
        method, quote(path, safe="/~"), "",
        "".join(f"{h}:{' '.join(headers.get(h, '').split())}\n" for h in signed),
        ";".join(signed), payload_hash,
    ])
    scope = f"{date}/{region}/{svc}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + SECRET_KEY).encode(), date), region), svc), "aws4_request")
    if not hmac.compare_digest(hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest(), fields["Signature"]):
        return "signature does not match"
    return None


# ---------------------------------------------------------------------------------------------- server
class _Chunked:
    """File-like reader over an HTTP chunked request body, read incrementally."""

    def __init__(self, rfile: BinaryIO) -> None:
        self._r, self._left, self._eof = rfile, 0, False

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n and not self._eof:
            if self._left == 0:
                line = self._r.readline()
                if not line:
                    self._eof = True
                    break
                self._left = int(line.split(b";")[0].strip() or b"0", 16)
                if self._left == 0:
                    self._r.readline()
                    self._eof = True
                    break
            take = self._r.read(min(self._left, n - len(out)))
            if not take:
                self._eof = True
                break
            out += take
            self._left -= len(take)
            if self._left == 0:
                self._r.readline()
        return out


@dataclass
class ReceivedFragment:
    session: int
    timecode: int
    fragment_number: str
    video_frames: int
    audio_frames: int


@dataclass
class StandInState:
    streams: set[str]
    inject: dict[int, int] = field(default_factory=dict)  # n-th cluster received (0-based) -> ErrorId
    persisted: list[ReceivedFragment] = field(default_factory=list)
    errors_sent: list[tuple[int, int]] = field(default_factory=list)  # (timecode, error id)
    sessions: int = 0
    clusters_received: int = 0
    rejected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass

    def _headers(self) -> dict[str, str]:
        return {k.lower(): v for k, v in self.headers.items()}

    def _json(self, status: int, obj: dict[str, object]) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        state = self.server.state
        headers = self._headers()
        if self.path == "/getDataEndpoint":
            body = self.rfile.read(int(headers.get("content-length", "0")))
            why = verify_sigv4("POST", self.path, headers, hashlib.sha256(body).hexdigest(), service="kinesisvideo")
            if why:
                state.rejected.append(why)
                return self._json(403, {"message": why})
            req = json.loads(body)
            if req.get("StreamName") not in state.streams:
                return self._json(404, {"__type": "ResourceNotFoundException", "message": "no such stream"})
            if req.get("APIName") not in ("PUT_MEDIA", "GET_HLS_STREAMING_SESSION_URL"):
                return self._json(400, {"__type": "InvalidArgumentException", "message": "APIName"})
            return self._json(200, {"DataEndpoint": self.server.url})
        if self.path == "/getHLSStreamingSessionURL":
            body = self.rfile.read(int(headers.get("content-length", "0")))
            why = verify_sigv4("POST", self.path, headers, hashlib.sha256(body).hexdigest(), service="kinesisvideo")
            req = json.loads(body)
            if why or req.get("StreamName") not in state.streams or req.get("PlaybackMode") != "LIVE":
                return self._json(403 if why else 400, {"message": why or "bad request"})
            token = hashlib.sha256(body).hexdigest()[:32]
            return self._json(200, {"HLSStreamingSessionURL":
                                    f"{self.server.url}/hls/v1/getHLSMasterPlaylist.m3u8?SessionToken={token}"})
        if self.path != "/putMedia":
            return self._json(404, {"message": f"no route {self.path}"})
        why = verify_sigv4("POST", self.path, headers, None, service="kinesisvideo")
        if why is None and headers.get("x-amzn-stream-name") not in state.streams:
            why = "unknown stream"
        if why is None and headers.get("x-amzn-fragment-timecode-type") not in ("ABSOLUTE", "RELATIVE"):
            why = "bad x-amzn-fragment-timecode-type"
        if why is None and "chunked" not in headers.get("transfer-encoding", ""):
            why = "PutMedia body must use chunked transfer encoding"
        if why is None and headers.get("x-amzn-fragment-timecode-type") == "RELATIVE":
            try:
                float(headers["x-amzn-producer-start-timestamp"])
            except (KeyError, ValueError):
                why = "RELATIVE timecodes need x-amzn-producer-start-timestamp"
        if why:
            state.rejected.append(why)
            self.close_connection = True
            return self._json(403, {"message": why})
        with state.lock:
            session = state.sessions
            state.sessions += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        try:
            self._stream(session, _Chunked(self.rfile))  # type: ignore[arg-type]
        finally:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass

    def _ack(self, event: str, timecode: int, number: str, error_id: int | None = None) -> None:
        obj: dict[str, object] = {"EventType": event, "FragmentTimecode": timecode, "FragmentNumber": number}
        if error_id is not None:
            obj["ErrorId"] = error_id
        data = json.dumps(obj).encode() + b"\n"
        self.wfile.write(b"%x\r\n" % len(data) + data + b"\r\n")
        self.wfile.flush()

    def _stream(self, session: int, body: _Chunked) -> None:
        state = self.server.state
        h = read_element_header(body)  # type: ignore[arg-type]
        if h is None or h[0] != EBML_ID:
            return self._ack("ERROR", 0, "0", 4006)
        ebml = body.read(h[1])
        if find(ebml, DOC_TYPE_ID) != [b"matroska"]:
            return self._ack("ERROR", 0, "0", 4006)
        header = h[2] + ebml
        h = read_element_header(body)  # type: ignore[arg-type]
        if h is None or h[0] != SEGMENT_ID or h[1] != -1:
            return self._ack("ERROR", 0, "0", 4006)
        header += h[2]
        have_tracks = False
        while (h := read_element_header(body)) is not None:  # type: ignore[arg-type]
            eid, size, raw = h
            if size < 0:
                return self._ack("ERROR", 0, "0", 4006)
            payload = body.read(size)
            if eid != CLUSTER_ID:
                header += raw + payload
                have_tracks = have_tracks or eid == TRACKS_ID
                continue
            with state.lock:
                nth = state.clusters_received
                state.clusters_received += 1
            timecode = int.from_bytes(find(payload, TIMECODE_ID)[0], "big")
            number = f"9134385233318{int(time.time() * 1000)}{nth:06d}"
            self._ack("BUFFERING", timecode, number)
            blocks = [parse_simple_block(b) for b in find(payload, SIMPLE_BLOCK_ID)]
            error = None
            if not have_tracks or not blocks or blocks[0][0] != 1 or not blocks[0][2] & 0x80:
                error = 4006  # a fragment must start with the video keyframe
            elif any(t not in (1, 2) for t, *_ in blocks):
                error = 4010
            elif state.persisted and timecode <= state.persisted[-1].timecode:
                error = 4004
            elif nth in state.inject:
                error = state.inject[nth]
            nv = na = 0
            if error is None:
                try:
                    nv, na = decode_mkv(header + raw + payload)
                except av.error.FFmpegError:
                    error = 4006
                if nv != sum(1 for t, *_ in blocks if t == 1):
                    error = 4006
            if error is not None:
                state.errors_sent.append((timecode, error))
                self._ack("ERROR", timecode, number, error)
                return  # KVS ends the session after an error
            self._ack("RECEIVED", timecode, number)
            state.persisted.append(ReceivedFragment(session, timecode, number, nv, na))
            self._ack("PERSISTED", timecode, number)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: StandInState
    url: str


class KVSStandIn:
    """Start with ``KVSStandIn(streams={"s"})``; ``url`` is the control and data endpoint."""

    def __init__(self, *, streams: set[str], inject: dict[int, int] | None = None) -> None:
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.state = StandInState(streams=streams, inject=dict(inject or {}))
        self.url = self.server.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def state(self) -> StandInState:
        return self.server.state

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
