"""The HTTP API (FastAPI): submit, get, list, cancel, outputs, preview, uploads, /healthz, /metrics.

Who calls what: ``longtake api`` (and ``longtake up``) build the app once per process with
:func:`create_app` and serve it with uvicorn; tests build it with their own settings. The app holds
one SQLAlchemy engine (through :class:`worker.jobs.store.JobStore`), one object store and one Celery app
(used only to *send* messages). Endpoints are plain ``def`` so FastAPI runs the blocking store
calls in its thread pool.

Submission order (what makes "nothing queued" true for every rejected request): authenticate ->
parse and validate the whole spec (with the operator's ``file_root`` as validation context) ->
check that every ``upload://`` input exists under the caller's tenant -> create the row (idempotent
on the tenant's ``idempotency_key``) -> send the Celery message carrying only the job id. A request
that fails any step before "create" leaves no row and no message.

The response bodies are the wire models of :mod:`worker.client`, so the Python client and the
server share one schema. Errors are ``{"error": code, "message": text, "errors": [...]}``; the
message names the field, the bad value and the fix. Another tenant's job is answered exactly like a
missing one (404), so job ids do not leak across tenants.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, cast

from celery import Celery
from fastapi import Depends, FastAPI, File, Form, Query, Request, Response, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from sqlalchemy import text
from sqlalchemy.engine import Engine

from worker.api.auth import AuthError, PreviewSigner, TokenAuth
from worker.client import (
    JobListView,
    JobView,
    OutputsView,
    PreviewView,
    ProgressView,
    SegmentView,
)
from worker.delivery.keys import job_prefix, parse_upload_uri, safe_key, upload_key
from worker.delivery.object_store import ObjectStore
from worker.delivery.s3_sink import PLAYLIST_NAME, presigned_playlist
from worker.delivery.storage import open_object_store
from worker.errors import ObjectNotFoundError
from worker.jobs.queue import create_celery_app, enqueue_render
from worker.jobs.records import JobRecord, JobStatus
from worker.jobs.store import JobStore
from worker.settings import Settings
from worker.spec import JobSpec, spec_context

logger = logging.getLogger(__name__)

API_PREFIX = "/v1"
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
_JOB_ID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_UPLOAD_FIELDS = ("image", "audio")

__all__ = ["ApiError", "create_app"]


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


def _field_errors(exc: ValidationError, *, known_fields: Sequence[str]) -> list[dict[str, str]]:
    """Turn pydantic errors into ``{"field", "message"}`` pairs whose message says how to fix it."""
    out: list[dict[str, str]] = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(p) for p in err.get("loc", ())) or "(body)"
        kind = err.get("type", "")
        msg = str(err.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]  # the spec's own message already names field and fix
        elif kind == "extra_forbidden":
            msg = f"unknown field {field!r}; remove it (allowed fields: {', '.join(known_fields)})"
        elif kind == "missing":
            msg = f"{field}: required; add it"
        else:
            msg = f"{field}: {msg} (got {err.get('input')!r}); fix the value"
        out.append({"field": field, "message": msg})
    return out


def _job_view(rec: JobRecord) -> JobView:
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
        ),
        cancel_requested=rec.cancel_requested,
        error_code=rec.error_code,
        error_message=rec.error_message,
        outputs=dict(rec.outputs),
        created_at=rec.created_at,
        started_at=rec.started_at,
        finished_at=rec.finished_at,
        spec=rec.spec.model_dump(mode="json"),
    )


@dataclass
class _Deps:
    settings: Settings
    auth: TokenAuth
    signer: PreviewSigner
    engine: Engine
    store: JobStore
    objects: ObjectStore
    celery: Celery
    kvs_endpoint_url: str | None
    metrics: _Metrics


class _Metrics:
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


def create_app(
    settings: Settings,
    *,
    engine: Engine | None = None,
    objects: ObjectStore | None = None,
    celery: Celery | None = None,
    kvs_endpoint_url: str | None = None,
) -> FastAPI:
    """Build the API app. ``engine``/``objects``/``celery`` default to what ``settings`` describe
    (``celery`` is only used to publish). Nothing connects at build time: the first request does."""
    from worker.jobs.db import make_engine

    auth = TokenAuth.from_setting(settings.api_tokens)
    if not auth.tenants:
        logger.warning("no API tokens configured (LONGTAKE_API_TOKENS): every request will get 401")
    if engine is None:
        engine = make_engine(settings.database_url, pool_size=settings.db_pool_size)
    if objects is None:
        objects = open_object_store(settings.object_store_url, endpoint_url=settings.s3_endpoint_url)
    if celery is None:
        celery = create_celery_app(settings)
    deps = _Deps(
        settings=settings,
        auth=auth,
        signer=PreviewSigner(settings.api_tokens),
        engine=engine,
        store=JobStore(engine),
        objects=objects,
        celery=celery,
        kvs_endpoint_url=kvs_endpoint_url or getattr(settings, "kvs_endpoint_url", None),
        metrics=_Metrics(),
    )
    app = FastAPI(
        title="longtake",
        version="0.1.0",
        description="Render audio-driven avatar videos of any length. Authenticate with "
        "`Authorization: Bearer <token>`; each token belongs to one tenant, which sees only its own jobs.",
    )
    app.state.deps = deps
    _install_handlers(app, deps)
    _install_routes(app, deps)
    return app


# ---------------------------------------------------------------------------------------------- handlers


def _install_handlers(app: FastAPI, deps: _Deps) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        body: dict[str, object] = {"error": exc.code, "message": exc.message}
        if exc.errors:
            body["errors"] = exc.errors
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ()) if p not in ("query", "body", "path")]
            field = ".".join(loc) or "(request)"
            errors.append({"field": field, "message": f"{field}: {err.get('msg')}; fix the value"})
        message = "; ".join(e["message"] for e in errors)
        return JSONResponse({"error": "invalid_request", "message": message, "errors": errors}, 422)

    @app.middleware("http")
    async def _count(request: Request, call_next: Callable[[Request], Any]) -> Response:
        start = time.perf_counter()
        response: Response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", "unmatched")
        deps.metrics.requests.labels(name, str(response.status_code)).inc()
        deps.metrics.latency.labels(name).observe(time.perf_counter() - start)
        return response


async def _raw_body(request: Request) -> bytes:
    return await request.body()


def _tenant(deps: _Deps, request: Request) -> str:
    try:
        return deps.auth.tenant_for(request.headers.get("authorization"))
    except AuthError as exc:
        raise ApiError(
            401, "unauthorized", exc.message, headers={"WWW-Authenticate": exc.www_authenticate()}
        ) from exc


def _check_job_id(job_id: str) -> None:
    if not _JOB_ID_RE.match(job_id):
        raise ApiError(
            404, "not_found", f"job {job_id[:64]!r} not found; job ids are lowercase UUIDs returned by submit"
        )


def _get_own(deps: _Deps, job_id: str, tenant: str) -> JobRecord:
    _check_job_id(job_id)
    rec = deps.store.get(job_id, tenant=tenant)
    if rec is None or rec.tenant != tenant:
        # Same answer for "missing" and "someone else's": existence must not leak across tenants.
        raise ApiError(404, "not_found", f"job {job_id} not found for your tenant")
    return rec


def _kvs_preview(deps: _Deps, job_id: str, stream_name: str, region: str) -> PreviewView:
    """A LIVE HLS session URL of the job's KVS stream (GetHLSStreamingSessionURL), using the API
    process' AWS credentials (boto3's default chain). Not configured / not reachable -> no URL, and
    ``detail`` says why and what to do."""
    from worker.delivery.kvs.putmedia import PutMediaClient

    expires = min(deps.settings.presign_expires_s, 43200)  # KVS caps session URLs at 12 h
    try:
        client = PutMediaClient(stream_name, region=region, endpoint_url=deps.kvs_endpoint_url)
        url = client.hls_session_url(expires_s=expires)
    except Exception as exc:
        logger.warning("job %s: no KVS HLS session URL for stream %s: %s", job_id, stream_name, exc)
        return PreviewView(
            job_id=job_id,
            kind="kvs",
            detail=f"KVS HLS playback is not available for stream {stream_name!r} ({region}): "
            f"{type(exc).__name__}: {exc}; check the API's AWS credentials and that the stream is receiving media",
        )
    return PreviewView(
        job_id=job_id,
        kind="kvs",
        url=url,
        expires_s=expires,
        detail=f"KVS LIVE HLS session for stream {stream_name!r}",
    )


def _key_of_uri(objects: ObjectStore, uri: str) -> str:
    """Object key of a URI this store produced (``objects.uri(key)``)."""
    probe = "k"
    base = objects.uri(probe)[: -len(probe)]
    if not uri.startswith(base):
        raise ApiError(
            500,
            "output_elsewhere",
            f"output {uri!r} is not in this API's object store ({base}); "
            "check LONGTAKE_OBJECT_STORE_URL matches the workers'",
        )
    return uri[len(base) :]


# ---------------------------------------------------------------------------------------------- submit


def _parse_spec(deps: _Deps, data: object, tenant: str) -> JobSpec:
    if not isinstance(data, dict):
        raise ApiError(
            422,
            "invalid_spec",
            "the request body must be a JSON object (the job spec), e.g. "
            '{"image": "s3://bucket/face.png", "audio": "s3://bucket/speech.wav"}',
        )
    if "tenant" in data:
        raise ApiError(
            422,
            "invalid_spec",
            "tenant: is set by your bearer token, not by the spec; remove the field",
            errors=[{"field": "tenant", "message": "set by your token; remove it"}],
        )
    try:
        spec = JobSpec.model_validate(data, context=spec_context(deps.settings.file_root))
    except ValidationError as exc:
        errors = _field_errors(exc, known_fields=list(JobSpec.model_fields))
        raise ApiError(422, "invalid_spec", "; ".join(e["message"] for e in errors), errors=errors) from exc
    for field in _UPLOAD_FIELDS:
        upload_id = parse_upload_uri(getattr(spec, field))
        if upload_id is not None and not deps.objects.exists(upload_key(tenant, upload_id)):
            raise ApiError(
                422,
                "invalid_spec",
                f"{field}: upload://{upload_id} was not uploaded by your tenant; upload the file first "
                "(POST /v1/uploads or the multipart POST /v1/jobs/upload)",
                errors=[{"field": field, "message": "unknown upload"}],
            )
    return spec


def _same_request(existing: dict[str, Any], spec: JobSpec, *, ignore: Sequence[str] = ()) -> bool:
    new = spec.model_dump(mode="json")
    return {k: v for k, v in existing.items() if k not in ignore} == {
        k: v for k, v in new.items() if k not in ignore
    }


def _create_and_enqueue(
    deps: _Deps, spec: JobSpec, tenant: str, response: Response, *, uploaded: Sequence[str] = ()
) -> JobView:
    started = datetime.now().astimezone()
    rec = deps.store.create(spec, tenant=tenant)
    created = spec.idempotency_key is None or rec.created_at >= started
    if not created:
        existing = rec.spec.model_dump(mode="json")
        ignore = [f for f in _UPLOAD_FIELDS if parse_upload_uri(getattr(spec, f)) is not None] if uploaded else []
        for key in uploaded:  # the replay reuses the first submission's inputs
            deps.objects.delete(key)
        if not _same_request(existing, spec, ignore=ignore):
            deps.metrics.rejected.labels("idempotency_conflict").inc()
            raise ApiError(
                409,
                "idempotency_conflict",
                f"idempotency_key: {spec.idempotency_key!r} was already used for job {rec.id} with a "
                "different spec; use a new key for a new job",
            )
        response.status_code = 200
        if rec.status != "queued" or rec.attempts > 0:
            return _job_view(rec)
        # Still queued and never claimed: the first submission's message may have been lost (broker
        # down). Sending again is safe: a claim is a conditional UPDATE, a second message is a no-op.
    try:
        enqueue_render(deps.celery, rec.id, queue=deps.settings.queue_name, priority=spec.priority)
    except Exception as exc:
        logger.error("job %s: could not enqueue: %s", rec.id, exc)
        if spec.idempotency_key is None:
            # Nobody can re-send this one: fail it rather than leave a queued row no worker will see.
            deps.store.fail(rec.id, code="enqueue_failed", message=f"broker unreachable at submit: {exc}")
            hint = "submit again"
        else:
            hint = "submit again with the same idempotency_key (the job is kept and will be enqueued)"
        raise ApiError(
            503, "broker_unavailable", f"job {rec.id} could not be queued ({exc}); {hint}"
        ) from exc
    if created:
        deps.metrics.submitted.inc()
        response.status_code = 201
        logger.info("job %s: created for tenant %s and queued", rec.id, tenant)
    return _job_view(rec)


UPLOAD_PART_BYTES = 8 * 1024 * 1024
"""Uploads larger than this are streamed to the object store as a multipart upload of parts this
size (S3's minimum part is 5 MiB), so the API holds at most one part of a file in memory."""


def _store_upload(deps: _Deps, tenant: str, upload: UploadFile, field: str) -> tuple[str, str]:
    """Copy one uploaded file into the object store under the tenant; return (upload URI, key)."""
    limit = deps.settings.upload_max_bytes
    too_large = ApiError(
        413,
        "upload_too_large",
        f"{field}: the file is over the {limit}-byte limit; send a smaller file "
        "or ask the operator to raise LONGTAKE_UPLOAD_MAX_BYTES",
    )
    if upload.size is not None and upload.size > limit:
        raise too_large
    upload_id = uuid.uuid4().hex
    key = upload_key(tenant, upload_id)
    first = upload.file.read(UPLOAD_PART_BYTES)
    if not first:
        raise ApiError(422, "invalid_upload", f"{field}: the uploaded file is empty; send the file's bytes")
    nxt = upload.file.read(UPLOAD_PART_BYTES)
    if not nxt:
        if len(first) > limit:
            raise too_large
        deps.objects.put_bytes(key, first, content_type=upload.content_type)
        return f"upload://{upload_id}", key
    mp_id = deps.objects.create_multipart(key, content_type=upload.content_type)
    try:
        parts: list[tuple[int, str]] = []
        total = 0
        part = first
        while part:
            total += len(part)
            if total > limit:
                raise too_large
            parts.append((len(parts) + 1, deps.objects.upload_part(key, mp_id, len(parts) + 1, part)))
            part, nxt = nxt, upload.file.read(UPLOAD_PART_BYTES) if nxt else b""
        deps.objects.complete_multipart(key, mp_id, parts)
    except BaseException:
        deps.objects.abort_multipart(key, mp_id)
        raise
    return f"upload://{upload_id}", key


@contextmanager
def _cleanup_on_error(deps: _Deps, keys: list[str]) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for key in keys:
            try:
                deps.objects.delete(key)
            except Exception:  # the original error matters more; log this one
                logger.exception("could not delete orphaned upload %s", key)
        raise


# ---------------------------------------------------------------------------------------------- routes


def _install_routes(app: FastAPI, deps: _Deps) -> None:
    # The JSON submit endpoint reads its body itself (so auth runs first and errors read well);
    # publish JobSpec's schema in the OpenAPI document by hand.
    spec_schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    extra_schemas: dict[str, Any] = dict(spec_schema.pop("$defs", {}))
    extra_schemas["JobSpec"] = spec_schema

    def _openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(extra_schemas)
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = _openapi  # type: ignore[method-assign]

    @app.post(
        f"{API_PREFIX}/jobs",
        response_model=JobView,
        status_code=201,
        responses={200: {"model": JobView, "description": "idempotent replay: the existing job"}},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}}},
            }
        },
        summary="Submit a job (JSON spec with s3://, file:// or upload:// inputs)",
    )
    def submit(request: Request, response: Response, body: Annotated[bytes, Depends(_raw_body)]) -> JobView:
        tenant = _tenant(deps, request)
        try:
            data = json.loads(body or b"null")
        except ValueError as exc:
            deps.metrics.rejected.labels("invalid_json").inc()
            raise ApiError(
                400,
                "invalid_json",
                f"the body is not valid JSON ({exc}); send the job spec "
                "as a JSON object with Content-Type: application/json",
            ) from exc
        try:
            spec = _parse_spec(deps, data, tenant)
        except ApiError as exc:
            deps.metrics.rejected.labels(exc.code).inc()
            raise
        return _create_and_enqueue(deps, spec, tenant, response)

    @app.post(
        f"{API_PREFIX}/jobs/upload",
        response_model=JobView,
        status_code=201,
        responses={200: {"model": JobView, "description": "idempotent replay: the existing job"}},
        summary="Submit a job with its image and/or audio uploaded in the same multipart request",
    )
    def submit_upload(
        request: Request,
        response: Response,
        spec: Annotated[str, Form(description="the job spec as JSON, without the uploaded inputs")] = "{}",
        image: Annotated[UploadFile | None, File(description="reference image file")] = None,
        audio: Annotated[UploadFile | None, File(description="driving audio file")] = None,
    ) -> JobView:
        tenant = _tenant(deps, request)
        try:
            data = json.loads(spec)
        except ValueError as exc:
            raise ApiError(
                400,
                "invalid_json",
                f"spec: not valid JSON ({exc}); send the job spec as a JSON object in the 'spec' form field",
            ) from exc
        if not isinstance(data, dict):
            raise ApiError(422, "invalid_spec", "spec: must be a JSON object (the job spec)")
        files = {"image": image, "audio": audio}
        placeholder = "upload://" + "0" * 32
        for field, upload in files.items():
            if upload is not None and field in data:
                raise ApiError(
                    422,
                    "invalid_spec",
                    f"{field}: given both as a file and in the spec; "
                    "leave it out of the spec when you upload it",
                )
            if upload is not None:
                data[field] = placeholder  # validate everything else before storing any bytes
        try:
            JobSpec.model_validate(data, context=spec_context(deps.settings.file_root))
        except ValidationError as exc:
            errors = _field_errors(exc, known_fields=list(JobSpec.model_fields))
            deps.metrics.rejected.labels("invalid_spec").inc()
            raise ApiError(
                422, "invalid_spec", "; ".join(e["message"] for e in errors), errors=errors
            ) from exc
        keys: list[str] = []
        with _cleanup_on_error(deps, keys):
            for field, upload in files.items():
                if upload is not None:
                    uri, key = _store_upload(deps, tenant, upload, field)
                    keys.append(key)
                    data[field] = uri
            job_spec = _parse_spec(deps, data, tenant)
            return _create_and_enqueue(deps, job_spec, tenant, response, uploaded=keys)

    @app.post(
        f"{API_PREFIX}/uploads", status_code=201, summary="Upload one input file; returns its upload:// URI"
    )
    def upload_file(
        request: Request, file: Annotated[UploadFile, File(description="image or audio file")]
    ) -> dict[str, object]:
        tenant = _tenant(deps, request)
        uri, key = _store_upload(deps, tenant, file, "file")
        return {"uri": uri, "nbytes": file.size}

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}", response_model=JobView, summary="Get one job")
    def get_job(request: Request, job_id: str) -> JobView:
        tenant = _tenant(deps, request)
        return _job_view(_get_own(deps, job_id, tenant))

    @app.get(f"{API_PREFIX}/jobs", response_model=JobListView, summary="List your jobs, newest first")
    def list_jobs(
        request: Request,
        status: Annotated[str | None, Query(description="queued|running|succeeded|failed|cancelled")] = None,
        before: Annotated[datetime | None, Query(description="only jobs created before this time")] = None,
        limit: Annotated[int, Query(ge=1, le=500, description="at most this many jobs")] = 50,
    ) -> JobListView:
        tenant = _tenant(deps, request)
        if status is not None and status not in JOB_STATUSES:
            raise ApiError(
                422,
                "invalid_request",
                f"status: {status!r} is not a job status; use one of {', '.join(JOB_STATUSES)}",
            )
        recs = deps.store.list(
            tenant=tenant, status=cast("JobStatus | None", status), limit=limit, before=before
        )
        views = [_job_view(r) for r in recs]
        next_before = views[-1].created_at if len(views) == limit else None
        return JobListView(jobs=views, next_before=next_before)

    @app.post(
        f"{API_PREFIX}/jobs/{{job_id}}/cancel",
        response_model=JobView,
        status_code=202,
        summary="Ask a job to stop (takes effect between chunks)",
    )
    def cancel_job(request: Request, job_id: str) -> JobView:
        tenant = _tenant(deps, request)
        _get_own(deps, job_id, tenant)
        accepted = deps.store.request_cancel(job_id, tenant=tenant)
        rec = _get_own(deps, job_id, tenant)
        if not accepted:
            raise ApiError(409, "not_cancellable", f"job {job_id} is already {rec.status}; nothing to cancel")
        return _job_view(rec)

    @app.get(
        f"{API_PREFIX}/jobs/{{job_id}}/outputs",
        response_model=OutputsView,
        summary="Presigned URLs of the final MP4, the playlist and the committed segments",
    )
    def job_outputs(request: Request, job_id: str) -> OutputsView:
        tenant = _tenant(deps, request)
        rec = _get_own(deps, job_id, tenant)
        expires = deps.settings.presign_expires_s
        outputs = dict(rec.outputs)
        final = outputs.get("mp4")
        playlist = outputs.get("hls")
        segs = [
            SegmentView(
                index=s.index,
                url=deps.objects.presign_get(s.key, expires),
                nbytes=s.nbytes,
                duration_s=s.duration_s,
                checksum=s.checksum,
            )
            for s in deps.store.segments(job_id)
        ]
        return OutputsView(
            job_id=rec.id,
            status=rec.status,
            partial=rec.outputs_partial or rec.status in ("failed", "cancelled"),
            final=deps.objects.presign_get(_key_of_uri(deps.objects, final), expires)
            if final and rec.status == "succeeded"
            else None,
            playlist=deps.objects.presign_get(_key_of_uri(deps.objects, playlist), expires)
            if playlist
            else None,
            segments=segs,
            expires_s=expires,
        )

    @app.get(
        f"{API_PREFIX}/jobs/{{job_id}}/preview",
        response_model=PreviewView,
        summary="Where to watch the job while it renders (HLS playlist or KVS)",
    )
    def job_preview(request: Request, job_id: str) -> PreviewView:
        tenant = _tenant(deps, request)
        rec = _get_own(deps, job_id, tenant)
        preview = rec.spec.preview
        if preview.kvs is not None:
            return _kvs_preview(deps, rec.id, preview.kvs.stream_name, preview.kvs.region)
        if not preview.hls:
            return PreviewView(
                job_id=rec.id, kind="none", detail="the job was submitted with preview.hls=false"
            )
        if not deps.objects.exists(safe_key(job_prefix(rec.tenant, rec.id), PLAYLIST_NAME)):
            return PreviewView(
                job_id=rec.id,
                kind="none",
                detail=f"no playlist yet (status {rec.status}); ask again once a chunk is committed",
            )
        expires = deps.settings.presign_expires_s
        exp = int(time.time()) + expires
        url = str(
            request.url_for("preview_playlist", job_id=rec.id).include_query_params(
                exp=exp, sig=deps.signer.sign(rec.id, exp)
            )
        )
        return PreviewView(
            job_id=rec.id,
            kind="hls",
            url=url,
            expires_s=expires,
            detail="HLS EVENT playlist; every segment URL in it is presigned",
        )

    @app.get(
        f"{API_PREFIX}/jobs/{{job_id}}/preview.m3u8",
        name="preview_playlist",
        summary="The job's live HLS playlist with presigned segment URLs (signed link, no bearer)",
        response_class=Response,
        responses={200: {"content": {"application/vnd.apple.mpegurl": {}}}},
    )
    def preview_playlist(job_id: str, exp: int, sig: str) -> Response:
        # Players reload this URL without our bearer header: the signed link is the authorisation.
        if not _JOB_ID_RE.match(job_id) or not deps.signer.check(job_id, exp, sig):
            raise ApiError(
                403,
                "bad_signature",
                "this preview link is invalid or expired; get a fresh one from GET /v1/jobs/{job_id}/preview",
            )
        rec = deps.store.get(job_id)
        if rec is None:
            raise ApiError(404, "not_found", f"job {job_id} not found")
        try:
            body = presigned_playlist(
                deps.objects, job_prefix(rec.tenant, rec.id), expires_s=max(60, exp - int(time.time()))
            )
        except ObjectNotFoundError as exc:
            raise ApiError(404, "not_found", f"job {job_id} has no playlist yet") from exc
        except ValueError as exc:  # a name in the stored playlist escapes the job's directory
            logger.error("job %s: refusing to presign its playlist: %s", job_id, exc)
            raise ApiError(
                500,
                "bad_playlist",
                f"job {job_id}: the stored playlist names an object outside "
                "the job; it was not served (see the API log)",
            ) from exc
        return Response(
            body, media_type="application/vnd.apple.mpegurl", headers={"Cache-Control": "no-store"}
        )

    @app.get("/healthz", summary="Database and broker reachability (200 ok / 503)")
    def healthz() -> JSONResponse:
        checks: dict[str, str] = {}
        try:
            with deps.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            checks["database"] = "ok"
        except Exception as exc:
            checks["database"] = f"error: {type(exc).__name__}: {exc}"[:300]
        try:
            with deps.celery.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2, timeout=2)
            checks["broker"] = "ok"
        except Exception as exc:
            checks["broker"] = f"error: {type(exc).__name__}: {exc}"[:300]
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", **checks}, status_code=200 if ok else 503
        )

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(deps.metrics.registry), media_type=CONTENT_TYPE_LATEST)
