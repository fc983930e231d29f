"""Object storage behind one small interface: S3 (any endpoint) or a local directory.

Who calls what: the worker opens one store per process with :func:`open_object_store` (from
``Settings``), builds a job's key prefix with :func:`job_prefix` and every object name under it with
:func:`safe_key`; :class:`worker.delivery.s3_sink.S3ProgressiveSink` uploads segments, playlist, resume states
and the final MP4 through it; the API presigns downloads. Keys passed to a store are *relative* to
the store's own root (``s3://bucket/<base prefix>/`` or ``file:///dir/``); both stores reject keys that
could escape that root, so a caller-supplied name can never reach another tenant's objects.

Retries: :class:`S3ObjectStore` retries throttling, 5xx and connection/timeout errors with tenacity
(bounded attempts, exponential back-off with full jitter). 4xx errors (auth, missing key, bad
request) are raised at once. botocore's own retries are switched off so that tenacity is the only
retrier and attempts are counted in one place. Every failure surfaces as :class:`StorageError`
whose ``retryable`` says whether a later attempt may succeed.
"""

from __future__ import annotations

import builtins
import hashlib
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Ids (tenant, job) are one path segment of safe characters; names under a prefix are one or more.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "SlowDown",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestThrottled",
        "RequestTimeout",
        "ProvisionedThroughputExceededException",
    }
)


class StorageError(Exception):
    """An object store operation failed. ``retryable`` is True for throttling, 5xx and connection
    errors that survived the store's own bounded retries (a later attempt may still succeed)."""

    def __init__(self, message: str, *, op: str, key: str, retryable: bool) -> None:
        super().__init__(message)
        self.op = op
        self.key = key
        self.retryable = retryable


class ObjectNotFoundError(StorageError):
    """The key (or multipart upload id) does not exist."""

    def __init__(self, message: str, *, op: str, key: str) -> None:
        super().__init__(message, op=op, key=key, retryable=False)


@dataclass(frozen=True)
class PartInfo:
    """One uploaded part of a multipart upload, as the store reports it."""

    part_number: int
    etag: str
    size: int


@runtime_checkable
class ObjectStore(Protocol):
    """What the worker needs from object storage. Implementations are thread-safe."""

    def put_bytes(self, key: str, data: bytes, *, content_type: str | None = None) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def download_to(self, key: str, path: Path) -> None: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def list(self, prefix: str) -> builtins.list[str]: ...
    def presign_get(self, key: str, expires_s: int = 3600) -> str: ...
    def uri(self, key: str) -> str: ...
    def create_multipart(self, key: str, *, content_type: str | None = None) -> str: ...
    def upload_part(self, key: str, upload_id: str, part_number: int, data: bytes) -> str: ...
    def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None: ...
    def abort_multipart(self, key: str, upload_id: str) -> None: ...
    def list_parts(self, key: str, upload_id: str) -> builtins.list[PartInfo]: ...


# --------------------------------------------------------------------------------------------------
# Key hygiene


def job_prefix(tenant: str, job_id: str) -> str:
    """``tenants/<tenant>/jobs/<job_id>/``; each id must be one safe path segment."""
    for field, value in (("tenant", tenant), ("job_id", job_id)):
        if not isinstance(value, str) or not _ID_RE.fullmatch(value) or ".." in value:
            raise ValueError(
                f"{field}={value!r} is not a valid id: use 1-128 characters of A-Z a-z 0-9 _ . - "
                "starting with a letter or digit (no '/', no '..')"
            )
    return f"tenants/{tenant}/jobs/{job_id}/"


def _check_relative_key(key: str, *, field: str = "key") -> str:
    """Validate a store-relative key: '/'-separated safe segments, nothing that climbs or encodes."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"{field}={key!r} is empty; pass a relative object name like 'out/final.mp4'")
    segments = key.split("/")
    for seg in segments:
        if seg in ("", ".", "..") or not _SEGMENT_RE.fullmatch(seg):
            raise ValueError(
                f"{field}={key!r} is not a safe object key (segment {seg!r}): use '/'-separated "
                "segments of A-Z a-z 0-9 _ . - that do not start with '.', with no leading '/', "
                "'..', '%', '\\' or empty segments"
            )
    return key


def safe_key(prefix: str, name: str) -> str:
    """``prefix + name`` after checking that ``name`` stays inside ``prefix``.

    ``prefix`` must end with '/' (as :func:`job_prefix` returns). Rejected: absolute names,
    ``..``/``.`` segments, empty segments, backslashes, percent-encoding, control characters and
    anything outside the safe alphabet, so no decoding layer (URL, shell, filesystem) can turn the
    key into a path outside the prefix.
    """
    if not prefix.endswith("/"):
        raise ValueError(f"prefix={prefix!r} must end with '/' (build it with job_prefix())")
    _check_relative_key(prefix.rstrip("/"), field="prefix")
    _check_relative_key(name, field="name")
    return prefix + name


# --------------------------------------------------------------------------------------------------
# S3


def _is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return err.get("Code", "") in _THROTTLING_CODES or status >= 500 or status == 429
    return isinstance(exc, HTTPClientError | BotoConnectionError)


class S3ObjectStore:
    """Objects in ``bucket`` under ``base_prefix``, through boto3 against any S3 endpoint.

    ``bytes_sent`` counts the payload bytes of every upload *attempt* (retries included), so callers
    can measure what really went over the wire; ``num_requests`` / ``num_failed_attempts`` count
    attempts.
    """

    def __init__(
        self,
        bucket: str,
        *,
        base_prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        max_attempts: int = 5,
        wait_max_s: float = 8.0,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts} must be >= 1")
        self.bucket = bucket
        self.base_prefix = base_prefix.strip("/") + "/" if base_prefix.strip("/") else ""
        if self.base_prefix:
            _check_relative_key(self.base_prefix.rstrip("/"), field="base_prefix")
        self.endpoint_url = endpoint_url
        self._max_attempts = max_attempts
        self._wait_max_s = wait_max_s
        config = Config(
            retries={"max_attempts": 1, "mode": "standard"},  # tenacity is the only retrier
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            s3={"addressing_style": "path"} if endpoint_url else None,
            max_pool_connections=16,
        )
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region or "us-east-1",
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            config=config,
        )
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.num_requests = 0
        self.num_failed_attempts = 0  # 404s of exists() included

    # -- plumbing
    def _k(self, key: str) -> str:
        return self.base_prefix + _check_relative_key(key)

    def _call(self, op: str, key: str, fn: Callable[[], T], *, nbytes: int = 0) -> T:
        def attempt() -> T:
            with self._lock:
                self.bytes_sent += nbytes
                self.num_requests += 1
            try:
                return fn()
            except Exception:
                with self._lock:
                    self.num_failed_attempts += 1
                raise

        retrying = Retrying(
            stop=stop_after_attempt(self._max_attempts),
            wait=wait_random_exponential(multiplier=0.25, max=self._wait_max_s),
            retry=retry_if_exception(_is_retryable),
            reraise=True,
            before_sleep=lambda rs: logger.warning(
                "s3 %s %s attempt %d failed (%s); retrying", op, key, rs.attempt_number,
                rs.outcome.exception() if rs.outcome else None,
            ),
        )
        try:
            return retrying(attempt)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NoSuchUpload", "NotFound"):
                raise ObjectNotFoundError(
                    f"s3 {op} s3://{self.bucket}/{self._k(key)}: {code}", op=op, key=key
                ) from exc
            raise StorageError(
                f"s3 {op} s3://{self.bucket}/{self._k(key)} failed: {exc}",
                op=op, key=key, retryable=_is_retryable(exc),
            ) from exc
        except BotoCoreError as exc:
            raise StorageError(
                f"s3 {op} s3://{self.bucket}/{self._k(key)} failed after {self._max_attempts} "
                f"attempts: {exc} (endpoint {self.endpoint_url or 'AWS'})",
                op=op, key=key, retryable=_is_retryable(exc),
            ) from exc

    # -- objects
    def put_bytes(self, key: str, data: bytes, *, content_type: str | None = None) -> None:
        extra = {"ContentType": content_type} if content_type else {}
        self._call(
            "put", key,
            lambda: self._client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, **extra),
            nbytes=len(data),
        )

    def get_bytes(self, key: str) -> bytes:
        def get() -> bytes:
            body = self._client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"]
            return bytes(body.read())

        return self._call("get", key, get)

    def download_to(self, key: str, path: Path) -> None:
        def get() -> None:
            body = self._client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"]
            tmp = path.with_name(path.name + ".part")
            with open(tmp, "wb") as f:
                for chunk in body.iter_chunks(1 << 20):
                    f.write(chunk)
            os.replace(tmp, path)

        self._call("download", key, get)

    def exists(self, key: str) -> bool:
        try:
            self._call("head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=self._k(key)))
        except ObjectNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        head = self._call("head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=self._k(key)))
        return int(head["ContentLength"])

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=self._k(key)))

    def list(self, prefix: str) -> builtins.list[str]:
        full = self.base_prefix + prefix

        def run() -> builtins.list[str]:
            out: builtins.list[str] = []
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                out.extend(obj["Key"][len(self.base_prefix):] for obj in page.get("Contents", []))
            return sorted(out)

        return self._call("list", prefix, run)

    def presign_get(self, key: str, expires_s: int = 3600) -> str:
        return str(
            self._client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self._k(key)}, ExpiresIn=expires_s
            )
        )

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._k(key)}"

    # -- multipart
    def create_multipart(self, key: str, *, content_type: str | None = None) -> str:
        extra = {"ContentType": content_type} if content_type else {}
        resp = self._call(
            "create_multipart", key,
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=self._k(key), **extra),
        )
        return str(resp["UploadId"])

    def upload_part(self, key: str, upload_id: str, part_number: int, data: bytes) -> str:
        resp = self._call(
            f"upload_part#{part_number}", key,
            lambda: self._client.upload_part(
                Bucket=self.bucket, Key=self._k(key), UploadId=upload_id, PartNumber=part_number, Body=data
            ),
            nbytes=len(data),
        )
        return str(resp["ETag"])

    def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        spec = {"Parts": [{"PartNumber": n, "ETag": e} for n, e in parts]}
        self._call(
            "complete_multipart", key,
            lambda: self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=self._k(key), UploadId=upload_id, MultipartUpload=spec
            ),
        )

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self._call(
            "abort_multipart", key,
            lambda: self._client.abort_multipart_upload(Bucket=self.bucket, Key=self._k(key), UploadId=upload_id),
        )

    def list_parts(self, key: str, upload_id: str) -> builtins.list[PartInfo]:
        def run() -> builtins.list[PartInfo]:
            out: builtins.list[PartInfo] = []
            pages = self._client.get_paginator("list_parts").paginate(
                Bucket=self.bucket, Key=self._k(key), UploadId=upload_id
            )
            for page in pages:
                out.extend(
                    PartInfo(int(p["PartNumber"]), str(p["ETag"]), int(p["Size"])) for p in page.get("Parts", [])
                )
            return out

        return self._call("list_parts", key, run)


# --------------------------------------------------------------------------------------------------
# Local directory


class LocalObjectStore:
    """Objects as files under ``root`` (the embedded default on a laptop). Writes are atomic
    (temp file + rename), so a reader never sees half an object. Multipart uploads keep their parts
    under ``root/.multipart/<upload id>/`` until completed or aborted."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._mp_root = self.root / ".multipart"
        self.bytes_sent = 0
        self.num_requests = 0
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        path = (self.root / _check_relative_key(key)).resolve()
        if not path.is_relative_to(self.root):  # defence in depth; the key check already forbids it
            raise ValueError(f"key={key!r} escapes the store root {self.root}")
        return path

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes
            self.num_requests += 1

    def _write_atomic(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def put_bytes(self, key: str, data: bytes, *, content_type: str | None = None) -> None:
        self._count(len(data))
        self._write_atomic(self._path(key), data)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(f"no object {key!r} under {self.root}", op="get", key=key) from exc

    def download_to(self, key: str, path: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise ObjectNotFoundError(f"no object {key!r} under {self.root}", op="download", key=key)
        shutil.copyfile(src, path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str) -> builtins.list[str]:
        out = []
        for p in self.root.rglob("*"):
            rel = p.relative_to(self.root).as_posix()
            if p.is_file() and not rel.startswith(".multipart/") and not p.name.startswith("."):
                if rel.startswith(prefix):
                    out.append(rel)
        return sorted(out)

    def presign_get(self, key: str, expires_s: int = 3600) -> str:
        return self._path(key).as_uri()

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()

    def _upload_dir(self, key: str, upload_id: str, op: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", upload_id):
            raise ObjectNotFoundError(f"upload_id={upload_id!r} is not an upload of this store", op=op, key=key)
        d = self._mp_root / upload_id
        if not (d / "key").is_file() or (d / "key").read_text() != key:
            raise ObjectNotFoundError(f"no multipart upload {upload_id} for {key!r}", op=op, key=key)
        return d

    def create_multipart(self, key: str, *, content_type: str | None = None) -> str:
        self._path(key)
        upload_id = uuid.uuid4().hex
        d = self._mp_root / upload_id
        d.mkdir(parents=True)
        (d / "key").write_text(key)
        return upload_id

    def upload_part(self, key: str, upload_id: str, part_number: int, data: bytes) -> str:
        if not 1 <= part_number <= 10000:
            raise ValueError(f"part_number={part_number} must be in 1..10000")
        d = self._upload_dir(key, upload_id, "upload_part")
        self._count(len(data))
        self._write_atomic(d / f"{part_number:05d}.part", data)
        return '"' + hashlib.md5(data).hexdigest() + '"'

    def list_parts(self, key: str, upload_id: str) -> builtins.list[PartInfo]:
        d = self._upload_dir(key, upload_id, "list_parts")
        out = []
        for p in sorted(d.glob("*.part")):
            data = p.read_bytes()
            out.append(PartInfo(int(p.stem), '"' + hashlib.md5(data).hexdigest() + '"', len(data)))
        return out

    def complete_multipart(self, key: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        d = self._upload_dir(key, upload_id, "complete_multipart")
        have = {p.part_number: p.etag for p in self.list_parts(key, upload_id)}
        for n, etag in parts:
            if have.get(n) != etag:
                raise StorageError(
                    f"complete_multipart {key!r}: part {n} etag {etag} does not match the stored part "
                    f"({have.get(n)})", op="complete_multipart", key=key, retryable=False,
                )
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{upload_id}.tmp")
        with open(tmp, "wb") as out:
            for n, _ in parts:
                with open(d / f"{n:05d}.part", "rb") as src:
                    shutil.copyfileobj(src, out)
        os.replace(tmp, dest)
        shutil.rmtree(d)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        shutil.rmtree(self._upload_dir(key, upload_id, "abort_multipart"))


# --------------------------------------------------------------------------------------------------


def open_object_store(
    url: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    max_attempts: int = 5,
    read_timeout_s: float = 30.0,
) -> ObjectStore:
    """Open ``s3://bucket[/prefix]`` (AWS, MinIO, moto_server … via ``endpoint_url``) or
    ``file:///abs/dir`` (created if missing)."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"object store url={url!r} has no bucket; use s3://bucket/prefix")
        return S3ObjectStore(
            parsed.netloc, base_prefix=parsed.path, endpoint_url=endpoint_url, region=region,
            access_key_id=access_key_id, secret_access_key=secret_access_key,
            max_attempts=max_attempts, read_timeout_s=read_timeout_s,
        )
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise ValueError(f"object store url={url!r}: use file:///absolute/dir")
        return LocalObjectStore(Path(parsed.path))
    raise ValueError(f"object store url={url!r}: scheme must be s3:// or file:// (got {parsed.scheme!r})")

