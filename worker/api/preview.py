"""Preview routes: where to watch a job while it renders (HLS playlist or KVS), and the signed playlist.

Who calls what: the router is included by :func:`worker.api.app.create_app`. ``GET /v1/jobs/{id}/preview``
answers a signed link to ``preview.m3u8`` (players reload it without our bearer header: the
signature, from :class:`worker.api.auth.PreviewSigner`, is the authorisation), which serves the job's
current playlist with presigned segment URLs (:func:`worker.delivery.s3_sink.presigned_playlist`).
"""

from __future__ import annotations

import logging
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from worker.api.deps import API_PREFIX, JOB_ID_RE, ApiError, Deps, get_deps, get_own, tenant_of
from worker.client import PreviewView
from worker.delivery.keys import job_prefix, safe_key
from worker.delivery.kvs.putmedia import PutMediaClient
from worker.delivery.s3_sink import PLAYLIST_NAME, presigned_playlist
from worker.errors import ObjectNotFoundError

logger = logging.getLogger(__name__)

router = APIRouter()


def _kvs_preview(deps: Deps, job_id: str, stream_name: str, region: str) -> PreviewView:
    """A LIVE HLS session URL of the job's KVS stream (GetHLSStreamingSessionURL), using the API
    process' AWS credentials (boto3's default chain). Not configured / not reachable -> no URL, and
    ``detail`` says why and what to do."""
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


@router.get(
    f"{API_PREFIX}/jobs/{{job_id}}/preview",
    response_model=PreviewView,
    summary="Where to watch the job while it renders (HLS playlist or KVS)",
)
def job_preview(request: Request, job_id: str, deps: Annotated[Deps, Depends(get_deps)]) -> PreviewView:
    rec = get_own(deps, job_id, tenant_of(deps, request))
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

@router.get(
    f"{API_PREFIX}/jobs/{{job_id}}/preview.m3u8",
    name="preview_playlist",
    summary="The job's live HLS playlist with presigned segment URLs (signed link, no bearer)",
    response_class=Response,
    responses={200: {"content": {"application/vnd.apple.mpegurl": {}}}},
)
def preview_playlist(job_id: str, exp: int, sig: str, deps: Annotated[Deps, Depends(get_deps)]) -> Response:
    # Players reload this URL without our bearer header: the signed link is the authorisation.
    if not JOB_ID_RE.match(job_id) or not deps.signer.check(job_id, exp, sig):
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
