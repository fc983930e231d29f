"""Job routes: submit (JSON or multipart with uploads), get, list, cancel, outputs.

Who calls what: the router is included by :func:`worker.api.app.create_app`. Submission order (what
makes "nothing queued" true for every rejected request): authenticate -> parse and validate the
whole spec (with the operator's ``file_root`` as validation context) -> check that every
``upload://`` input exists under the caller's tenant -> create the row (idempotent on the tenant's
``idempotency_key``) -> send the Celery message carrying only the job id
(:func:`worker.jobs.queue.enqueue_render`, one try: a broker outage leaves the row queued and
unpublished for the workers' outbox sweeper, and the submission still answers at once). A request that fails any step before "create" leaves no
row and no message (and no uploaded object: :func:`worker.api.uploads.cleanup_on_error`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Any, cast

from fastapi import APIRouter, Depends, File, Form, Query, Request, Response, UploadFile
from pydantic import ValidationError

from worker.access import InputGrants, InputRefusedError
from worker.api.deps import (
    API_PREFIX,
    ApiError,
    Deps,
    field_errors,
    get_deps,
    get_own,
    job_view,
    media_type,
    tenant_of,
)
from worker.api.media import probe_stored, probe_upload
from worker.api.quotas import check_quota
from worker.api.uploads import check_upload_size, cleanup_on_error, job_parts, store_upload
from worker.client import JobListView, JobView, OutputsView, SegmentView
from worker.delivery.keys import parse_upload_uri, upload_key
from worker.delivery.object_store import ObjectStore
from worker.jobs.queue import enqueue_render
from worker.jobs.records import JobStatus
from worker.spec import JobSpec, spec_context

logger = logging.getLogger(__name__)

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
_UPLOAD_FIELDS = ("image", "audio")

router = APIRouter()


_JSON_TYPES = ("application/json",)
_MAX_JSON_DEPTH = 64


async def _json_body(request: Request) -> bytes:
    """The body of a JSON route, read only once its content type says JSON (the gate has already
    authenticated the caller and bounds the body's size)."""
    media = media_type(request)
    if media not in _JSON_TYPES:
        get_deps(request).metrics.rejected.labels("unsupported_media_type").inc()
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type: {media or '(none)'!r} is not accepted here; send the job spec as JSON with "
            "Content-Type: application/json (files go to POST /v1/jobs/upload as multipart/form-data)",
            errors=[{"field": "Content-Type", "message": "send application/json"}],
        )
    return await request.body()


def _load_json(raw: bytes | str, field: str) -> object:
    """``json.loads`` that answers 400 naming ``field`` for bad or too deeply nested JSON."""
    try:
        data = json.loads(raw or b"null")
    except RecursionError as exc:  # 100,000 nested brackets: the C scanner gives up
        raise _too_deep(field) from exc
    except ValueError as exc:
        raise ApiError(
            400,
            "invalid_json",
            f"{field}: not valid JSON ({str(exc)[:200]}); send the job spec as a JSON object",
            errors=[{"field": field, "message": "not valid JSON"}],
        ) from exc
    if _depth(data) > _MAX_JSON_DEPTH:
        raise _too_deep(field)
    return data


def _too_deep(field: str) -> ApiError:
    return ApiError(
        400,
        "invalid_json",
        f"{field}: JSON nested deeper than {_MAX_JSON_DEPTH} levels; a job spec is a few levels deep, "
        "send a flat object",
        errors=[{"field": field, "message": "nested too deeply"}],
    )


def _depth(value: object) -> int:
    """Nesting depth of parsed JSON, without recursion (no RecursionError on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level > _MAX_JSON_DEPTH:
                return level
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


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


def _parse_spec(deps: Deps, data: object, tenant: str, *, probed: Sequence[str] = ()) -> JobSpec:
    """The whole submit check of a spec: shape, fields (strict), input grants, quota, then each
    ``upload://`` input exists under the tenant and its bytes pass the media probe (``probed``:
    keys already probed by the multipart route)."""
    if not isinstance(data, dict):
        raise ApiError(
            422,
            "invalid_spec",
            "(body): the request body must be a JSON object (the job spec), e.g. "
            '{"image": "s3://bucket/face.png", "audio": "s3://bucket/speech.wav"}',
            errors=[{"field": "(body)", "message": "not a JSON object"}],
        )
    if "tenant" in data:
        raise ApiError(
            422,
            "invalid_spec",
            "tenant: is set by your bearer token, not by the spec; remove the field",
            errors=[{"field": "tenant", "message": "set by your token; remove it"}],
        )
    spec = _validate(deps, data)
    _check_grants(deps, spec, tenant)
    check_quota(deps, tenant, spec)
    for field in _UPLOAD_FIELDS:
        uri = getattr(spec, field)
        if uri is None:  # a live session's audio comes over its WebSocket
            continue
        upload_id = parse_upload_uri(uri)
        if upload_id is None:
            continue
        key = upload_key(tenant, upload_id)
        if not deps.objects.exists(key):
            raise ApiError(
                422,
                "invalid_spec",
                f"{field}: upload://{upload_id} was not uploaded by your tenant; upload the file first "
                "(POST /v1/uploads or the multipart POST /v1/jobs/upload)",
                errors=[{"field": field, "message": "unknown upload"}],
            )
        if key not in probed:
            probe_stored(deps, field, key, uri)
    return spec


def _validate(deps: Deps, data: dict[str, Any]) -> JobSpec:
    try:
        context = spec_context(
            deps.settings.file_root, deps.settings.models, session_idle_max_s=deps.settings.session_idle_max_s
        )
        return JobSpec.model_validate(data, context=context)
    except ValidationError as exc:
        errors = field_errors(exc, known_fields=list(JobSpec.model_fields))
        raise ApiError(422, "invalid_spec", "; ".join(e["message"] for e in errors), errors=errors) from exc


def _check_grants(deps: Deps, spec: JobSpec, tenant: str) -> None:
    """Every input must be the tenant's own upload or under a prefix granted to it (403)."""
    grants = InputGrants.from_settings(deps.settings)
    for field in _UPLOAD_FIELDS:
        if getattr(spec, field) is None:
            continue
        try:
            grants.check(tenant, field, getattr(spec, field))
        except InputRefusedError as exc:
            raise ApiError(
                403, exc.code, exc.message, errors=[{"field": field, "message": exc.message}]
            ) from exc


def _same_request(existing: dict[str, Any], spec: JobSpec, *, ignore: Sequence[str] = ()) -> bool:
    new = spec.model_dump(mode="json")
    return {k: v for k, v in existing.items() if k not in ignore} == {
        k: v for k, v in new.items() if k not in ignore
    }


def _create_and_enqueue(
    deps: Deps, spec: JobSpec, tenant: str, response: Response, *, uploaded: Sequence[str] = ()
) -> JobView:
    started = datetime.now().astimezone()
    rec = deps.store.create(spec, tenant=tenant)
    created = spec.idempotency_key is None or rec.created_at >= started
    if not created:
        existing = rec.spec.model_dump(mode="json")
        ignore = [f for f in _UPLOAD_FIELDS
                  if getattr(spec, f) is not None and parse_upload_uri(getattr(spec, f)) is not None] if uploaded else []
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
            return job_view(rec)
        # Still queued and never claimed: the first submission's message may have been lost (broker
        # down). Sending again is safe: a claim is a conditional UPDATE, a second message is a no-op.
    _publish(deps, rec.id, spec.priority)
    if created:
        deps.metrics.submitted.inc()
        response.status_code = 201
        logger.info("job %s: created for tenant %s and queued", rec.id, tenant)
    return job_view(rec)



def _publish(deps: Deps, job_id: str, priority: int) -> None:
    """Send the job's message with one try (``retry=False``: milliseconds when Redis is down,
    instead of the publish retry policy's ~33 s, beyond a client's 30 s timeout). On failure the
    job stays queued, marked unpublished, and the workers' outbox sweeper sends it once the broker
    is back (:func:`worker.jobs.reaper.sweep_once`): the submission still succeeds."""
    try:
        enqueue_render(deps.celery, job_id, queue=deps.settings.queue_name, priority=priority, retry=False)
    except Exception as exc:
        logger.warning("job %s: broker unreachable at submit (%s); the sweeper will publish it", job_id, exc)
        try:
            deps.store.mark_unpublished(job_id)
        except Exception as mark_exc:  # still found by the sweeper: no message in the broker
            logger.warning("job %s: could not mark it unpublished (%s)", job_id, mark_exc)


@router.post(
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
def submit(
    request: Request,
    response: Response,
    deps: Annotated[Deps, Depends(get_deps)],
    body: Annotated[bytes, Depends(_json_body)],
) -> JobView:
    tenant = tenant_of(deps, request)
    try:
        spec = _parse_spec(deps, _load_json(body, "(body)"), tenant)
    except ApiError as exc:
        deps.metrics.rejected.labels(exc.code).inc()
        raise
    return _create_and_enqueue(deps, spec, tenant, response)

@router.post(
    f"{API_PREFIX}/jobs/upload",
    response_model=JobView,
    status_code=201,
    responses={200: {"model": JobView, "description": "idempotent replay: the existing job"}},
    summary="Submit a job with its image and/or audio uploaded in the same multipart request",
)
def submit_upload(
    request: Request,
    response: Response,
    deps: Annotated[Deps, Depends(get_deps)],
    spec: Annotated[str, Form(description="the job spec as JSON, without the uploaded inputs")] = "{}",
    image: Annotated[UploadFile | None, File(description="reference image file")] = None,
    audio: Annotated[UploadFile | None, File(description="driving audio file")] = None,
    _parts: Annotated[None, Depends(job_parts)] = None,
) -> JobView:
    tenant = tenant_of(deps, request)
    data = _load_json(spec, "spec")
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
        checked = _validate(deps, data)
    except ApiError:
        deps.metrics.rejected.labels("invalid_spec").inc()
        raise
    _check_grants(deps, checked, tenant)  # the spec's own inputs; the uploads are the tenant's
    check_quota(deps, tenant, checked)
    for field, upload in files.items():
        if upload is not None:
            check_upload_size(deps, upload, field)
            probe_upload(deps, field, upload.file, upload.filename)
    keys: list[str] = []
    with cleanup_on_error(deps, keys):
        for field, upload in files.items():
            if upload is not None:
                uri, key = store_upload(deps, tenant, upload, field)
                keys.append(key)
                data[field] = uri
        job_spec = _parse_spec(deps, data, tenant, probed=keys)
        return _create_and_enqueue(deps, job_spec, tenant, response, uploaded=keys)


@router.get(f"{API_PREFIX}/jobs/{{job_id}}", response_model=JobView, summary="Get one job")
def get_job(request: Request, job_id: str, deps: Annotated[Deps, Depends(get_deps)]) -> JobView:
    tenant = tenant_of(deps, request)
    return job_view(get_own(deps, job_id, tenant))

@router.get(f"{API_PREFIX}/jobs", response_model=JobListView, summary="List your jobs, newest first")
def list_jobs(
    request: Request,
    deps: Annotated[Deps, Depends(get_deps)],
    status: Annotated[str | None, Query(description="queued|running|succeeded|failed|cancelled")] = None,
    before: Annotated[datetime | None, Query(description="only jobs created before this time")] = None,
    limit: Annotated[int, Query(ge=1, le=500, description="at most this many jobs")] = 50,
) -> JobListView:
    tenant = tenant_of(deps, request)
    if status is not None and status not in JOB_STATUSES:
        raise ApiError(
            422,
            "invalid_request",
            f"status: {status!r} is not a job status; use one of {', '.join(JOB_STATUSES)}",
        )
    recs = deps.store.list(
        tenant=tenant, status=cast("JobStatus | None", status), limit=limit, before=before
    )
    views = [job_view(r) for r in recs]
    next_before = views[-1].created_at if len(views) == limit else None
    return JobListView(jobs=views, next_before=next_before)

@router.post(
    f"{API_PREFIX}/jobs/{{job_id}}/cancel",
    response_model=JobView,
    status_code=202,
    summary="Ask a job to stop (takes effect between chunks)",
)
def cancel_job(request: Request, job_id: str, deps: Annotated[Deps, Depends(get_deps)]) -> JobView:
    tenant = tenant_of(deps, request)
    get_own(deps, job_id, tenant)
    accepted = deps.store.request_cancel(job_id, tenant=tenant)
    rec = get_own(deps, job_id, tenant)
    if not accepted:
        raise ApiError(409, "not_cancellable", f"job {job_id} is already {rec.status}; nothing to cancel")
    return job_view(rec)

@router.get(
    f"{API_PREFIX}/jobs/{{job_id}}/outputs",
    response_model=OutputsView,
    summary="Presigned URLs of the final MP4, the playlist and the committed segments",
)
def job_outputs(request: Request, job_id: str, deps: Annotated[Deps, Depends(get_deps)]) -> OutputsView:
    tenant = tenant_of(deps, request)
    rec = get_own(deps, job_id, tenant)
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
