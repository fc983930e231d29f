"""Python client for the longtake HTTP API, and the wire models both sides share.

Users' scripts and the ``longtake`` CLI (submit/status/wait/fetch/cancel/preview) call
:class:`LongtakeClient`; the server (:mod:`worker.api.app`) builds its responses from the same pydantic
models defined here (:class:`JobView`, :class:`JobListView`, :class:`OutputsView`,
:class:`PreviewView`), so the two cannot drift. This module imports only httpx and pydantic: no
Celery, SQLAlchemy or boto3, so a script that only talks to the API stays light.

Every non-2xx answer raises :class:`LongtakeAPIError` carrying the server's message (which names the
field and the fix). A client holds one ``httpx.Client`` (connection pool); close it or use it as a
context manager.
"""

from __future__ import annotations

import builtins
import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

import httpx
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

JobStatusName = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

__all__ = [
    "JobListView",
    "JobView",
    "LongtakeAPIError",
    "LongtakeClient",
    "LongtakeConnectionError",
    "OutputsView",
    "PreviewView",
    "ProgressView",
    "SegmentView",
    "TERMINAL_STATUSES",
]


# ---------------------------------------------------------------------------------------------- wire models


class _Wire(BaseModel):
    # Ignore fields a newer server adds, so old clients keep working.
    model_config = ConfigDict(extra="ignore", frozen=True)


class ProgressView(_Wire):
    """Render progress as last reported by the worker's heartbeat."""

    chunks_done: int = Field(default=0, description="N/I emissions committed so far")
    num_chunks: int | None = Field(default=None, description="total emissions, once the worker knows it")
    frames_done: int = 0
    num_frames: int | None = None
    seconds_done: float = Field(default=0.0, description="seconds of output video committed so far")
    elapsed_s: float = Field(default=0.0, description="wall seconds the current attempt has been rendering")
    moved_at: datetime | None = Field(
        default=None,
        description="when the job last moved (its current attempt started, a chunk was committed or "
        "more frames were rendered); a running job whose moved_at is old is stuck, though it heartbeats",
    )
    chunk_delay_s: float | None = Field(
        default=None,
        description="live session: seconds from the arrival of the audio the last published chunk needed "
        "to its publication",
    )


class JobView(_Wire):
    """One job as the API shows it to its tenant."""

    id: str
    tenant: str
    status: JobStatusName
    attempts: int = 0
    progress: ProgressView = Field(default_factory=ProgressView)
    cancel_requested: bool = False
    error_code: str | None = None
    error_message: str | None = None
    outputs: dict[str, str] = Field(default_factory=dict, description="output name -> object URI")
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    spec: dict[str, object] = Field(default_factory=dict, description="the submitted job spec")
    session: dict[str, object] | None = Field(
        default=None,
        description="live session: end_reason (null while it runs), audio_s, silence_s (inserted by the "
        "live clock), duration_s, chunk_delay_s / chunk_delay_max_s / chunk_delay_mean_s; see docs/sessions.md",
    )

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class JobListView(_Wire):
    jobs: list[JobView]
    next_before: datetime | None = Field(
        default=None, description="pass as ?before= to get the next page; null on the last page"
    )


class SegmentView(_Wire):
    index: int
    url: str
    nbytes: int
    duration_s: float
    checksum: str


class OutputsView(_Wire):
    """Presigned URLs of a job's outputs; ``final`` is absent until the job succeeds."""

    job_id: str
    status: JobStatusName
    partial: bool = Field(description="true when the outputs are what a cancelled/failed job left")
    final: str | None = None
    playlist: str | None = None
    segments: list[SegmentView] = Field(default_factory=list)
    expires_s: int


class PreviewView(_Wire):
    """Where to watch a job while it renders."""

    job_id: str
    kind: Literal["hls", "kvs", "none"]
    url: str | None = Field(default=None, description="the HLS playlist (players) or KVS session URL")
    page_url: str | None = Field(
        default=None, description="HLS: a page on the API that plays the render in any browser"
    )
    detail: str = ""
    expires_s: int | None = None


# ---------------------------------------------------------------------------------------------- client


class LongtakeAPIError(Exception):
    """The API answered with an error status. ``message`` is the server's explanation."""

    def __init__(self, status_code: int, message: str, body: object = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


class LongtakeConnectionError(ConnectionError):
    """The API could not be reached at all (refused, DNS, timeout)."""

    def __init__(self, base_url: str, exc: Exception) -> None:
        super().__init__(
            f"cannot reach the API at {base_url} ({type(exc).__name__}: {exc}); start it with "
            "`longtake api` or `longtake up`, or pass the right --api / LONGTAKE_API_URL"
        )
        self.base_url = base_url


class LongtakeClient:
    """Talks to one longtake API as one tenant (the tenant is implied by the token)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not base_url:
            raise ValueError("base_url is empty; pass the API address, e.g. http://127.0.0.1:8000")
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}", "User-Agent": "longtake-client/0.1"},
            timeout=timeout_s,
            transport=transport,
        )

    # -- lifecycle
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> LongtakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls
    def submit(
        self,
        spec: Mapping[str, object],
        *,
        image: Path | None = None,
        audio: Path | None = None,
        options: Mapping[str, str | int | float] | None = None,
    ) -> JobView:
        """Submit a job. With ``image``/``audio`` the files are uploaded (multipart) and the spec
        must leave those inputs out; otherwise the spec's URIs are used as given. ``options``: the
        family's sampling options (``JobSpec.options``, e.g. ``{"steps": 3, "audio_guidance": 2.0}``),
        merged over the spec's own ``options`` key by key; the API checks them against the job's
        family and preset (``422 invalid_spec`` naming ``options.<key>``). A spec with an
        ``idempotency_key`` already used by this tenant returns the existing job."""
        body = dict(spec)
        if options:
            given = body.get("options") or {}
            if not isinstance(given, Mapping):
                raise ValueError(f"spec['options'] is a {type(given).__name__}; give an object of option names "
                                 "to values, or pass options= only")
            body["options"] = {**given, **options}
        if image is None and audio is None:
            resp = self._req("POST", "/v1/jobs", json=body)
        else:
            files: dict[str, tuple[str, bytes, str]] = {}
            for name, path in (("image", image), ("audio", audio)):
                if path is not None:
                    p = Path(path)
                    if not p.is_file():
                        raise FileNotFoundError(f"{name} file {p} does not exist; pass an existing file")
                    files[name] = (p.name, p.read_bytes(), "application/octet-stream")
            resp = self._req("POST", "/v1/jobs/upload", data={"spec": json.dumps(body)}, files=files)
        return JobView.model_validate(self._check(resp))

    def get(self, job_id: str) -> JobView:
        return JobView.model_validate(self._check(self._req("GET", f"/v1/jobs/{job_id}")))

    def list(
        self,
        *,
        status: str | None = None,
        before: datetime | None = None,
        limit: int = 50,
    ) -> JobListView:
        params: dict[str, str | int] = {"limit": limit}
        if status is not None:
            params["status"] = status
        if before is not None:
            params["before"] = before.isoformat()
        return JobListView.model_validate(self._check(self._req("GET", "/v1/jobs", params=params)))

    def cancel(self, job_id: str) -> JobView:
        return JobView.model_validate(self._check(self._req("POST", f"/v1/jobs/{job_id}/cancel")))

    def outputs(self, job_id: str) -> OutputsView:
        return OutputsView.model_validate(self._check(self._req("GET", f"/v1/jobs/{job_id}/outputs")))

    def preview(self, job_id: str) -> PreviewView:
        return PreviewView.model_validate(self._check(self._req("GET", f"/v1/jobs/{job_id}/preview")))

    def preview_url(self, job_id: str) -> str | None:
        """The URL to watch the job in a browser: the API's player page (HLS), else the KVS session
        URL; None when the job has no preview."""
        view = self.preview(job_id)
        return view.page_url or view.url

    def health(self) -> dict[str, object]:
        resp = self._req("GET", "/healthz")
        body = resp.json()
        if not isinstance(body, dict):
            raise LongtakeAPIError(resp.status_code, "unexpected /healthz body", body)
        return body

    def wait(
        self,
        job_id: str,
        *,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        on_update: Callable[[JobView], None] | None = None,
    ) -> JobView:
        """Poll until the job reaches a terminal status; return its final view.

        ``on_update`` is called with every polled view (the CLI drives its progress bar from it).
        Raises ``TimeoutError`` after ``timeout_s`` (the job keeps running on the server).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.get(job_id)
            if on_update is not None:
                on_update(job)
            if job.is_terminal:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"job {job_id} is still {job.status} after {timeout_s:g} s; wait longer or check "
                    "`longtake status`"
                )
            time.sleep(poll_s)

    def fetch(self, job_id: str, dest: Path, *, segments: bool = False) -> builtins.list[Path]:
        """Download the job's final MP4 to ``dest`` (a file path, or a directory to put
        ``<job_id>.mp4`` in). With ``segments=True`` also the committed segments, next to it.
        Returns the written paths. Raises :class:`LongtakeAPIError` (409) if there is no final
        output yet and ``segments`` is False."""
        out = self.outputs(job_id)
        dest = Path(dest)
        written: builtins.list[Path] = []
        if out.final is None and not segments:
            raise LongtakeAPIError(
                409,
                f"job {job_id} has no final output (status {out.status}); wait for it to succeed, or "
                "pass segments=True (--segments) to fetch the committed segments",
            )
        if dest.is_dir() or (out.final is None and not dest.suffix):
            dest.mkdir(parents=True, exist_ok=True)
            final_path = dest / f"{job_id}.mp4"
            seg_dir = dest
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            final_path = dest
            seg_dir = dest.parent
        if out.final is not None:
            self._download(out.final, final_path)
            written.append(final_path)
        if segments:
            for seg in out.segments:
                path = seg_dir / f"{job_id}.seg{seg.index:05d}.m4s"
                self._download(seg.url, path)
                written.append(path)
        return written

    # -- helpers
    def _req(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise LongtakeConnectionError(self.base_url, exc) from exc

    def _download(self, url: str, path: Path) -> None:
        tmp = path.with_name(path.name + ".part")
        parsed = urlparse(url)
        if parsed.scheme == "file":
            # Local object store (embedded defaults): the "presigned" URL is the file itself.
            shutil.copyfile(unquote(parsed.path), tmp)
        else:
            # Presigned URLs carry their own auth: never send our bearer token to the object store.
            with httpx.stream("GET", url, timeout=None, follow_redirects=True) as resp:
                if resp.status_code >= 400:
                    raise LongtakeAPIError(resp.status_code, f"download of {parsed.path} failed")
                with tmp.open("wb") as f:
                    for block in resp.iter_bytes(1 << 20):
                        f.write(block)
        tmp.replace(path)
        logger.info("downloaded %s (%d bytes)", path, path.stat().st_size)

    @staticmethod
    def _check(resp: httpx.Response) -> object:
        if resp.status_code < 400:
            return resp.json()
        body: object
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        message = str(body)
        if isinstance(body, dict):
            message = str(body.get("message") or body.get("detail") or body)
        raise LongtakeAPIError(resp.status_code, message, body)
