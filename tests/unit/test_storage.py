"""Key hygiene, retry classification and the local-directory store (no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from worker.delivery.keys import job_prefix, safe_key
from worker.delivery.local_store import LocalObjectStore
from worker.delivery.s3_store import _is_retryable
from worker.delivery.storage import open_object_store
from worker.errors import ObjectNotFoundError, StorageError

PREFIX = "tenants/acme/jobs/0b9c6f3e-6d1a-4a57-9d43-2b0b7f1c9e11/"


def test_job_prefix_layout() -> None:
    assert job_prefix("acme", "0b9c6f3e-6d1a-4a57-9d43-2b0b7f1c9e11") == PREFIX


@pytest.mark.parametrize(
    ("tenant", "job"),
    [("..", "j"), ("a/b", "j"), ("acme", "../x"), ("", "j"), ("acme", ""), ("a..b", "j"), ("acme", "j%2f"),
     (".hidden", "j"), ("acme", "j\x00"), ("acme", "é"), ("acme", "x" * 200)],
)
def test_job_prefix_rejects_bad_ids(tenant: str, job: str) -> None:
    with pytest.raises(ValueError, match="not a valid id"):
        job_prefix(tenant, job)


@pytest.mark.parametrize(
    "name",
    ["../other/final.mp4", "a/../../x", "/etc/passwd", "//x", "a//b", ".", "..", "./x", "x/.",
     "%2e%2e/x", "..%2fx", "%252e%252e%252fx", "a\\..\\b", "..\\x", "x\x00y", "seg\n1", "",
     "a/ ../b", " ", "é/x", "C:\\x", "~/x", "x/.."],
)
def test_safe_key_rejects_escapes(name: str) -> None:
    with pytest.raises(ValueError):
        safe_key(PREFIX, name)


@pytest.mark.parametrize("name", ["final.mp4", "seg_00001.m4s", "hls/index.m3u8", "state_00001.bin", "a.b.c"])
def test_safe_key_accepts_plain_names(name: str) -> None:
    key = safe_key(PREFIX, name)
    assert key == PREFIX + name and key.startswith(PREFIX)


def test_safe_key_needs_a_slash_terminated_safe_prefix() -> None:
    with pytest.raises(ValueError, match="must end with '/'"):
        safe_key("tenants/acme", "x")
    with pytest.raises(ValueError):
        safe_key("/abs/", "x")
    with pytest.raises(ValueError):
        safe_key("tenants/../", "x")


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


def test_retry_classification() -> None:
    assert _is_retryable(_client_error("SlowDown", 503))
    assert _is_retryable(_client_error("InternalError", 500))
    assert _is_retryable(_client_error("Throttling", 400))
    assert _is_retryable(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert _is_retryable(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert not _is_retryable(_client_error("AccessDenied", 403))
    assert not _is_retryable(_client_error("InvalidAccessKeyId", 403))
    assert not _is_retryable(_client_error("SignatureDoesNotMatch", 403))
    assert not _is_retryable(_client_error("NoSuchKey", 404))
    assert not _is_retryable(ValueError("x"))


def test_local_store_roundtrip_and_confinement(tmp_path: Path) -> None:
    store = open_object_store(f"file://{tmp_path}/objects")
    assert isinstance(store, LocalObjectStore)
    key = safe_key(PREFIX, "final.mp4")
    store.put_bytes(key, b"hello")
    assert store.exists(key) and store.get_bytes(key) == b"hello"
    assert store.list("tenants/acme/") == [key]
    assert store.uri(key).startswith("file://") and store.uri(key).endswith(key)
    dest = tmp_path / "copy"
    store.download_to(key, dest)
    assert dest.read_bytes() == b"hello"
    store.delete(key)
    assert not store.exists(key)
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes(key)
    for bad in ("../escape", "/etc/passwd", "a/../../b"):
        with pytest.raises(ValueError):
            store.put_bytes(bad, b"x")
    assert not (tmp_path / "escape").exists()


def test_local_store_multipart(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    key = "t/final.mp4"
    upload = store.create_multipart(key)
    e1 = store.upload_part(key, upload, 1, b"abc")
    e2 = store.upload_part(key, upload, 2, b"de")
    assert [(p.part_number, p.etag, p.size) for p in store.list_parts(key, upload)] == [(1, e1, 3), (2, e2, 2)]
    assert not store.exists(key)
    with pytest.raises(StorageError, match="etag"):
        store.complete_multipart(key, upload, [(1, e2)])
    store.complete_multipart(key, upload, [(1, e1), (2, e2)])
    assert store.get_bytes(key) == b"abcde"
    with pytest.raises(ObjectNotFoundError):
        store.list_parts(key, upload)
    with pytest.raises(ObjectNotFoundError):
        store.upload_part(key, "../../x", 1, b"x")


def test_open_object_store_rejects_bad_urls() -> None:
    for url in ("http://x/y", "s3:///nobucket", "file://relative/dir", "ftp://a"):
        with pytest.raises(ValueError):
            open_object_store(url)
