"""worker/delivery/static/preview.html in headless Chromium: it plays the HLS EVENT playlist the sink writes,
finished and still in progress. Skipped where no Chromium is installed."""

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

import pytest

from tests.integration.delivery_media import make_sample
from worker.delivery.keys import job_prefix
from worker.delivery.local_store import LocalObjectStore
from worker.delivery.s3_sink import S3ProgressiveSink

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


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium")
def test_preview_page_plays_in_progress_and_finished(site: tuple[Path, str], tmp_path: Path) -> None:
    root, base = site
    store = LocalObjectStore(root)
    sample = make_sample(6.0)
    sink = S3ProgressiveSink(store, PREFIX, on_commit=lambda seg: None)
    sink.open(sample.init)
    for frag in sample.fragments[:4]:
        sink.write(frag)
    while sink.backlog_bytes:
        threading.Event().wait(0.02)
    url = f"{base}/preview.html?src=/{PREFIX}index.m3u8"

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
def test_preview_page_reports_missing_src(site: tuple[Path, str], tmp_path: Path) -> None:
    _, base = site
    state, detail = page_state(f"{base}/preview.html", tmp_path)
    assert state == "error" and "src" in detail
