"""Our own client for Kinesis Video Streams PutMedia (boto3 has none).

PutMedia is one long-lived HTTP/1.1 POST to ``<data endpoint>/putMedia`` whose body is an MKV
stream sent with chunked transfer encoding, while the response body streams back JSON ACK events
(one object per fragment stage: BUFFERING, RECEIVED, PERSISTED, ERROR, IDLE), separated by newlines.

Who calls what: :class:`worker.delivery.kvs.sink.KVSPreviewSink` makes one :class:`PutMediaClient`, asks it
for the data endpoint (GetDataEndpoint through boto3's ``kinesisvideo`` client) and opens a
:class:`PutMediaConnection` per session (again after a retriable error). ``send`` writes one HTTP
chunk; a reader thread parses ACKs as they arrive and hands each to ``on_ack`` (on that thread).

Signing: SigV4 (service ``kinesisvideo``) over the request headers with
``x-amz-content-sha256: UNSIGNED-PAYLOAD`` since the body is not known when the request starts.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import boto3
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config

from pipeline.errors import SinkError

logger = logging.getLogger(__name__)

# KVS PutMedia error ids (API reference, "ErrorId" of ERROR acks) that a new session may cure.
RETRIABLE_ERROR_IDS = frozenset({4000, 4003, 5000, 5001})
ERROR_NAMES = {
    4000: "STREAM_READ_ERROR", 4001: "MAX_FRAGMENT_SIZE_REACHED", 4002: "MAX_FRAGMENT_DURATION_REACHED",
    4003: "MAX_CONNECTION_DURATION_REACHED", 4004: "FRAGMENT_TIMECODE_LESSER_THAN_PREVIOUS",
    4005: "MORE_THAN_ALLOWED_TRACKS_FOUND", 4006: "INVALID_MKV_DATA", 4007: "INVALID_PRODUCER_TIMESTAMP",
    4008: "STREAM_NOT_ACTIVE", 4009: "FRAGMENT_METADATA_LIMIT_REACHED", 4010: "TRACK_NUMBER_MISMATCH",
    4011: "FRAMES_MISSING_FOR_TRACK", 4500: "KMS_KEY_ACCESS_DENIED", 4501: "KMS_KEY_DISABLED",
    4502: "KMS_KEY_VALIDATION_ERROR", 4503: "KMS_KEY_UNAVAILABLE", 4504: "KMS_KEY_INVALID_USAGE",
    4505: "KMS_KEY_INVALID_STATE", 4506: "KMS_KEY_NOT_FOUND", 4507: "STREAM_DELETED",
    5000: "INTERNAL_ERROR", 5001: "ARCHIVAL_ERROR",
}


@dataclass(frozen=True)
class AckEvent:
    event_type: str  # BUFFERING | RECEIVED | PERSISTED | ERROR | IDLE, or CLOSED (ours: session ended)
    fragment_timecode: int | None = None
    fragment_number: str | None = None
    error_id: int | None = None
    error_code: str | None = None
    detail: str | None = None  # ours: why a session ended (HTTP status, socket error)

    @property
    def retriable(self) -> bool:
        return self.error_id in RETRIABLE_ERROR_IDS


class PutMediaError(SinkError):
    """A PutMedia session could not be opened or went away; ``retryable``: a new session may work.
    Handled inside :class:`worker.delivery.kvs.sink.KVSPreviewSink` (the preview never fails a render)."""

    code = "kvs_preview"

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class PutMediaConnection:
    """One PutMedia HTTP session. ``send`` from one thread; ACKs arrive on the reader thread."""

    def __init__(self, sock: socket.socket, on_ack: Callable[[AckEvent], None]) -> None:
        self._sock = sock
        self._on_ack = on_ack
        self._closed = threading.Event()
        self.bytes_sent = 0
        self._reader = threading.Thread(target=self._read, name="kvs-ack-reader", daemon=True)
        self._reader.start()

    def send(self, data: bytes) -> None:
        if self._closed.is_set():
            raise PutMediaError("PutMedia session already ended", retryable=True)
        try:
            self._sock.sendall(b"%x\r\n" % len(data) + data + b"\r\n")
        except OSError as exc:
            raise PutMediaError(f"PutMedia send failed: {exc}", retryable=True) from exc
        self.bytes_sent += len(data)

    def end_body(self) -> None:
        """Send the zero-length chunk that ends the MKV stream; ACKs keep arriving after it."""
        try:
            self._sock.sendall(b"0\r\n\r\n")
        except OSError as exc:
            raise PutMediaError(f"PutMedia send failed: {exc}", retryable=True) from exc

    def wait_closed(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the server to end its ACK stream. True if it did."""
        self._reader.join(timeout_s)
        return not self._reader.is_alive()

    def abort(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(5)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _read(self) -> None:
        detail = "server ended the ACK stream"
        try:
            f = self._sock.makefile("rb")
            status_line = f.readline().decode("latin-1").strip()
            parts = status_line.split(" ", 2)
            status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0
            headers: dict[str, str] = {}
            while (line := f.readline().decode("latin-1").strip()) != "":
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            if status != 200:
                body = f.read(int(headers.get("content-length", "0") or 0)) if not chunked else b""
                detail = f"HTTP {status} from PutMedia: {body[:500].decode('utf-8', 'replace')}"
                self._on_ack(AckEvent("CLOSED", detail=detail, error_code=str(status)))
                return
            decoder = json.JSONDecoder()
            buf = ""
            while not self._closed.is_set():
                if chunked:
                    size_line = f.readline()
                    if not size_line:
                        break
                    size = int(size_line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        break
                    chunk = f.read(size)
                    f.readline()
                else:
                    chunk = f.read1(65536) if hasattr(f, "read1") else f.read(1)
                    if not chunk:
                        break
                buf += chunk.decode("utf-8")
                while True:
                    buf = buf.lstrip()
                    if not buf:
                        break
                    try:
                        obj, end = decoder.raw_decode(buf)
                    except json.JSONDecodeError:
                        break  # incomplete object: wait for more bytes
                    buf = buf[end:]
                    self._on_ack(AckEvent(
                        str(obj.get("EventType", "")), obj.get("FragmentTimecode"), obj.get("FragmentNumber"),
                        obj.get("ErrorId"), obj.get("ErrorCode") or ERROR_NAMES.get(obj.get("ErrorId") or 0),
                    ))
        except (OSError, ValueError) as exc:
            detail = f"PutMedia connection failed: {exc}"
        finally:
            if not self._closed.is_set():
                self._closed.set()
                self._on_ack(AckEvent("CLOSED", detail=detail))


class PutMediaClient:
    """GetDataEndpoint + signed PutMedia sessions for one stream."""

    def __init__(
        self,
        stream_name: str,
        *,
        region: str,
        endpoint_url: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.stream_name = stream_name
        self.region = region
        self._session = boto3.session.Session(
            aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key,
            aws_session_token=session_token, region_name=region,
        )
        self._control = self._session.client(
            "kinesisvideo", endpoint_url=endpoint_url,
            config=Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 3}),
        )
        self._timeout_s = timeout_s
        self._data_endpoint: str | None = None

    def data_endpoint(self, *, refresh: bool = False) -> str:
        if self._data_endpoint is None or refresh:
            resp = self._control.get_data_endpoint(StreamName=self.stream_name, APIName="PUT_MEDIA")
            self._data_endpoint = str(resp["DataEndpoint"]).rstrip("/")
        return self._data_endpoint

    def hls_session_url(self, *, expires_s: int = 3600) -> str:
        """A LIVE HLS playback URL for the stream (what ``longtake preview JOB`` prints for KVS jobs):
        GetDataEndpoint(GET_HLS_STREAMING_SESSION_URL), then GetHLSStreamingSessionURL there."""
        resp = self._control.get_data_endpoint(StreamName=self.stream_name, APIName="GET_HLS_STREAMING_SESSION_URL")
        media = self._session.client(
            "kinesis-video-archived-media", endpoint_url=str(resp["DataEndpoint"]),
            config=Config(connect_timeout=self._timeout_s, read_timeout=self._timeout_s),
        )
        out = media.get_hls_streaming_session_url(
            StreamName=self.stream_name, PlaybackMode="LIVE", ContainerFormat="FRAGMENTED_MP4", Expires=expires_s
        )
        return str(out["HLSStreamingSessionURL"])

    def connect(self, *, producer_start_s: float, on_ack: Callable[[AckEvent], None]) -> PutMediaConnection:
        """Open a PutMedia session (RELATIVE timecodes from ``producer_start_s``, epoch seconds)."""
        url = self.data_endpoint() + "/putMedia"
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        headers = {
            "Host": parts.netloc,
            "x-amzn-stream-name": self.stream_name,
            "x-amzn-fragment-timecode-type": "RELATIVE",
            "x-amzn-producer-start-timestamp": f"{producer_start_s:.3f}",
            "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
            "Content-Type": "application/octet-stream",
        }
        credentials = self._session.get_credentials()
        if credentials is None:
            raise PutMediaError("no AWS credentials for PutMedia (configure the worker's AWS credentials)",
                                retryable=False)
        request = AWSRequest(method="POST", url=url, headers=headers)
        SigV4Auth(credentials.get_frozen_credentials(), "kinesisvideo", self.region).add_auth(request)
        head = [f"POST {parts.path or '/'} HTTP/1.1"]
        head += [f"{k}: {v}" for k, v in request.headers.items()]
        head += ["Transfer-Encoding: chunked", "Connection: close", "", ""]
        try:
            sock = socket.create_connection((host, port), timeout=self._timeout_s)
            if parts.scheme == "https":
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
            sock.settimeout(None)  # the ACK reader blocks between events; sends block on back-pressure
            sock.sendall("\r\n".join(head).encode("latin-1"))
        except OSError as exc:
            raise PutMediaError(f"cannot reach KVS data endpoint {url}: {exc}", retryable=True) from exc
        return PutMediaConnection(sock, on_ack)
