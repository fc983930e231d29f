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

from worker.api.deps import API_PREFIX, ApiError, Deps, get_deps, tenant_of
from worker.delivery.keys import upload_key

logger = logging.getLogger(__name__)

router = APIRouter()

UPLOAD_PART_BYTES = 8 * 1024 * 1024
"""Uploads larger than this are streamed to the object store as a multipart upload of parts this
size (S3's minimum part is 5 MiB), so the API holds at most one part of a file in memory."""


def store_upload(deps: Deps, tenant: str, upload: UploadFile, field: str) -> tuple[str, str]:
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
) -> dict[str, object]:
    uri, _key = store_upload(deps, tenant_of(deps, request), file, "file")
    return {"uri": uri, "nbytes": file.size}
