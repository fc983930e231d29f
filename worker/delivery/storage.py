"""Opens the object store a URL names: S3 (any endpoint) or a local directory.

Who calls what: the task, the API and the delivery open a store with :func:`open_object_store`
(from ``Settings``) and name objects with :mod:`worker.delivery.keys`. The interface is
:class:`worker.delivery.object_store.ObjectStore`; the implementations are
:class:`worker.delivery.s3_store.S3ObjectStore` and
:class:`worker.delivery.local_store.LocalObjectStore`. Every failure surfaces as
:class:`worker.errors.StorageError` whose ``retryable`` says whether a later attempt may succeed.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from worker.delivery.local_store import LocalObjectStore
from worker.delivery.object_store import ObjectStore
from worker.delivery.s3_store import S3ObjectStore


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
