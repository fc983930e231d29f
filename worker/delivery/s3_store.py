"""The S3 object store (AWS, MinIO, moto_server ... through boto3), behind :class:`ObjectStore`.

Retries: :class:`S3ObjectStore` retries throttling, 5xx and connection/timeout errors with tenacity
(bounded attempts, exponential back-off with full jitter). 4xx errors (auth, missing key, bad
request) are raised at once. botocore's own retries are switched off so that tenacity is the only
retrier and attempts are counted in one place. Every failure surfaces as
:class:`worker.errors.StorageError` (:class:`~worker.errors.ObjectNotFoundError` for a missing key).
Built by :func:`worker.delivery.storage.open_object_store`.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from worker.delivery.keys import check_relative_key
from worker.delivery.object_store import PartInfo
from worker.errors import ObjectNotFoundError, StorageError

logger = logging.getLogger(__name__)

T = TypeVar("T")

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
            check_relative_key(self.base_prefix.rstrip("/"), field="base_prefix")
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
        return self.base_prefix + check_relative_key(key)

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
