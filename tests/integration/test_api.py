"""HTTP API + Python client against real PostgreSQL (database ``api_test``), real Redis (db 3) and a
real object store, with the app served by uvicorn on a loopback port.

"Nothing queued" is checked where it lives: the Celery queue lists in Redis (LLEN) and the jobs
table in PostgreSQL. The message of an accepted job is decoded from Redis to check it carries only
the job id.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
import uvicorn
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from tests.integration import api_media, kvs_standin
from tests.integration.s3_fixtures import MotoServer
from worker.api import uploads as api_module
from worker.api.app import create_app
from worker.client import LongtakeAPIError, LongtakeClient
from worker.delivery.keys import job_prefix, upload_key
from worker.delivery.local_store import LocalObjectStore
from worker.delivery.object_store import ObjectStore
from worker.jobs.db import make_engine, migrate
from worker.jobs.queue import RENDER_TASK_NAME, create_celery_app
from worker.jobs.store import JobStore
from worker.settings import Settings

pytestmark = pytest.mark.integration

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
# per test process: two suites on one machine (two checkouts) share the servers, never the data
PG_DB = f"api_test_{os.getpid()}"
PG_URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{PG_DB}"
REDIS_URL = "redis://127.0.0.1:6379/3"
QUEUE = f"longtake-api-test-{os.getpid()}"
TOKEN_A = "token-tenant-a-0123456789"
TOKEN_B = "token-tenant-b-9876543210"
TASK = RENDER_TASK_NAME


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def pg_engine() -> Iterator[Engine]:
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)"))
        conn.execute(text(f"CREATE DATABASE {PG_DB}"))
    admin.dispose()
    migrate(PG_URL)
    engine = make_engine(PG_URL)
    yield engine
    engine.dispose()
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)"))
    admin.dispose()


@dataclass
class Api:
    url: str
    settings: Settings
    engine: Engine
    objects: ObjectStore
    redis: redis.Redis
    store: JobStore
    file_root: Path

    def client(self, token: str = TOKEN_A) -> LongtakeClient:
        return LongtakeClient(self.url, token)

    def queued(self) -> list[dict[str, object]]:
        """Every Celery message waiting in our queue (all priority lists), decoded."""
        out: list[dict[str, object]] = []
        for key in sorted(self.redis.scan_iter(f"{QUEUE}*")):
            if self.redis.type(key) != b"list":
                continue
            for raw in self.redis.lrange(key, 0, -1):
                msg = json.loads(raw)
                body = json.loads(base64.b64decode(msg["body"]))
                out.append({"task": msg["headers"]["task"], "args": body[0], "kwargs": body[1]})
        return out

    def queue_len(self) -> int:
        return sum(
            int(self.redis.llen(k))
            for k in self.redis.scan_iter(f"{QUEUE}*")
            if self.redis.type(k) == b"list"
        )

    def job_rows(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM jobs")).scalar_one())


def _serve(app: object) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def api(pg_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    base = tmp_path_factory.mktemp("api")
    file_root = base / "inputs"
    file_root.mkdir()
    settings = Settings(
        database_url=PG_URL,
        broker_url=REDIS_URL,
        queue_name=QUEUE,
        object_store_url=(base / "objects").as_uri(),
        file_root=file_root,
        api_tokens={TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"},
        upload_max_bytes=64 * 1024,
        input_grants={"*": ["s3://inputs-bucket/"], "tenant-a": ["s3://assets-a/faces/"]},
        max_audio_s=10.0,
        api_rate_per_s=1000.0,
        api_rate_burst=1000,
    )
    objects = LocalObjectStore(base / "objects")
    app = create_app(settings, engine=pg_engine, objects=objects, celery=create_celery_app(settings))
    server, thread, url = _serve(app)
    r = redis.Redis.from_url(REDIS_URL)
    yield Api(url, settings, pg_engine, objects, r, JobStore(pg_engine), file_root)
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(autouse=True)
def _clean(request: pytest.FixtureRequest) -> None:
    if "api" not in request.fixturenames:
        return
    api: Api = request.getfixturevalue("api")
    for key in api.redis.scan_iter(f"{QUEUE}*"):  # this process' queue only (see QUEUE)
        api.redis.delete(key)
    for key in api.objects.list("tenants/"):
        api.objects.delete(key)
    with api.engine.begin() as conn:
        conn.execute(text("DELETE FROM segments"))
        conn.execute(text("DELETE FROM jobs"))


def _spec(**over: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "image": "s3://inputs-bucket/faces/a.png",
        "audio": "s3://inputs-bucket/speech/a.wav",
    }
    spec.update(over)
    return spec


# ---------------------------------------------------------------------------------------------- submit


def test_submit_creates_row_and_queues_only_the_job_id(api: Api) -> None:
    with api.client() as c:
        job = c.submit(_spec(text="hello", seed=7))
    assert job.status == "queued" and job.tenant == "tenant-a"
    assert job.spec["seed"] == 7 and job.spec["text"] == "hello"
    assert api.queued() == [{"task": TASK, "args": [job.id], "kwargs": {}}]
    assert api.job_rows() == 1
    with api.client() as c:
        again = c.get(job.id)
    assert again.id == job.id and again.status == "queued"


def test_submit_answers_201_then_200_for_the_same_idempotency_key(api: Api) -> None:
    body = _spec(idempotency_key="order-42")
    headers = {"Authorization": f"Bearer {TOKEN_A}"}
    first = httpx.post(f"{api.url}/v1/jobs", json=body, headers=headers)
    second = httpx.post(f"{api.url}/v1/jobs", json=body, headers=headers)
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]
    assert api.job_rows() == 1
    # still queued and never claimed: the replay re-sends (a duplicate message is a no-op claim)
    assert [m["args"] for m in api.queued()] == [[first.json()["id"]]] * 2
    # once a worker has claimed it, a replay sends nothing more
    assert api.store.claim(first.json()["id"], owner="w1", lease_s=30) is not None
    third = httpx.post(f"{api.url}/v1/jobs", json=body, headers=headers)
    assert third.status_code == 200 and third.json()["status"] == "running"
    assert api.queue_len() == 2


def test_concurrent_submissions_with_one_key_make_one_job(api: Api) -> None:
    from concurrent.futures import ThreadPoolExecutor

    body = _spec(idempotency_key="burst-1")

    def post(_: int) -> httpx.Response:
        return httpx.post(
            f"{api.url}/v1/jobs", json=body, headers={"Authorization": f"Bearer {TOKEN_A}"}, timeout=60
        )

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    assert {r.status_code for r in answers} <= {200, 201} and 201 in {r.status_code for r in answers}
    assert len({r.json()["id"] for r in answers}) == 1
    assert api.job_rows() == 1
    assert {tuple(m["args"]) for m in api.queued()} == {(answers[0].json()["id"],)}


def test_same_idempotency_key_with_another_spec_is_409(api: Api) -> None:
    with api.client() as c:
        c.submit(_spec(idempotency_key="k-1", seed=1))
        with pytest.raises(LongtakeAPIError) as exc:
            c.submit(_spec(idempotency_key="k-1", seed=2))
    assert exc.value.status_code == 409
    assert "idempotency_key" in exc.value.message and "new key" in exc.value.message
    assert api.queue_len() == 1 and api.job_rows() == 1


def test_idempotency_keys_are_per_tenant(api: Api) -> None:
    with api.client(TOKEN_A) as a, api.client(TOKEN_B) as b:
        ja = a.submit(_spec(idempotency_key="shared"))
        jb = b.submit(_spec(idempotency_key="shared"))
    assert ja.id != jb.id and api.job_rows() == 2


BAD_SUBMISSIONS = [
    pytest.param({"colour": "red"}, 422, "colour", "remove it", id="unknown-field"),
    pytest.param({"seed": -1}, 422, "seed", "greater than or equal to 0", id="negative-seed"),
    pytest.param({"text": "x" * 2001}, 422, "text", "shorten", id="text-over-limit"),
    pytest.param(
        {"image": "file:///etc/passwd"}, 422, "image", "outside the allowed root", id="file-outside-root"
    ),
    pytest.param(
        {"audio": "s3://inputs-bucket/speech/../../secret.wav"}, 422, "audio", "'..'", id="dotdot-in-key"
    ),
    pytest.param(
        {"image": "upload://../../tenant-b/uploads/x"}, 422, "image", "upload://<id>", id="dotdot-upload"
    ),
    pytest.param({"image": "http://example.com/a.png"}, 422, "image", "use s3://", id="bad-scheme"),
    pytest.param({"tenant": "tenant-b"}, 422, "tenant", "remove the field", id="tenant-in-spec"),
    pytest.param({"audio": None}, 422, "audio", "or `session`", id="neither-audio-nor-session"),
    pytest.param({"session": {"sample_rate": 16000}}, 422, "session", "give one of the two",
                 id="both-audio-and-session"),
    pytest.param({"priority": 12}, 422, "priority", "less than or equal to 9", id="priority-range"),
    pytest.param({"options": {"steps": 0}}, 422, "options.steps", "[1, 50]", id="option-out-of-bounds"),
]


@pytest.mark.parametrize(("over", "status", "field", "fix"), BAD_SUBMISSIONS)
def test_bad_submission_is_4xx_names_field_and_fix_and_queues_nothing(
    api: Api, over: dict[str, object], status: int, field: str, fix: str
) -> None:
    resp = httpx.post(
        f"{api.url}/v1/jobs", json=_spec(**over), headers={"Authorization": f"Bearer {TOKEN_A}"}
    )
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["error"] == "invalid_spec"
    assert field in body["message"] and fix in body["message"], body["message"]
    assert any(e["field"] == field for e in body["errors"])
    assert api.queue_len() == 0
    assert api.job_rows() == 0


def test_family_options_are_checked_at_submit_and_stored_on_the_row(api: Api, tmp_path: Path) -> None:
    headers = {"Authorization": f"Bearer {TOKEN_A}"}
    resp = httpx.post(f"{api.url}/v1/jobs", json=_spec(options={"steps": 0, "audio_guidance": 2.0}), headers=headers)
    assert resp.status_code == 422, resp.text
    message = "options.steps=0: must be int in [1, 50] (preset 'tiny' default 5)"  # key, value, bounds, default
    assert resp.json() == {"error": "invalid_spec", "message": message,
                           "errors": [{"field": "options.steps", "message": message}]}
    # bounds are the preset's: wan's infinitetalk takes guidance up to 20, tiny's up to 10
    resp = httpx.post(f"{api.url}/v1/jobs", json=_spec(options={"audio_guidance": 12}), headers=headers)
    assert resp.status_code == 422 and resp.json()["errors"][0]["field"] == "options.audio_guidance"
    assert "float in [1, 10] (preset 'tiny' default 2.0)" in resp.json()["message"]
    resp = httpx.post(f"{api.url}/v1/jobs", json=_spec(options={"cfg": 2}), headers=headers)
    assert resp.status_code == 422 and resp.json()["errors"] == [
        {"field": "options.cfg", "message": "options.cfg: the tiny family takes ['audio_guidance', 'audio_guidance_peak', 'interp_start_noise', 'start_noise', 'steps']"}]
    assert api.queue_len() == 0 and api.job_rows() == 0
    with api.client() as c:  # the client's options= merge over the spec's own, key by key
        job = c.submit(_spec(options={"steps": 9, "audio_guidance": 3}), options={"steps": 3.0})
        wan = c.submit(_spec(family="wan", preset="infinitetalk"), options={"audio_guidance": 12})
    assert job.spec["options"] == {"steps": 3, "audio_guidance": 3.0}  # as the family reads them
    assert wan.spec["options"] == {"audio_guidance": 12.0}
    with api.engine.connect() as conn:
        stored = conn.execute(text("SELECT spec FROM jobs WHERE id = :id"), {"id": job.id}).scalar_one()
    assert stored["options"] == {"steps": 3, "audio_guidance": 3.0}
    # the multipart route (what `longtake submit` / `live` send with local files) checks them the same
    image, audio = tmp_path / "face.png", tmp_path / "speech.wav"
    image.write_bytes(api_media.png())
    audio.write_bytes(api_media.wav())
    with api.client() as c:
        with pytest.raises(LongtakeAPIError) as exc:
            c.submit({}, image=image, audio=audio, options={"steps": 0})
        uploaded = c.submit({}, image=image, audio=audio, options={"steps": 3})
    assert exc.value.status_code == 422 and exc.value.body["errors"][0]["field"] == "options.steps"  # type: ignore[index]
    assert uploaded.spec["options"] == {"steps": 3}
    assert api.queue_len() == 3 and api.job_rows() == 3


def test_file_uri_under_the_allowed_root_is_accepted(api: Api) -> None:
    (api.file_root / "a.png").write_bytes(b"png")
    with api.client() as c:
        job = c.submit(_spec(image=(api.file_root / "a.png").as_uri()))
    assert job.spec["image"].startswith("file:///") and api.queue_len() == 1


@pytest.mark.parametrize(
    "auth",
    [None, "Bearer not-a-real-token-at-all", f"Basic {TOKEN_A}", "Bearer", f"Bearer {TOKEN_A}x"],
    ids=["missing", "unknown", "wrong-scheme", "empty", "extended"],
)
def test_missing_or_bad_token_is_401_with_www_authenticate_and_queues_nothing(
    api: Api, auth: str | None
) -> None:
    headers = {"Authorization": auth} if auth is not None else {}
    resp = httpx.post(f"{api.url}/v1/jobs", json=_spec(), headers=headers)
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"].startswith('Bearer realm="longtake"')
    assert "Bearer" in resp.json()["message"] or "token" in resp.json()["message"]
    assert api.queue_len() == 0 and api.job_rows() == 0
    # every other route is closed too
    for method, path in [
        ("GET", "/v1/jobs"),
        ("GET", f"/v1/jobs/{uuid.uuid4()}"),
        ("POST", f"/v1/jobs/{uuid.uuid4()}/cancel"),
    ]:
        assert httpx.request(method, api.url + path, headers=headers).status_code == 401


def test_invalid_json_body_is_400(api: Api) -> None:
    resp = httpx.post(
        f"{api.url}/v1/jobs",
        content=b"{not json",
        headers={"Authorization": f"Bearer {TOKEN_A}", "Content-Type": "application/json"},
    )
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["message"]
    assert api.queue_len() == 0 and api.job_rows() == 0


# ---------------------------------------------------------------------------------------------- tenancy


def test_another_tenants_job_is_404_exactly_like_a_missing_one(api: Api) -> None:
    with api.client(TOKEN_A) as a:
        job = a.submit(_spec())
    missing = str(uuid.uuid4())
    hb = {"Authorization": f"Bearer {TOKEN_B}"}
    for suffix in ["", "/outputs", "/preview"]:
        theirs = httpx.get(f"{api.url}/v1/jobs/{job.id}{suffix}", headers=hb)
        nobody = httpx.get(f"{api.url}/v1/jobs/{missing}{suffix}", headers=hb)
        assert theirs.status_code == nobody.status_code == 404
        assert theirs.json()["message"].replace(job.id, "ID") == nobody.json()["message"].replace(
            missing, "ID"
        )
    cancel = httpx.post(f"{api.url}/v1/jobs/{job.id}/cancel", headers=hb)
    assert cancel.status_code == 404
    rec = api.store.get(job.id)
    assert rec is not None and rec.status == "queued" and not rec.cancel_requested
    with api.client(TOKEN_B) as b:
        assert b.list().jobs == []
    # a job id that is not even a UUID: 404 too, no server error
    assert httpx.get(f"{api.url}/v1/jobs/..%2F..%2Fetc", headers=hb).status_code == 404


def test_upload_of_another_tenant_cannot_be_referenced(api: Api) -> None:
    with api.client(TOKEN_B) as b:
        resp = b._req("POST", "/v1/uploads", files={"file": ("a.png", api_media.png(), "image/png")})
    uri = resp.json()["uri"]
    assert api.objects.exists(upload_key("tenant-b", uri.removeprefix("upload://")))
    with api.client(TOKEN_A) as a, pytest.raises(LongtakeAPIError) as exc:
        a.submit(_spec(image=uri))
    assert exc.value.status_code == 422 and "was not uploaded by your tenant" in exc.value.message
    assert api.queue_len() == 0 and api.job_rows() == 0


# ---------------------------------------------------------------------------------------------- multipart


def test_multipart_submit_stores_uploads_under_the_tenant_and_queues(api: Api, tmp_path: Path) -> None:
    image, audio = tmp_path / "face.png", tmp_path / "speech.wav"
    image.write_bytes(api_media.png())
    audio.write_bytes(api_media.wav())
    with api.client() as c:
        job = c.submit({"text": "studio", "seed": 3}, image=image, audio=audio)
    assert str(job.spec["image"]).startswith("upload://") and str(job.spec["audio"]).startswith("upload://")
    for field, src in (("image", image), ("audio", audio)):
        key = upload_key("tenant-a", str(job.spec[field]).removeprefix("upload://"))
        assert api.objects.get_bytes(key) == src.read_bytes()
    assert api.queued() == [{"task": TASK, "args": [job.id], "kwargs": {}}]


def test_large_upload_is_streamed_as_a_multipart_object(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_module, "UPLOAD_PART_BYTES", 16 * 1024)  # 40 KiB -> parts of 16+16+8 KiB
    audio = tmp_path / "speech.wav"
    audio.write_bytes(api_media.wav(seconds=5.0))  # 40 kB
    with api.client() as c:
        job = c.submit({"image": "s3://inputs-bucket/a.png"}, audio=audio)
    key = upload_key("tenant-a", str(job.spec["audio"]).removeprefix("upload://"))
    assert api.objects.get_bytes(key) == audio.read_bytes()
    assert api.queue_len() == 1


def test_multipart_with_a_bad_spec_stores_and_queues_nothing(api: Api, tmp_path: Path) -> None:
    image = tmp_path / "face.png"
    image.write_bytes(b"img")
    with api.client() as c, pytest.raises(LongtakeAPIError) as exc:
        c.submit({"seed": -5, "audio": "s3://inputs-bucket/a.wav"}, image=image)
    assert exc.value.status_code == 422 and "seed" in exc.value.message
    assert api.objects.list("tenants/") == []
    assert api.queue_len() == 0 and api.job_rows() == 0


def test_multipart_over_the_size_limit_is_413(api: Api, tmp_path: Path) -> None:
    image = tmp_path / "big.png"
    image.write_bytes(api_media.png(160, 160)[:8] + b"0" * (64 * 1024 + 1))
    with api.client() as c, pytest.raises(LongtakeAPIError) as exc:
        c.submit({"audio": "s3://inputs-bucket/a.wav"}, image=image)
    assert exc.value.status_code == 413 and "LONGTAKE_UPLOAD_MAX_BYTES" in exc.value.message
    assert api.objects.list("tenants/") == [] and api.queue_len() == 0 and api.job_rows() == 0


def test_multipart_input_both_in_spec_and_as_file_is_rejected(api: Api, tmp_path: Path) -> None:
    image = tmp_path / "face.png"
    image.write_bytes(b"img")
    with api.client() as c, pytest.raises(LongtakeAPIError) as exc:
        c.submit(_spec(), image=image)
    assert exc.value.status_code == 422 and "given both as a file and in the spec" in exc.value.message
    assert api.queue_len() == 0 and api.job_rows() == 0


# ---------------------------------------------------------------------------------------------- list, cancel


def test_list_filters_by_status_and_pages_by_created_before(api: Api) -> None:
    with api.client() as c:
        ids = [c.submit(_spec(seed=i)).id for i in range(4)]
        api.store.fail(ids[1], code="test", message="failed on purpose")
        failed = c.list(status="failed")
        assert [j.id for j in failed.jobs] == [ids[1]] and failed.next_before is None
        page1 = c.list(limit=3)
        assert [j.id for j in page1.jobs] == ids[::-1][:3]
        assert page1.next_before is not None
        page2 = c.list(limit=3, before=page1.next_before)
        assert [j.id for j in page2.jobs] == [ids[0]] and page2.next_before is None
        with pytest.raises(LongtakeAPIError) as exc:
            c.list(status="done")
        assert exc.value.status_code == 422 and "status" in exc.value.message
        with pytest.raises(LongtakeAPIError) as exc:
            c.list(limit=0)
        assert exc.value.status_code == 422 and "limit" in exc.value.message


def test_cancel_queued_job_then_again_is_409(api: Api) -> None:
    with api.client() as c:
        job = c.submit(_spec())
        cancelled = c.cancel(job.id)
        assert cancelled.status == "cancelled"
        with pytest.raises(LongtakeAPIError) as exc:
            c.cancel(job.id)
    assert exc.value.status_code == 409 and "already cancelled" in exc.value.message


def test_cancel_running_job_sets_the_flag(api: Api) -> None:
    with api.client() as c:
        job = c.submit(_spec())
        assert api.store.claim(job.id, owner="w1", lease_s=30) is not None
        view = c.cancel(job.id)
    assert view.status == "running" and view.cancel_requested
    assert api.store.cancel_requested(job.id)


# ---------------------------------------------------------------------------------------------- outputs, preview


@dataclass(frozen=True)
class _Seg:
    index: int
    key: str
    nbytes: int
    duration_s: float
    checksum: str
    state_key: str | None
    first_frame: int
    num_frames: int


def _finish_job(api: Api, job_id: str) -> tuple[bytes, list[bytes]]:
    """Play a worker: claim, commit two segments, write final.mp4 + playlist, finish."""
    lease = api.store.claim(job_id, owner="w1", lease_s=30)
    assert lease is not None
    prefix = job_prefix("tenant-a", job_id)
    segs = [b"seg-zero-bytes", b"seg-one-bytes!"]
    for i, data in enumerate(segs):
        key = f"{prefix}seg-{i:05d}.m4s"
        api.objects.put_bytes(key, data)
        api.store.commit_segment(lease, _Seg(i, key, len(data), 0.5, "0" * 64, None, i * 8, 8))
    final = b"init" + b"".join(segs)
    api.objects.put_bytes(prefix + "final.mp4", final)
    api.objects.put_bytes(prefix + "index.m3u8", b"#EXTM3U\n")
    api.store.finish(
        lease,
        outputs={"mp4": api.objects.uri(prefix + "final.mp4"), "hls": api.objects.uri(prefix + "index.m3u8")},
    )
    return final, segs


def test_outputs_and_fetch_of_a_finished_job(api: Api, tmp_path: Path) -> None:
    with api.client() as c:
        job = c.submit(_spec())
        early = c.outputs(job.id)
        assert early.final is None and early.segments == [] and not early.partial
        with pytest.raises(LongtakeAPIError) as exc:
            c.fetch(job.id, tmp_path)
        assert exc.value.status_code == 409 and "--segments" in exc.value.message
        final, segs = _finish_job(api, job.id)
        out = c.outputs(job.id)
        assert out.status == "succeeded" and not out.partial and out.final and out.playlist
        assert [s.index for s in out.segments] == [0, 1] and out.segments[1].nbytes == len(segs[1])
        paths = c.fetch(job.id, tmp_path / "dl", segments=True)
    assert paths[0].read_bytes() == final
    assert [p.read_bytes() for p in paths[1:]] == segs


PLAYLIST = """#EXTM3U
#EXT-X-VERSION:7
#EXT-X-PLAYLIST-TYPE:EVENT
#EXT-X-TARGETDURATION:1
#EXT-X-MAP:URI="init.mp4"
#EXTINF:0.400000,
seg-00000.m4s
#EXTINF:0.400000,
seg-00001.m4s
"""


def _put_preview(objects: ObjectStore, prefix: str) -> dict[str, bytes]:
    media = {"init.mp4": b"init-bytes", "seg-00000.m4s": b"fragment-0", "seg-00001.m4s": b"fragment-1"}
    for name, data in media.items():
        objects.put_bytes(prefix + name, data)
    objects.put_bytes(prefix + "index.m3u8", PLAYLIST.encode())
    return media


def _playlist_uris(text_: str) -> list[str]:
    uris = [line for line in text_.splitlines() if line and not line.startswith("#")]
    maps = [
        line.split('URI="', 1)[1].rstrip('"') for line in text_.splitlines() if line.startswith("#EXT-X-MAP")
    ]
    return maps + uris


def test_preview_hls_and_none(api: Api) -> None:
    with api.client() as c:
        job = c.submit(_spec())
        early = c.preview(job.id)  # before the first segment: the link already, the page waits
        assert early.kind == "hls" and early.url and early.page_url and "no segment yet" in early.detail
        waiting = httpx.get(early.url)
        assert waiting.status_code == 404 and waiting.headers["access-control-allow-origin"] == "*"
        media = _put_preview(api.objects, job_prefix("tenant-a", job.id))
        view = c.preview(job.id)
        assert view.kind == "hls" and view.url and view.expires_s == api.settings.presign_expires_s
        # the signed link needs no bearer token (players do not send one)
        resp = httpx.get(view.url)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(
            "application/vnd.apple.mpegurl"
        )
        assert resp.headers["access-control-allow-origin"] == "*"  # a page elsewhere may read it
        uris = _playlist_uris(resp.text)
        # a file:// store: the API serves the segments itself (players refuse file:// URLs)
        assert all(u.startswith(f"{api.url}/v1/jobs/{job.id}/preview/") for u in uris), uris
        assert [httpx.get(u).content for u in uris] == list(media.values())
        assert httpx.get(uris[0].replace("sig=", "sig=0")).status_code == 403
        page = httpx.get(view.page_url or "")
        assert page.status_code == 200 and "MediaSource" in page.text
        tampered = view.url.replace("sig=", "sig=0")
        assert httpx.get(tampered).status_code == 403
        expired = httpx.get(view.url.split("?")[0], params={"exp": int(time.time()) - 1, "sig": "0" * 64})
        assert expired.status_code == 403 and "expired" in expired.json()["message"]
        off = c.submit(_spec(preview={"hls": False}))
        assert c.preview(off.id).kind == "none"


def test_tampered_playlist_is_not_presigned(api: Api) -> None:
    with api.client() as c:
        job = c.submit(_spec())
        api.objects.put_bytes(
            job_prefix("tenant-a", job.id) + "index.m3u8",
            b'#EXTM3U\n#EXT-X-MAP:URI="../other-job/init.mp4"\nseg.m4s\n',
        )
        view = c.preview(job.id)
    assert view.url is not None
    resp = httpx.get(view.url)
    assert resp.status_code == 500 and resp.json()["error"] == "bad_playlist"
    assert "file://" not in resp.text


def test_kvs_preview_gets_a_live_hls_session_url(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """GetDataEndpoint + GetHLSStreamingSessionURL against the local KVS stand-in (SigV4 checked)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", kvs_standin.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", kvs_standin.SECRET_KEY)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    standin = kvs_standin.KVSStandIn(streams={"avatar-live"})
    app = create_app(
        api.settings,
        engine=api.engine,
        objects=api.objects,
        celery=create_celery_app(api.settings),
        kvs_endpoint_url=standin.url,
    )
    server, thread, url = _serve(app)
    try:
        with LongtakeClient(url, TOKEN_A) as c:
            live = c.submit(
                _spec(preview={"kvs": {"stream_name": "avatar-live", "region": kvs_standin.REGION}})
            )
            view = c.preview(live.id)
            assert view.kind == "kvs" and view.url is not None
            assert view.url.startswith(f"{standin.url}/hls/v1/getHLSMasterPlaylist.m3u8?SessionToken=")
            gone = c.submit(
                _spec(preview={"kvs": {"stream_name": "no-such-stream", "region": kvs_standin.REGION}})
            )
            missing = c.preview(gone.id)
            assert missing.kind == "kvs" and missing.url is None
            assert "'no-such-stream'" in missing.detail and "credentials" in missing.detail
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        standin.stop()


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[MotoServer]:
    server = MotoServer()
    yield server
    server.stop()


def test_outputs_fetch_and_preview_on_s3(api: Api, moto_s3: MotoServer, tmp_path: Path) -> None:
    """Same routes against a real S3 API (moto_server): presigned http URLs work without our token."""
    s3 = moto_s3.store()
    app = create_app(api.settings, engine=api.engine, objects=s3, celery=create_celery_app(api.settings))
    server, thread, url = _serve(app)
    try:
        with LongtakeClient(url, TOKEN_A) as c:
            job = c.submit(_spec())
            prefix = job_prefix("tenant-a", job.id)
            api_ = Api(url, api.settings, api.engine, s3, api.redis, api.store, api.file_root)
            final, _ = _finish_job(api_, job.id)
            media = _put_preview(s3, prefix)
            out = c.outputs(job.id)
            assert out.final is not None and out.final.startswith(moto_s3.endpoint_url)
            assert httpx.get(out.final).content == final
            (path,) = c.fetch(job.id, tmp_path / "video.mp4")
            assert path == tmp_path / "video.mp4" and path.read_bytes() == final
            view = c.preview(job.id)
            assert view.url is not None
            uris = _playlist_uris(httpx.get(view.url).text)
            assert all(u.startswith(moto_s3.endpoint_url) and "Signature" in u for u in uris)
            assert [httpx.get(u).content for u in uris] == list(media.values())
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# ---------------------------------------------------------------------------------------------- health, docs


def test_healthz_ok(api: Api) -> None:
    with api.client() as c:
        body = c.health()
    assert body == {"status": "ok", "database": "ok", "broker": "ok"}


def test_healthz_503_when_broker_or_database_is_down(pg_engine: Engine, tmp_path: Path) -> None:
    dead_port = _free_port()
    settings = Settings(
        database_url=PG_URL, broker_url=f"redis://127.0.0.1:{dead_port}/3", api_tokens={TOKEN_A: "tenant-a"}
    )
    dead_db = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{dead_port}/nope")
    for engine, broken in ((pg_engine, "broker"), (dead_db, "database")):
        broker = settings.broker_url if broken == "broker" else REDIS_URL
        app = create_app(
            settings,
            engine=engine,
            objects=LocalObjectStore(tmp_path),
            celery=create_celery_app(settings.model_copy(update={"broker_url": broker})),
        )
        server, thread, url = _serve(app)
        try:
            resp = httpx.get(f"{url}/healthz", timeout=30)
        finally:
            server.should_exit = True
            thread.join(timeout=10)
        assert resp.status_code == 503, resp.text
        assert resp.json()[broken] == "unavailable" and resp.json()["status"] == "unavailable"
        assert str(dead_port) not in resp.text and "127.0.0.1" not in resp.text  # no host, port, error text
        assert resp.headers["retry-after"] == "5"


def test_openapi_documents_the_job_spec_and_routes(api: Api) -> None:
    doc = httpx.get(f"{api.url}/openapi.json").json()
    assert "JobSpec" in doc["components"]["schemas"]
    assert doc["components"]["schemas"]["JobSpec"]["additionalProperties"] is False
    body = doc["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/JobSpec"}
    for path in [
        "/v1/jobs/upload",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/outputs",
        "/v1/jobs/{job_id}/preview",
        "/healthz",
    ]:
        assert path in doc["paths"], path
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_metrics_count_submissions_and_rejections(api: Api) -> None:
    with api.client() as c:
        c.submit(_spec())
    httpx.post(f"{api.url}/v1/jobs", json=_spec(seed=-1), headers={"Authorization": f"Bearer {TOKEN_A}"})
    text_ = httpx.get(f"{api.url}/metrics").text
    assert "longtake_api_jobs_submitted_total" in text_
    assert 'longtake_api_submissions_rejected_total{code="invalid_spec"}' in text_
    assert 'longtake_api_requests_total{route="/v1/jobs",status="201"}' in text_
    assert 'longtake_api_requests_total{route="/v1/jobs",status="422"}' in text_
