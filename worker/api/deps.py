"""What every route of the API shares: the app's dependencies, authentication, errors, views.

Who calls what: :func:`worker.api.app.create_app` builds one :class:`Deps` per app and keeps it on
``app.state``; each route of :mod:`worker.api.jobs`, :mod:`worker.api.uploads`,
:mod:`worker.api.preview` and :mod:`worker.api.health` receives it through ``Depends(get_deps)``,
authenticates with :func:`tenant` and answers errors by raising :class:`ApiError` (turned into
``{"error", "message", "errors"}`` by the app's handler). Another tenant's job is answered exactly
like a missing one (:func:`get_own`), so job ids do not leak across tenants.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import cast

from celery import Celery
from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import ValidationError
from sqlalchemy.engine import Engine

from worker.api.auth import AuthError, PreviewSigner, TokenAuth
from worker.client import JobView, ProgressView
from worker.delivery.object_store import ObjectStore
from worker.jobs.records import JobRecord
from worker.jobs.store import JobStore
from worker.settings import Settings
from worker.spec import SpecFieldError

API_PREFIX = "/v1"
# what a 503 (database or broker unreachable) tells clients to wait before retrying, in seconds
RETRY_AFTER_S = 5
JOB_ID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class ApiError(Exception):
    """An error answer: HTTP status, stable ``code``, a message naming the field and the fix."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        errors: Sequence[dict[str, str]] = (),
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.errors = list(errors)
        self.headers = headers or {}


def field_errors(exc: ValidationError, *, known_fields: Sequence[str]) -> list[dict[str, str]]:
    """Turn pydantic errors into ``{"field", "message"}`` pairs whose message says how to fix it."""
    out: list[dict[str, str]] = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(p) for p in err.get("loc", ())) or "(body)"
        kind = err.get("type", "")
        msg = str(err.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]  # the spec's own message already names field and fix
            named = msg.split(":", 1)[0]
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, SpecFieldError):
                field = cause.field  # a key inside the field, e.g. options.steps
            elif field == "(body)" and named.split(".", 1)[0] in known_fields:
                field = named  # a check across fields (e.g. audio or session) names its field first
        elif kind == "extra_forbidden":
            msg = f"unknown field {field!r}; remove it (allowed fields: {', '.join(known_fields)})"
        elif kind == "missing":
            msg = f"{field}: required; add it"
        else:
            msg = f"{field}: {msg} (got {_short(err.get('input'))}); fix the value"
        out.append({"field": field, "message": msg})
    return out


_SERVER_PATH_RE = re.compile(r"(?<![\w:/.~-])/(?:[^\s'\"/]+/)+([^\s'\"/]+)")


def public_message(message: str | None) -> str | None:
    """A job's error message as the tenant sees it: absolute server paths (the worker's download
    directory, the file root) cut to their last name; URIs (``s3://…``, ``file:///…``) are kept."""
    return None if message is None else _SERVER_PATH_RE.sub(r"\1", message)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def job_view(rec: JobRecord) -> JobView:
    elapsed = 0.0
    if rec.started_at is not None and rec.status == "running":
        elapsed = max(0.0, (datetime.now(UTC) - rec.started_at).total_seconds())
    return JobView(
        id=rec.id,
        tenant=rec.tenant,
        status=rec.status,
        attempts=rec.attempts,
        progress=ProgressView(
            chunks_done=rec.chunks_done,
            num_chunks=rec.num_chunks,
            frames_done=rec.frames_done,
            num_frames=rec.num_frames,
            seconds_done=rec.seconds_done,
            elapsed_s=elapsed,
            moved_at=rec.progress_at,
            chunk_delay_s=_float_or_none((rec.session_state or {}).get("chunk_delay_s")),
        ),
        cancel_requested=rec.cancel_requested,
        error_code=rec.error_code,
        error_message=public_message(rec.error_message),
        outputs=dict(rec.outputs),
        created_at=rec.created_at,
        started_at=rec.started_at,
        finished_at=rec.finished_at,
        spec=rec.spec.model_dump(mode="json"),
        session=_session_view(rec),
    )


def _session_view(rec: JobRecord) -> dict[str, object] | None:
    if rec.session_state is None:
        return None
    view = dict(rec.session_state)
    view.setdefault("end_reason", None)
    if isinstance(view.get("error"), str):
        view["error"] = public_message(str(view["error"]))
    return view


def _float_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


@dataclass
class Deps:
    settings: Settings
    auth: TokenAuth
    signer: PreviewSigner
    engine: Engine
    store: JobStore
    objects: ObjectStore
    celery: Celery
    kvs_endpoint_url: str | None
    metrics: ApiMetrics


class ApiMetrics:
    """The API's Prometheus metrics, in the app's own registry (served by ``/metrics``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "longtake_api_requests",
            "API requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "longtake_api_request_seconds", "API request latency", ["route"], registry=self.registry
        )
        self.submitted = Counter(
            "longtake_api_jobs_submitted",
            "Jobs created through the API (replays not counted)",
            registry=self.registry,
        )
        self.rejected = Counter(
            "longtake_api_submissions_rejected",
            "Submissions rejected before anything was queued",
            ["code"],
            registry=self.registry,
        )


def get_deps(request: Request) -> Deps:
    """The app's :class:`Deps` (a FastAPI dependency of every route)."""
    return cast(Deps, request.app.state.deps)


def tenant_of(deps: Deps, request: Request) -> str:
    try:
        return deps.auth.tenant_for(request.headers.get("authorization"))
    except AuthError as exc:
        raise ApiError(
            401, "unauthorized", exc.message, headers={"WWW-Authenticate": exc.www_authenticate()}
        ) from exc


def media_type(request: Request) -> str:
    """The request's ``Content-Type`` without parameters, lower case ('' when absent)."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def check_job_id(job_id: str) -> None:
    if not JOB_ID_RE.match(job_id):
        raise ApiError(
            404, "not_found", f"job {job_id[:64]!r} not found; job ids are lowercase UUIDs returned by submit"
        )


def get_own(deps: Deps, job_id: str, tenant: str) -> JobRecord:
    check_job_id(job_id)
    rec = deps.store.get(job_id, tenant=tenant)
    if rec is None or rec.tenant != tenant:
        # Same answer for "missing" and "someone else's": existence must not leak across tenants.
        raise ApiError(404, "not_found", f"job {job_id} not found for your tenant")
    return rec
