"""Uploads: ``POST /v1/uploads`` and the streaming copy of an uploaded file into the object store.

Who calls what: the router is included by :func:`worker.api.app.create_app`; the multipart submit
(:mod:`worker.api.jobs`) stores its files with :func:`store_upload` under
:func:`worker.delivery.keys.upload_key` — the key the task downloads ``upload://<id>`` from — and
deletes them again if the submission is refused (:func:`cleanup_on_error`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, File, Request, UploadFile

from worker.api.deps import API_PREFIX, ApiError, Deps, get_deps, media_type, tenant_of
from worker.delivery.keys import upload_key

logger = logging.getLogger(__name__)

router = APIRouter()

FILE_PART_TYPES: dict[str, tuple[str, ...]] = {
    "image": ("image/", "application/octet-stream"),
    "audio": ("audio/", "video/", "application/octet-stream"),
    "file": ("image/", "audio/", "video/", "application/octet-stream"),
}
"""Content types accepted for each file part (prefixes); a part typed e.g. text/html is refused."""

UPLOAD_PART_BYTES = 8 * 1024 * 1024
"""Uploads larger than this are streamed to the object store as a multipart upload of parts this
size (S3's minimum part is 5 MiB), so the API holds at most one part of a file in memory."""


def upload_too_large(limit: int, field: str) -> ApiError:
    return ApiError(
        413,
        "upload_too_large",
        f"{field}: the file is over the {limit}-byte limit; send a smaller file "
        "or ask the operator to raise LONGTAKE_UPLOAD_MAX_BYTES",
        errors=[{"field": field, "message": f"over {limit} bytes"}],
    )


def check_upload_size(deps: Deps, upload: UploadFile, field: str) -> None:
    """413 when the parsed part is already known to be over ``upload_max_bytes`` (before it is
    probed or stored)."""
    if upload.size is not None and upload.size > deps.settings.upload_max_bytes:
        raise upload_too_large(deps.settings.upload_max_bytes, field)


def store_upload(deps: Deps, tenant: str, upload: UploadFile, field: str) -> tuple[str, str]:
    """Copy one uploaded file into the object store under the tenant; return (upload URI, key)."""
    limit = deps.settings.upload_max_bytes
    too_large = upload_too_large(limit, field)
    check_upload_size(deps, upload, field)
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


async def job_parts(request: Request) -> None:
    """The multipart submit's parts: one ``spec`` field, at most one ``image`` and one ``audio``."""
    await _check_parts(request, fields=("spec",), files=("image", "audio"))


async def upload_parts(request: Request) -> None:
    """``POST /v1/uploads``'s parts: one ``file``."""
    await _check_parts(request, fields=(), files=("file",))


async def _check_parts(request: Request, *, fields: tuple[str, ...], files: tuple[str, ...]) -> None:
    """Refuse a body that is not multipart, has a part not named in ``fields``/``files`` (or one
    twice), a field sent as a file or the other way round, or a file part of the wrong type: before
    anything is stored. The form is already parsed (bounded by the gate) for the route's parameters."""
    allowed = (*fields, *files)
    if media_type(request) != "multipart/form-data":
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type: {media_type(request) or '(none)'!r} is not accepted here; send "
            f"multipart/form-data with the parts {', '.join(allowed)}",
            errors=[{"field": "Content-Type", "message": "send multipart/form-data"}],
        )
    form = await request.form()
    seen: set[str] = set()
    for name, value in form.multi_items():
        if name not in allowed or name in seen:
            problem = "appears twice" if name in seen else "is not taken by this route"
            raise ApiError(
                422,
                "invalid_upload",
                f"{name[:64]}: the part {problem}; send only the parts {', '.join(allowed)}, once each",
                errors=[{"field": name[:64], "message": f"part {problem}"}],
            )
        seen.add(name)
        is_file = not isinstance(value, str)
        if (name in fields) == is_file:
            kind = "a form field (JSON text)" if name in fields else "a file"
            raise ApiError(
                422, "invalid_upload", f"{name}: must be {kind}", errors=[{"field": name, "message": kind}]
            )
        if is_file:
            ctype = (getattr(value, "content_type", None) or "application/octet-stream").lower()
            if not ctype.startswith(FILE_PART_TYPES[name]):
                raise ApiError(
                    422,
                    "invalid_upload",
                    f"{name}: the file part is typed {ctype[:64]!r}; send it as "
                    f"{' or '.join(t + ('*' if t.endswith('/') else '') for t in FILE_PART_TYPES[name])}",
                    errors=[{"field": name, "message": f"content type {ctype[:64]!r} refused"}],
                )


@contextmanager
def cleanup_on_error(deps: Deps, keys: list[str]) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for key in keys:
            try:
                deps.objects.delete(key)
            except Exception:  # the original error matters more; log this one
                logger.exception("could not delete orphaned upload %s", key)
        raise


@router.post(
    f"{API_PREFIX}/uploads", status_code=201, summary="Upload one input file; returns its upload:// URI"
)
def upload_file(
    request: Request,
    deps: Annotated[Deps, Depends(get_deps)],
    file: Annotated[UploadFile, File(description="image or audio file")],
    _parts: Annotated[None, Depends(upload_parts)] = None,
) -> dict[str, object]:
    uri, _key = store_upload(deps, tenant_of(deps, request), file, "file")
    return {"uri": uri, "nbytes": file.size}
