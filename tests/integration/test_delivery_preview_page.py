"""worker/delivery/static/preview.html in headless Chromium: it plays the HLS EVENT playlist the sink writes,
finished and still in progress; served by the API, the one URL `longtake preview JOB` prints plays on the
embedded store and on S3, and the page opened elsewhere reads the API cross-origin. Skipped where no
Chromium is installed."""

from __future__ import annotations

import functools
import html
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

import pytest
from sqlalchemy.engine import Engine

from tests.integration.delivery_media import make_sample
from worker.delivery.keys import job_prefix
from worker.delivery.local_store import LocalObjectStore
from worker.delivery.object_store import ObjectStore
from worker.delivery.s3_sink import S3ProgressiveSink
from worker.settings import Settings

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "worker" / "delivery" / "static" / "preview.html"
CHROMIUM = next((shutil.which(n) for n in ("chromium-headless-shell", "chromium", "google-chrome")
                 if shutil.which(n)), None)
PREFIX = job_prefix("acme", "preview-page")


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    root = tmp_path / "site"
    root.mkdir()
    shutil.copy(PAGE, root / "preview.html")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def page_state(url: str, tmp_path: Path) -> tuple[str, str]:
    assert CHROMIUM is not None
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--autoplay-policy=no-user-gesture-required",
         f"--user-data-dir={tmp_path / 'chrome-profile'}", "--virtual-time-budget=8000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    ).stdout
    state = re.search(r'data-state="([^"]*)"', out)
    detail = re.search(r'data-detail="([^"]*)"', out)
    return (state.group(1) if state else "none", html.unescape(detail.group(1)) if detail else out[-500:])


def play_while_rendering(url: str, store: ObjectStore, prefix: str, tmp_path: Path) -> None:
    """Upload 4 of the 10 segments of a 6 s clip through the S3 sink into ``store`` and check the page
    at ``url`` plays them, still "rendering"; then the rest, and check it plays all 6 s, "complete"."""
    sample = make_sample(6.0)
    sink = S3ProgressiveSink(store, prefix, on_commit=lambda seg: None)
    sink.open(sample.init)
    for frag in sample.fragments[:4]:
        sink.write(frag)
    while sink.backlog_bytes:
        threading.Event().wait(0.02)

    state, detail = page_state(url, tmp_path)
    assert state == "live", detail  # still rendering: no ENDLIST, the page keeps polling
    segments, buffered = re.search(r"(\d+) segments, ([\d.]+) s buffered", detail).groups()  # type: ignore[union-attr]
    assert int(segments) == 4 and abs(float(buffered) - 4 * 16 / 25) < 0.15, detail

    for frag in sample.fragments[4:]:
        sink.write(frag)
    sink.close(ok=True)
    state, detail = page_state(url, tmp_path)
    assert state == "complete", detail
    segments, buffered = re.search(r"(\d+) segments, ([\d.]+) s buffered", detail).groups()  # type: ignore[union-attr]
    assert int(segments) == len(sample.fragments) and abs(float(buffered) - 6.0) < 0.15, detail
    assert "256x256" in detail


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium")
def test_preview_page_plays_in_progress_and_finished(site: tuple[Path, str], tmp_path: Path) -> None:
    root, base = site
    play_while_rendering(f"{base}/preview.html?src=/{PREFIX}index.m3u8", LocalObjectStore(root), PREFIX, tmp_path)


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium")
def test_preview_page_reports_missing_src(site: tuple[Path, str], tmp_path: Path) -> None:
    _, base = site
    state, detail = page_state(f"{base}/preview.html", tmp_path)
    assert state == "error" and "src" in detail


# ------------------------------------------------------------------------------ issue 18 item 2: served by the API

TOKEN = "preview-page-token-0123456789"


def _serve_api(settings: Settings, objects: ObjectStore, engine: Engine) -> tuple[object, threading.Thread, str]:
    import socket
    import time

    import uvicorn

    from worker.api.app import create_app
    from worker.jobs.queue import create_celery_app

    app = create_app(settings, engine=engine, objects=objects, celery=create_celery_app(settings))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def longtake_preview(api_url: str, job_id: str, *extra: str) -> str:
    """`longtake preview JOB` in its own process, as a user runs it; its one line of output."""
    import os
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "LONGTAKE_API_URL": api_url, "LONGTAKE_API_TOKEN": TOKEN}
    out = subprocess.run([sys.executable, "-m", "worker.cli", "preview", job_id, *extra], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.split()
    return line


@pytest.fixture(params=["file", "s3-presigned", "s3-api"])
def api_stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str, ObjectStore]]:
    """The API on an embedded SQLite jobs database with one job, over a local store (the `longtake
    up` stack) or moto S3: presigned segment URLs (bucket CORS rule set, as docs/delivery.md says) or
    segments served by the API. Yields (API URL, job id, store)."""
    from worker.jobs.db import make_engine, migrate
    from worker.jobs.store import JobStore
    from worker.spec import JobSpec

    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    migrate(db)
    engine = make_engine(db)
    moto = None
    objects: ObjectStore
    if request.param == "file":
        objects = LocalObjectStore(tmp_path / "objects")
        store_url = (tmp_path / "objects").as_uri()
    else:
        from tests.integration.s3_fixtures import MotoServer

        moto = MotoServer()
        bucket = moto.make_bucket()
        moto.client().put_bucket_cors(Bucket=bucket, CORSConfiguration={"CORSRules": [
            {"AllowedOrigins": ["*"], "AllowedMethods": ["GET"], "AllowedHeaders": ["*"]}]})
        objects = moto.store(bucket)
        store_url = f"s3://{bucket}"
    settings = Settings(database_url=db, broker_url="memory://", object_store_url=store_url,
                        api_tokens={TOKEN: "acme"},
                        preview_segments="presigned" if request.param == "s3-presigned" else "auto"
                        if request.param == "file" else "api")
    job = JobStore(engine).create(JobSpec(image="s3://inputs-bucket/f.png", audio="s3://inputs-bucket/a.wav"), tenant="acme")
    server, thread, url = _serve_api(settings, objects, engine)
    try:
        yield url, job.id, objects
    finally:
        server.should_exit = True  # type: ignore[attr-defined]
        thread.join(timeout=10)
        engine.dispose()
        if moto is not None:
            moto.stop()


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium")
def test_longtake_preview_url_plays_the_render_in_progress(
    api_stack: tuple[str, str, ObjectStore], tmp_path: Path
) -> None:
    """The one URL `longtake preview JOB` prints opens a page (served by the API) that plays the
    render while it runs and to its end, on the embedded store and on S3. On main the URL was a
    playlist of file:// segments, and the API served no page."""
    api_url, job_id, objects = api_stack
    url = longtake_preview(api_url, job_id)
    assert url.startswith(f"{api_url}/v1/jobs/{job_id}/preview.html?")
    play_while_rendering(url, objects, job_prefix("acme", job_id), tmp_path)
    playlist = longtake_preview(api_url, job_id, "--playlist")
    assert "/preview.m3u8?" in playlist and "file://" not in httpx_get(playlist)


def httpx_get(url: str) -> str:
    import httpx

    resp = httpx.get(url)
    assert resp.status_code == 200, resp.text
    return resp.text


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium")
def test_page_opened_elsewhere_reads_the_api_cross_origin(
    site: tuple[Path, str], tmp_path: Path
) -> None:
    """The static page served from another origin, pointed at the API's signed playlist: the API's
    CORS headers let it read playlist and segments (on main: 'Failed to fetch')."""
    from worker.jobs.db import make_engine, migrate
    from worker.jobs.store import JobStore
    from worker.spec import JobSpec

    _, base = site
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    migrate(db)
    engine = make_engine(db)
    objects = LocalObjectStore(tmp_path / "objects")
    settings = Settings(database_url=db, broker_url="memory://", object_store_url=(tmp_path / "objects").as_uri(),
                        api_tokens={TOKEN: "acme"})
    job = JobStore(engine).create(JobSpec(image="s3://inputs-bucket/f.png", audio="s3://inputs-bucket/a.wav"), tenant="acme")
    sample = make_sample(2.0)
    sink = S3ProgressiveSink(objects, job_prefix("acme", job.id), on_commit=lambda seg: None)
    sink.open(sample.init)
    for frag in sample.fragments:
        sink.write(frag)
    sink.close(ok=True)
    server, thread, api_url = _serve_api(settings, objects, engine)
    try:
        playlist = longtake_preview(api_url, job.id, "--playlist")
        state, detail = page_state(f"{base}/preview.html?src={quote(playlist, safe='')}", tmp_path)
        assert state == "complete", detail
    finally:
        server.should_exit = True  # type: ignore[attr-defined]
        thread.join(timeout=10)
        engine.dispose()
