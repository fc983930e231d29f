"""Hostile requests against the API on real servers (issue 17 items 8-11): every one is a 4xx naming
the field, never a 5xx, and leaves no row in PostgreSQL and no message in Redis.

- confused deputy (item 8): another tenant's upload or outputs named by key in a real S3 job store
  (moto_server), other buckets, ungranted prefixes: refused at submit, and refused again by a real
  ``JobWorker`` before it downloads anything (rows written behind the API's back);
- the front door (item 9): an unauthenticated 200 MB body is answered 401 before a byte of it is
  read (the answer arrives while the client has sent only the headers; the server's peak RSS does
  not move), bodies are bounded (413), each token is rate-limited (429 + Retry-After);
- strict parsing (item 10) and bad media (item 11): :data:`HOSTILE` — one row per request, the
  expected status and the field the answer must name. Set ``LONGTAKE_HOSTILE_REPORT=path.json`` to
  get the table of what was sent and answered.

Fixtures come from ``test_api.py`` (its database and queue per test process, its uvicorn server).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import test_api as base
from test_api import TOKEN_A, TOKEN_B, Api, _finish_job, _serve

from tests.integration import api_media
from tests.integration.s3_fixtures import ACCESS_KEY, REGION, SECRET_KEY, MotoServer
from worker.api.app import create_app
from worker.delivery.keys import job_prefix, upload_key
from worker.jobs.queue import create_celery_app
from worker.jobs.store import JobStore
from worker.jobs.tasks import JobWorker
from worker.settings import Settings
from worker.spec import JobSpec

pytestmark = pytest.mark.integration

# test_api's fixtures: its database and queue per test process, its uvicorn server, its cleaning
pg_engine, api, moto_s3, _clean = base.pg_engine, base.api, base.moto_s3, base._clean

AUTH_A = {"Authorization": f"Bearer {TOKEN_A}"}
AUTH_B = {"Authorization": f"Bearer {TOKEN_B}"}
GOOD = {"image": "s3://inputs-bucket/faces/a.png", "audio": "s3://inputs-bucket/speech/a.wav"}


def _rgba_translucent() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGBA", (96, 96), (200, 10, 10, 128)).save(out, "PNG")
    return out.getvalue()


# ---------------------------------------------------------------------------------------------- the table


@dataclass
class Hostile:
    """One hostile request: how to send it, the status expected, the field the answer must name."""

    id: str
    status: int
    field: str
    send: Callable[[Api], httpx.Response]
    notes: str = ""
    tags: list[str] = field(default_factory=list)


def _json(spec: object, token: str = TOKEN_A) -> Callable[[Api], httpx.Response]:
    return lambda api: httpx.post(
        f"{api.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )


def _raw(
    method: str, path: str, *, headers: dict[str, str] | None = None, content: Any = None, **kw: Any
) -> Callable[[Api], httpx.Response]:
    return lambda api: httpx.request(
        method, api.url + path, headers=headers or {}, content=content, timeout=30, **kw
    )


def _multipart(
    spec: dict[str, object] | None = None,
    files: dict[str, tuple[str, bytes, str]] | list[tuple[str, tuple[str, bytes, str]]] | None = None,
    *,
    spec_raw: str | None = None,
    path: str = "/v1/jobs/upload",
) -> Callable[[Api], httpx.Response]:
    def send(api: Api) -> httpx.Response:
        data = {} if spec is None and spec_raw is None else {"spec": spec_raw or json.dumps(spec)}
        return httpx.post(api.url + path, data=data, files=files, headers=AUTH_A, timeout=30)

    return send


def _upload_then_submit(
    field: str, content: bytes, name: str, ctype: str = "application/octet-stream"
) -> Callable[[Api], httpx.Response]:
    """POST /v1/uploads (accepted: the kind is not known yet), then a JSON submit naming it."""

    def send(api: Api) -> httpx.Response:
        up = httpx.post(f"{api.url}/v1/uploads", files={"file": (name, content, ctype)}, headers=AUTH_A)
        assert up.status_code == 201, up.text
        spec = dict(GOOD, **{field: up.json()["uri"]})
        resp = httpx.post(f"{api.url}/v1/jobs", json=spec, headers=AUTH_A)
        for key in api.objects.list("tenants/"):  # the upload itself is legitimate; count only jobs
            api.objects.delete(key)
        return resp

    return send


def _other_tenants_upload(api: Api) -> httpx.Response:
    up = httpx.post(
        f"{api.url}/v1/uploads", files={"file": ("a.png", api_media.png(), "image/png")}, headers=AUTH_B
    )
    resp = httpx.post(f"{api.url}/v1/jobs", json=dict(GOOD, image=up.json()["uri"]), headers=AUTH_A)
    for key in api.objects.list("tenants/"):
        api.objects.delete(key)
    return resp


def _nested(depth: int) -> str:
    return '{"image": "s3://inputs-bucket/a.png", "audio": "s3://inputs-bucket/a.wav", "x": ' + (
        "[" * depth + "]" * depth + "}"
    )


PNG, WAV = api_media.png(), api_media.wav()
IMG = ("face.png", PNG, "image/png")
AUD = ("speech.wav", WAV, "audio/wav")
JSON_CT = {**AUTH_A, "Content-Type": "application/json"}
BIG = 64 * 1024 + 1  # over the fixture's upload_max_bytes

HOSTILE: list[Hostile] = [
    # --- authentication (item 9): 401 before the body, on every body-carrying route
    Hostile("no-token-submit", 401, "Authorization", _raw("POST", "/v1/jobs", content=json.dumps(GOOD))),
    Hostile("no-token-uploads", 401, "Authorization", _raw("POST", "/v1/uploads", files={"file": IMG})),
    Hostile("no-token-multipart", 401, "Authorization", _raw("POST", "/v1/jobs/upload", files={"image": IMG})),
    Hostile(
        "bad-token-uploads",
        401,
        "token",
        _raw("POST", "/v1/uploads", headers={"Authorization": "Bearer not-a-token-at-all"}, files={"file": IMG}),
    ),
    Hostile("basic-scheme", 401, "Authorization", _raw("POST", "/v1/jobs", headers={"Authorization": f"Basic {TOKEN_A}"})),
    Hostile("empty-bearer", 401, "Authorization", _raw("POST", "/v1/jobs", headers={"Authorization": "Bearer"})),
    Hostile("token-prefix", 401, "token", _raw("POST", "/v1/jobs", headers={"Authorization": f"Bearer {TOKEN_A[:-1]}"})),
    Hostile("no-token-list", 401, "Authorization", _raw("GET", "/v1/jobs")),
    Hostile("no-token-cancel", 401, "Authorization", _raw("POST", f"/v1/jobs/{uuid.uuid4()}/cancel")),
    # --- body bounds (item 9)
    Hostile("json-over-limit", 413, "(body)", _raw("POST", "/v1/jobs", headers=JSON_CT, content=b" " * 300_000)),
    Hostile(
        "json-chunked-over-limit",
        413,
        "(body)",
        _raw("POST", "/v1/jobs", headers=JSON_CT, content=iter([b" " * 65536] * 5)),
    ),
    Hostile(
        "uploads-over-limit",
        413,
        "(body)",
        _raw("POST", "/v1/uploads", headers={**AUTH_A, "Content-Length": str(3 * 1024 * 1024), "Content-Type": "multipart/form-data; boundary=x"}, content=b"x" * (3 * 1024 * 1024)),
    ),
    Hostile("multipart-file-over-limit", 413, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("big.png", PNG[:8] + b"0" * BIG, "image/png")})),
    Hostile("uploads-file-over-limit", 413, "file", _multipart(None, {"file": ("big.png", b"0" * BIG, "image/png")}, path="/v1/uploads")),
    # --- content types (item 10)
    Hostile("json-as-text-plain", 415, "Content-Type", _raw("POST", "/v1/jobs", headers={**AUTH_A, "Content-Type": "text/plain"}, content=json.dumps(GOOD))),
    Hostile("json-as-form-urlencoded", 415, "Content-Type", _raw("POST", "/v1/jobs", headers=AUTH_A, data=GOOD)),
    Hostile("json-without-content-type", 415, "Content-Type", _raw("POST", "/v1/jobs", headers=AUTH_A, content=json.dumps(GOOD))),
    Hostile("multipart-to-json-route", 415, "Content-Type", _raw("POST", "/v1/jobs", headers=AUTH_A, files={"image": IMG})),
    Hostile("json-to-multipart-route", 415, "Content-Type", _raw("POST", "/v1/jobs/upload", headers=JSON_CT, content=json.dumps(GOOD))),
    Hostile("form-urlencoded-to-multipart-route", 415, "Content-Type", _raw("POST", "/v1/jobs/upload", headers=AUTH_A, data={"spec": json.dumps(GOOD)})),
    Hostile("json-to-uploads", 415, "Content-Type", _raw("POST", "/v1/uploads", headers=JSON_CT, content=b"{}")),
    # --- JSON shape (item 10)
    Hostile("invalid-json", 400, "(body)", _raw("POST", "/v1/jobs", headers=JSON_CT, content=b"{not json")),
    Hostile("nested-100000", 400, "(body)", _raw("POST", "/v1/jobs", headers=JSON_CT, content=("[" * 100_000 + "]" * 100_000).encode())),
    Hostile("nested-100000-in-field", 400, "(body)", _raw("POST", "/v1/jobs", headers=JSON_CT, content=_nested(100_000).encode())),
    Hostile("nested-200", 400, "(body)", _raw("POST", "/v1/jobs", headers=JSON_CT, content=_nested(200).encode())),
    Hostile("json-array", 422, "(body)", _json([GOOD])),
    Hostile("json-string", 422, "(body)", _json("s3://inputs-bucket/a.png")),
    Hostile("json-null", 422, "(body)", _raw("POST", "/v1/jobs", headers=JSON_CT, content=b"null")),
    Hostile("empty-body", 422, "(body)", _raw("POST", "/v1/jobs", headers=JSON_CT, content=b"")),
    # --- strict types (item 10)
    Hostile("seed-string", 422, "seed", _json(dict(GOOD, seed="7"))),
    Hostile("seed-true", 422, "seed", _json(dict(GOOD, seed=True))),
    Hostile("seed-float", 422, "seed", _json(dict(GOOD, seed=7.0))),
    Hostile("seed-nan", 422, "seed", _raw("POST", "/v1/jobs", headers=JSON_CT, content=json.dumps(GOOD)[:-1].encode() + b', "seed": NaN}')),
    Hostile("seed-2**63", 422, "seed", _json(dict(GOOD, seed=2**63))),
    Hostile("seed-negative", 422, "seed", _json(dict(GOOD, seed=-1))),
    Hostile("seed-list", 422, "seed", _json(dict(GOOD, seed=[7]))),
    Hostile("priority-string", 422, "priority", _json(dict(GOOD, priority="9"))),
    Hostile("priority-10", 422, "priority", _json(dict(GOOD, priority=10))),
    Hostile("text-over-limit", 422, "text", _json(dict(GOOD, text="x" * 2001))),
    Hostile("text-nul", 422, "text", _json(dict(GOOD, text="a\x00b"))),
    Hostile("text-list", 422, "text", _json(dict(GOOD, text=["a"]))),
    Hostile("preview-hls-string", 422, "preview.hls", _json(dict(GOOD, preview={"hls": "yes"}))),
    Hostile("preview-hls-int", 422, "preview.hls", _json(dict(GOOD, preview={"hls": 1}))),
    Hostile("kvs-bad-region", 422, "region", _json(dict(GOOD, preview={"kvs": {"stream_name": "s", "region": "mars"}}))),
    Hostile("kvs-bad-stream", 422, "stream_name", _json(dict(GOOD, preview={"kvs": {"stream_name": "a b", "region": "us-east-1"}}))),
    Hostile("output-container-mkv", 422, "output.container", _json(dict(GOOD, output={"container": "mkv"}))),
    Hostile("output-keep-string", 422, "output.keep_segments", _json(dict(GOOD, output={"keep_segments": "false"}))),
    Hostile("unknown-field", 422, "colour", _json(dict(GOOD, colour="red"))),
    Hostile("unknown-nested-field", 422, "colour", _json(dict(GOOD, preview={"hls": True, "colour": 1}))),
    Hostile("tenant-in-spec", 422, "tenant", _json(dict(GOOD, tenant="tenant-b"))),
    Hostile("idempotency-key-space", 422, "idempotency_key", _json(dict(GOOD, idempotency_key="a b"))),
    Hostile("idempotency-key-long", 422, "idempotency_key", _json(dict(GOOD, idempotency_key="k" * 200))),
    Hostile("idempotency-key-int", 422, "idempotency_key", _json(dict(GOOD, idempotency_key=42))),
    Hostile("family-unknown", 422, "family", _json(dict(GOOD, family="sora"))),
    Hostile("preset-unknown", 422, "preset", _json(dict(GOOD, preset="huge"))),
    Hostile("preset-of-other-family", 422, "preset", _json(dict(GOOD, family="tiny", preset="infinitetalk"))),
    Hostile("preset-uppercase", 422, "preset", _json(dict(GOOD, preset="TINY"))),
    Hostile("option-out-of-bounds", 422, "options.steps", _json(dict(GOOD, options={"steps": 10**30}))),
    Hostile("option-nested", 422, "options.steps", _json(dict(GOOD, options={"steps": {"$gt": 1}}))),
    Hostile("option-unknown-key", 422, "options.__class__", _json(dict(GOOD, options={"__class__": 1}))),
    Hostile("options-not-object", 422, "options", _json(dict(GOOD, options="steps=3"))),
    Hostile("image-missing", 422, "image", _json({"audio": GOOD["audio"]})),
    Hostile("audio-missing", 422, "audio", _json({"image": GOOD["image"]})),
    Hostile("image-int", 422, "image", _json(dict(GOOD, image=7))),
    Hostile("image-empty", 422, "image", _json(dict(GOOD, image=""))),
    # --- input URIs (item 8 and the spec's syntax rules)
    Hostile("image-http", 422, "image", _json(dict(GOOD, image="http://169.254.169.254/latest/meta-data"))),
    Hostile("image-ftp", 422, "image", _json(dict(GOOD, image="ftp://example.com/a.png"))),
    Hostile("image-bare-name", 422, "image", _json(dict(GOOD, image="face.png"))),
    Hostile("s3-bad-bucket", 422, "image", _json(dict(GOOD, image="s3://Bad_Bucket/a.png"))),
    Hostile("s3-no-key", 422, "image", _json(dict(GOOD, image="s3://inputs-bucket/"))),
    Hostile("s3-dotdot", 422, "audio", _json(dict(GOOD, audio="s3://inputs-bucket/speech/../../secret.wav"))),
    Hostile("s3-encoded-dotdot", 422, "audio", _json(dict(GOOD, audio="s3://inputs-bucket/speech/%2e%2e/%2e%2e/x.wav"))),
    Hostile("s3-query", 422, "image", _json(dict(GOOD, image="s3://inputs-bucket/a.png?versionId=1"))),
    Hostile("uri-3000-chars", 422, "image", _json(dict(GOOD, image="s3://inputs-bucket/" + "a" * 3000))),
    Hostile("file-outside-root", 422, "image", _json(dict(GOOD, image="file:///etc/passwd"))),
    Hostile("file-dotdot", 422, "image", _json(dict(GOOD, image="file:///srv/in/../../etc/passwd"))),
    Hostile("file-remote-host", 422, "image", _json(dict(GOOD, image="file://evil.example/etc/passwd"))),
    Hostile("upload-dotdot", 422, "image", _json(dict(GOOD, image="upload://../../tenant-b/uploads/x"))),
    Hostile("upload-short-id", 422, "image", _json(dict(GOOD, image="upload://short"))),
    Hostile("upload-unknown-id", 422, "image", _json(dict(GOOD, image="upload://" + "f" * 32))),
    Hostile("upload-of-other-tenant", 422, "image", _other_tenants_upload),
    Hostile("s3-other-bucket", 403, "image", _json(dict(GOOD, image="s3://other-bucket/faces/a.png"))),
    Hostile("s3-bucket-name-prefix-trick", 403, "image", _json(dict(GOOD, image="s3://inputs-bucket-evil/a.png"))),
    Hostile("s3-other-tenants-grant", 403, "image", _json(dict(GOOD, image="s3://assets-a/faces/a.png"), TOKEN_B)),
    Hostile("s3-outside-granted-prefix", 403, "image", _json(dict(GOOD, image="s3://assets-a/private/a.png"))),
    # --- multipart parts (item 10)
    Hostile("extra-file-part", 422, "evil", _multipart({"audio": GOOD["audio"]}, {"image": IMG, "evil": ("x.sh", b"#!/bin/sh", "application/octet-stream")})),
    Hostile("extra-field-part", 422, "tenant", _multipart({"audio": GOOD["audio"]}, [("image", IMG), ("tenant", ("t", b"tenant-b", "text/plain"))])),
    Hostile("image-part-text-html", 422, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("face.png", b"<script>alert(1)</script>", "text/html")})),
    Hostile("audio-part-text-plain", 422, "audio", _multipart({"image": GOOD["image"]}, {"audio": ("a.wav", WAV, "text/plain")})),
    Hostile("image-part-twice", 422, "image", _multipart({"audio": GOOD["audio"]}, [("image", IMG), ("image", IMG)])),
    Hostile("spec-as-file-part", 422, "spec", _multipart(None, [("spec", ("spec.json", json.dumps(GOOD).encode(), "application/json")), ("image", IMG)])),
    Hostile("both-in-spec-and-file", 422, "image", _multipart(GOOD, {"image": IMG})),
    Hostile("multipart-spec-not-json", 400, "spec", _multipart(None, {"image": IMG}, spec_raw="{nope")),
    Hostile("multipart-spec-nested", 400, "spec", _multipart(None, {"image": IMG}, spec_raw=_nested(100_000))),
    Hostile("multipart-seed-string", 422, "seed", _multipart({"audio": GOOD["audio"], "seed": "7"}, {"image": IMG})),
    Hostile(
        "multipart-2000-fields",
        400,
        "(body)",
        _raw("POST", "/v1/jobs/upload", headers=AUTH_A, files=[(f"f{i}", ("", b"x", "text/plain")) for i in range(1001)] + [("image", IMG)]),
    ),
    Hostile(
        "multipart-malformed",
        422,
        "image",
        _raw("POST", "/v1/jobs/upload", headers={**AUTH_A, "Content-Type": "multipart/form-data; boundary=zz"}, content=b"--zz\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n\r\nabc"),
    ),
    Hostile("uploads-extra-part", 422, "other", _multipart(None, {"file": IMG, "other": IMG}, path="/v1/uploads")),
    Hostile("uploads-text-html", 422, "file", _multipart(None, {"file": ("a.html", b"<html>", "text/html")}, path="/v1/uploads")),
    Hostile("uploads-empty-file", 422, "file", _multipart(None, {"file": ("a.png", b"", "image/png")}, path="/v1/uploads")),
    # --- media probed at submit (item 11)
    Hostile("text-named-png", 422, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("face.png", b"hello, I am text", "image/png")})),
    Hostile("truncated-png", 422, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("face.png", api_media.truncated_png(), "image/png")})),
    Hostile("png-1x1", 422, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("face.png", api_media.png(1, 1), "image/png")})),
    Hostile("png-20000x20000", 422, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("face.png", api_media.huge_png_header(), "image/png")})),
    Hostile("cmyk-jpeg", 422, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("face.jpg", api_media.cmyk_jpeg(), "image/jpeg")})),
    Hostile("png-16-bit", 422, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("face.png", api_media.png16(), "image/png")})),
    Hostile("png-translucent", 422, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("face.png", _rgba_translucent(), "image/png")})),
    Hostile("wav-as-image", 422, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("face.png", WAV, "image/png")})),
    Hostile("empty-image", 422, "image", _multipart({"audio": GOOD["audio"]}, {"image": ("face.png", b"", "image/png")})),
    Hostile("empty-wav", 422, "audio", _multipart({"image": GOOD["image"]}, {"audio": ("a.wav", api_media.wav(0), "audio/wav")})),
    Hostile("corrupt-wav", 422, "audio", _multipart({"image": GOOD["image"]}, {"audio": ("a.wav", api_media.corrupt_wav(), "audio/wav")})),
    Hostile("png-as-audio", 422, "audio", _multipart({"image": GOOD["image"]}, {"audio": ("a.wav", PNG, "audio/wav")})),
    Hostile("audio-over-max-duration", 422, "audio", _multipart({"image": GOOD["image"]}, {"audio": ("a.wav", api_media.wav(12.0, rate=1000), "audio/wav")})),
    Hostile("uploaded-text-as-image", 422, "image", _upload_then_submit("image", b"just text", "face.png")),
    Hostile("uploaded-wav-as-image", 422, "image", _upload_then_submit("image", WAV, "face.png")),
    Hostile("uploaded-png-as-audio", 422, "audio", _upload_then_submit("audio", PNG, "a.wav")),
    Hostile("uploaded-1x1-image", 422, "image", _upload_then_submit("image", api_media.png(1, 1), "face.png")),
    # --- other routes
    Hostile("list-limit-0", 422, "limit", _raw("GET", "/v1/jobs?limit=0", headers=AUTH_A)),
    Hostile("list-limit-text", 422, "limit", _raw("GET", "/v1/jobs?limit=lots", headers=AUTH_A)),
    Hostile("list-bad-status", 422, "status", _raw("GET", "/v1/jobs?status=done", headers=AUTH_A)),
    Hostile("list-bad-before", 422, "before", _raw("GET", "/v1/jobs?before=yesterday", headers=AUTH_A)),
    Hostile("job-id-traversal", 404, "(path)", _raw("GET", "/v1/jobs/..%2F..%2Fetc", headers=AUTH_A)),
    Hostile("preview-link-bad-sig", 403, "preview link", _raw("GET", f"/v1/jobs/{uuid.uuid4()}/preview.m3u8?exp=9999999999&sig=00")),
    Hostile("preview-link-exp-text", 422, "exp", _raw("GET", f"/v1/jobs/{uuid.uuid4()}/preview.m3u8?exp=soon&sig=00")),
]

_REPORT: list[dict[str, object]] = []


@pytest.fixture(scope="module", autouse=True)
def _hostile_report() -> Iterator[None]:
    yield
    path = os.environ.get("LONGTAKE_HOSTILE_REPORT")
    if path and _REPORT:
        Path(path).write_text(json.dumps(_REPORT, indent=1))


def _names_field(body: dict[str, Any], name: str) -> bool:
    return name in str(body.get("message", "")) or any(
        name in str(e.get("field", "")) for e in body.get("errors", [])
    )


@pytest.mark.parametrize("case", HOSTILE, ids=[h.id for h in HOSTILE])
def test_hostile_request_is_4xx_naming_the_field_and_queues_nothing(api: Api, case: Hostile) -> None:
    resp = case.send(api)
    try:
        body = resp.json()
    except ValueError:  # a bare 500 "Internal Server Error" is not JSON
        body = {}
    rows, queued = api.job_rows(), api.queue_len()
    _REPORT.append(
        {"id": case.id, "status": resp.status_code, "error": body.get("error"), "field": case.field,
         "field_named": _names_field(body, case.field), "rows": rows, "queued": queued,
         "message": str(body.get("message"))[:200]}
    )  # fmt: skip
    assert resp.status_code == case.status, resp.text[:500]
    assert isinstance(body.get("message"), str) and body.get("error"), body
    assert _names_field(body, case.field), body
    assert str(api.file_root) not in resp.text and "/tmp/" not in resp.text, resp.text  # no server path
    assert (rows, queued) == (0, 0)


def test_hostile_table_covers_the_issue(api: Api) -> None:
    assert len(HOSTILE) >= 97 and len({h.id for h in HOSTILE}) == len(HOSTILE)


# ---------------------------------------------------------------------------------------------- item 8


@pytest.fixture
def s3_api(api: Api, moto_s3: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Api, str]]:
    """The API with its job store on real S3 (moto_server) and a careless operator who granted
    tenant-b the whole job bucket: the grant must still not reach tenant-a's objects."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    bucket = moto_s3.make_bucket()
    moto_s3.make_bucket("other-bucket")
    moto_s3.client().put_object(Bucket="other-bucket", Key="faces/a.png", Body=api_media.png())
    settings = api.settings.model_copy(
        update={
            "object_store_url": f"s3://{bucket}",
            "s3_endpoint_url": moto_s3.endpoint_url,
            "input_grants": {"*": ["s3://inputs-bucket/"], "tenant-b": [f"s3://{bucket}/"]},
        }
    )
    store = moto_s3.store(bucket)
    app = create_app(settings, engine=api.engine, objects=store, celery=create_celery_app(settings))
    server, thread, url = _serve(app)
    try:
        yield Api(url, settings, api.engine, store, api.redis, api.store, api.file_root), bucket
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_no_cross_tenant_or_cross_bucket_input_at_submit(s3_api: tuple[Api, str]) -> None:
    api, bucket = s3_api
    up = httpx.post(
        f"{api.url}/v1/uploads", files={"file": ("a.png", api_media.png(), "image/png")}, headers=AUTH_A
    )
    upload_id = up.json()["uri"].removeprefix("upload://")
    job = httpx.post(f"{api.url}/v1/jobs", json=dict(GOOD, image=up.json()["uri"]), headers=AUTH_A).json()
    _finish_job(api, job["id"])  # tenant-a's final.mp4 is now in the job store
    final_key = job_prefix("tenant-a", job["id"]) + "final.mp4"
    assert api.objects.exists(final_key) and api.objects.exists(upload_key("tenant-a", upload_id))
    rows, queued = api.job_rows(), api.queue_len()
    attempts = {
        "upload-id-of-a": (f"upload://{upload_id}", 422),
        "upload-key-of-a": (f"s3://{bucket}/{upload_key('tenant-a', upload_id)}", 403),
        "final-mp4-of-a": (f"s3://{bucket}/{final_key}", 403),
        "other-bucket": ("s3://other-bucket/faces/a.png", 403),
    }
    for name, (uri, status) in attempts.items():
        resp = httpx.post(f"{api.url}/v1/jobs", json=dict(GOOD, image=uri), headers=AUTH_B)
        assert resp.status_code == status, (name, resp.text)
        assert "image" in resp.json()["message"], (name, resp.text)
        assert str(api.file_root) not in resp.text
    assert (api.job_rows(), api.queue_len()) == (rows, queued)  # nothing of tenant-b created or queued


def test_worker_refuses_ungranted_inputs_before_fetching(
    s3_api: tuple[Api, str], tmp_path: Path
) -> None:
    """Rows written behind the API's back (or before a grant was withdrawn): the worker's own check
    fails them without downloading a byte with its credentials."""
    api, bucket = s3_api
    api.objects.put_bytes("tenants/tenant-a/uploads/0123456789abcdef", api_media.png())
    api.objects.put_bytes(f"tenants/tenant-a/jobs/{uuid.uuid4()}/final.mp4", b"tenant-a's video")
    final_key = api.objects.list("tenants/tenant-a/jobs/")[0]
    settings = api.settings.model_copy(update={"work_dir": tmp_path / "work"})
    store = JobStore(api.engine)
    hostile = {
        "upload-key-of-a": f"s3://{bucket}/tenants/tenant-a/uploads/0123456789abcdef",
        "final-mp4-of-a": f"s3://{bucket}/{final_key}",
        "other-bucket": "s3://other-bucket/faces/a.png",
    }
    worker = JobWorker(settings, renderer=_never_render)
    try:
        for name, uri in hostile.items():
            rec = store.create(JobSpec(image=uri, audio="s3://inputs-bucket/speech/a.wav"), tenant="tenant-b")
            assert worker.run(rec.id) == "failed", name
            done = store.get(rec.id)
            assert done is not None and done.status == "failed", name
            assert done.error_code == "invalid_input" and "image" in (done.error_message or ""), name
            assert "granted" in (done.error_message or "") or "another tenant" in (done.error_message or "")
            assert not any(p.is_file() for p in (tmp_path / "work").rglob("*")), name  # nothing fetched
    finally:
        worker.node.close(1.0)


def _never_render(*_args: object, **_kwargs: object) -> object:
    raise AssertionError("a refused input must not reach the renderer")


def test_refusals_and_job_errors_show_no_server_path(api: Api) -> None:
    resp = httpx.post(f"{api.url}/v1/jobs", json=dict(GOOD, image="file:///etc/passwd"), headers=AUTH_A)
    assert resp.status_code == 422 and str(api.file_root) not in resp.text
    job = httpx.post(f"{api.url}/v1/jobs", json=GOOD, headers=AUTH_A).json()
    api.store.fail(
        job["id"],
        code="invalid_input",
        message="reference image '/srv/longtake/work/abc/attempt-1/image.png' is corrupt; re-export it",
    )
    seen = httpx.get(f"{api.url}/v1/jobs/{job['id']}", headers=AUTH_A).json()["error_message"]
    assert seen == "reference image 'image.png' is corrupt; re-export it"


# ---------------------------------------------------------------------------------------------- item 9


def _peak_rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def test_unauthenticated_200mb_body_is_refused_before_it_is_read(api: Api) -> None:
    """The answer arrives while the client has sent the headers only; pushing the 200 MB anyway
    finds the connection closed, and the server (this process) does not grow."""
    total = 200 * 1024 * 1024
    host, port = urlsplit(api.url).hostname, urlsplit(api.url).port
    head = (
        f"POST /v1/jobs/upload HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; "
        f"boundary=b\r\nContent-Length: {total}\r\n\r\n"
    ).encode()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) of this process
    before = _peak_rss_kb()
    sent = 0
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(head)
        answer = sock.recv(65536)  # nothing of the body sent yet
        chunk = b"\0" * (1 << 20)
        try:
            while sent < total:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
    time.sleep(0.2)
    grown_mb = (_peak_rss_kb() - before) / 1024
    print(f"\n200 MB unauthenticated body: client sent {sent / 2**20:.0f} MiB before the server closed; "
          f"server peak RSS grew {grown_mb:.1f} MiB")  # fmt: skip
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert sent < total
    assert grown_mb < 50


def test_uploads_without_a_token_is_401_not_422(api: Api) -> None:
    resp = httpx.post(f"{api.url}/v1/uploads", files={"file": ("a.png", api_media.png(), "image/png")})
    assert resp.status_code == 401 and resp.headers["www-authenticate"].startswith("Bearer")
    empty = httpx.post(f"{api.url}/v1/uploads")  # no body at all: still 401, not "file: required"
    assert empty.status_code == 401


def test_rate_limit_per_token_answers_429_with_retry_after(api: Api) -> None:
    settings = api.settings.model_copy(update={"api_rate_per_s": 0.5, "api_rate_burst": 3})
    app = create_app(settings, engine=api.engine, objects=api.objects, celery=create_celery_app(settings))
    server, thread, url = _serve(app)
    try:
        codes = [httpx.get(f"{url}/v1/jobs", headers=AUTH_A).status_code for _ in range(4)]
        limited = httpx.post(f"{url}/v1/jobs", json=GOOD, headers=AUTH_A)
        other = httpx.get(f"{url}/v1/jobs", headers=AUTH_B)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert codes == [200, 200, 200, 429]
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert "Authorization" in limited.json()["message"] and "per API process" not in limited.json()["error"]
    assert other.status_code == 200  # the bucket is per token
    assert api.job_rows() == 0 and api.queue_len() == 0


# ---------------------------------------------------------------------------------------------- item 11


def test_quotas_jobs_in_flight_and_per_hour_answer_429_naming_the_limit(api: Api) -> None:
    quotas = {"tenant-a": {"jobs_in_flight": 2}, "*": {"submissions_per_hour": 3}}
    settings = api.settings.model_copy(update={"tenant_quotas": Settings(tenant_quotas=quotas).tenant_quotas})
    app = create_app(settings, engine=api.engine, objects=api.objects, celery=create_celery_app(settings))
    server, thread, url = _serve(app)
    try:
        a = [httpx.post(f"{url}/v1/jobs", json=dict(GOOD, idempotency_key=f"k{i}"), headers=AUTH_A) for i in range(3)]
        new_key = httpx.post(f"{url}/v1/jobs", json=dict(GOOD, idempotency_key="k9"), headers=AUTH_A)
        replay = httpx.post(f"{url}/v1/jobs", json=dict(GOOD, idempotency_key="k1"), headers=AUTH_A)
        b = [httpx.post(f"{url}/v1/jobs", json=dict(GOOD, seed=i), headers=AUTH_B) for i in range(4)]
        api.store.fail(a[0].json()["id"], code="test", message="done")  # one slot of tenant-a frees up
        after = httpx.post(f"{url}/v1/jobs", json=dict(GOOD, seed=9), headers=AUTH_A)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert [r.status_code for r in a] == [201, 201, 429]
    assert a[2].json()["error"] == "quota_exceeded" and "jobs_in_flight" in a[2].json()["message"]
    assert int(a[2].headers["retry-after"]) > 0
    assert new_key.status_code == 429  # a new key is a new job
    assert replay.status_code == 200 and replay.json()["id"] == a[1].json()["id"]  # a replay creates nothing
    assert [r.status_code for r in b] == [201, 201, 201, 429]
    assert "submissions_per_hour" in b[3].json()["message"] and int(b[3].headers["retry-after"]) > 0
    assert after.status_code == 201
    assert api.job_rows() == 6 and api.queue_len() == 7  # the replay of a never-claimed job re-sends
