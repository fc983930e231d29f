"""Preview routes: where to watch a job while it renders, the page that plays it, the signed playlist
and (for stores without HTTP URLs) the signed segments.

Who calls what: the router is included by :func:`worker.api.app.create_app`; ``longtake preview JOB``
(:func:`worker.cli.cmd_preview`) prints ``page_url`` of ``GET /v1/jobs/{id}/preview``:

- ``GET /v1/jobs/{id}/preview`` (bearer) -> :class:`worker.client.PreviewView`: ``page_url`` (the
  player page, ``preview.html?src=preview.m3u8?exp=…&sig=…``) and ``url`` (the playlist itself, for
  VLC/ffplay/Safari). Players reload a live playlist without our bearer header, so the links carry
  an HMAC signature (:class:`worker.api.auth.PreviewSigner`) instead;
- ``GET /v1/jobs/{id}/preview.html`` -> ``worker/delivery/static/preview.html`` (static; holds no job
  data, the signature travels in its ``src``);
- ``GET /v1/jobs/{id}/preview.m3u8?exp=&sig=`` -> the job's current playlist, its init/segment names
  rewritten by :func:`_segment_url` into presigned object-store URLs or signed API links
  (``Settings.preview_segments``; ``auto`` = API links for a ``file://`` store, which players refuse);
- ``GET /v1/jobs/{id}/preview/{name}?exp=&sig=`` -> one init/segment object of the job.

The signed routes answer with ``Access-Control-Allow-Origin: *`` (errors included), so the page
opened from elsewhere (a file, another host) can read them; they carry no credentials, only the
capability in the link.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from importlib import resources
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request, Response

from worker.api.deps import API_PREFIX, JOB_ID_RE, ApiError, Deps, get_deps, get_own, tenant_of
from worker.client import PreviewView
from worker.delivery.keys import job_prefix, safe_key
from worker.delivery.kvs.putmedia import PutMediaClient
from worker.delivery.s3_sink import PLAYLIST_NAME
from worker.errors import ObjectNotFoundError

logger = logging.getLogger(__name__)

router = APIRouter()

CORS_HEADERS = {"Access-Control-Allow-Origin": "*", "Access-Control-Expose-Headers": "Content-Length"}
_MAP_PREFIX = '#EXT-X-MAP:URI="'
_MEDIA_TYPES = {".mp4": "video/mp4", ".m4s": "video/iso.segment"}


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
    summary="Where to watch the job while it renders: a player page, the HLS playlist, or KVS",
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
    expires = deps.settings.presign_expires_s
    exp = int(time.time()) + expires
    query = f"exp={exp}&sig={deps.signer.sign(rec.id, exp)}"
    playlist = f"{request.url_for('preview_playlist', job_id=rec.id)}?{query}"
    # relative src: the page and the playlist share the job's directory on this API
    page = f"{request.url_for('preview_page', job_id=rec.id)}?src={quote(f'preview.m3u8?{query}', safe='')}"
    if rec.spec.session is not None:
        page += "&edge=3"  # a viewer joining a live session starts at its live edge, not at its start
    ready = deps.objects.exists(safe_key(job_prefix(rec.tenant, rec.id), PLAYLIST_NAME))
    return PreviewView(
        job_id=rec.id,
        kind="hls",
        url=playlist,
        page_url=page,
        expires_s=expires,
        detail="open page_url in a browser: it plays the render while it runs"
        + ("" if ready else f" (no segment yet, status {rec.status}: the page waits for the first)"),
    )


@router.get(
    f"{API_PREFIX}/jobs/{{job_id}}/preview.html",
    name="preview_page",
    summary="The player page for the job's live preview (static; pass ?src= as GET .../preview gives it)",
    response_class=Response,
    responses={200: {"content": {"text/html": {}}}},
)
def preview_page(job_id: str) -> Response:
    if not JOB_ID_RE.match(job_id):
        raise ApiError(404, "not_found", f"job {job_id} not found", headers=CORS_HEADERS)
    page = resources.files("worker.delivery").joinpath("static/preview.html").read_bytes()
    return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})


def _check_link(deps: Deps, job_id: str, exp: int, sig: str) -> tuple[str, str]:
    """The job's (tenant, object prefix) when ``exp``/``sig`` are a valid link to it, else 403/404."""
    if not JOB_ID_RE.match(job_id) or not deps.signer.check(job_id, exp, sig):
        raise ApiError(
            403,
            "bad_signature",
            "this preview link is invalid or expired; get a fresh one from GET /v1/jobs/{job_id}/preview "
            "(`longtake preview JOB`)",
            headers=CORS_HEADERS,
        )
    rec = deps.store.get(job_id)
    if rec is None:
        raise ApiError(404, "not_found", f"job {job_id} not found", headers=CORS_HEADERS)
    return rec.tenant, job_prefix(rec.tenant, rec.id)


def _segments_via_api(deps: Deps) -> bool:
    """``Settings.preview_segments`` decided: API links, or presigned store URLs."""
    mode = deps.settings.preview_segments
    if mode == "auto":
        return not deps.objects.presign_get(PLAYLIST_NAME, 60).startswith(("http://", "https://"))
    return mode == "api"


def _segment_url(
    deps: Deps, request: Request, job_id: str, prefix: str, name: str, exp: int, sig: str, *, via_api: bool
) -> str:
    """Where a player fetches init/segment ``name`` of the job (``safe_key`` refuses a name that
    leaves the job's directory with ``ValueError``)."""
    key = safe_key(prefix, name)
    if via_api:
        return f"{request.url_for('preview_object', job_id=job_id, name=name)}?exp={exp}&sig={sig}"
    return deps.objects.presign_get(key, max(60, exp - int(time.time())))


def playlist_with_urls(text: str, url: Callable[[str], str]) -> str:
    """The HLS playlist ``text`` with its ``EXT-X-MAP`` init URI and every segment line replaced by
    ``url(name)``; comments and tags are kept."""
    out = []
    for line in text.splitlines():
        if line.startswith(_MAP_PREFIX) and line.endswith('"'):
            line = f'#EXT-X-MAP:URI="{url(line[len(_MAP_PREFIX) : -1])}"'
        elif line and not line.startswith("#"):
            line = url(line)
        out.append(line)
    return "\n".join(out) + "\n"


@router.get(
    f"{API_PREFIX}/jobs/{{job_id}}/preview.m3u8",
    name="preview_playlist",
    summary="The job's live HLS playlist with fetchable segment URLs (signed link, no bearer)",
    response_class=Response,
    responses={200: {"content": {"application/vnd.apple.mpegurl": {}}}},
)
def preview_playlist(
    request: Request, job_id: str, exp: int, sig: str, deps: Annotated[Deps, Depends(get_deps)]
) -> Response:
    _, prefix = _check_link(deps, job_id, exp, sig)
    try:
        text = deps.objects.get_bytes(safe_key(prefix, PLAYLIST_NAME)).decode()
        via_api = _segments_via_api(deps)
        body = playlist_with_urls(
            text, lambda name: _segment_url(deps, request, job_id, prefix, name, exp, sig, via_api=via_api)
        )
    except ObjectNotFoundError as exc:
        raise ApiError(404, "not_found", f"job {job_id} has no playlist yet", headers=CORS_HEADERS) from exc
    except ValueError as exc:  # a name in the stored playlist escapes the job's directory
        logger.error("job %s: refusing to serve its playlist: %s", job_id, exc)
        raise ApiError(
            500,
            "bad_playlist",
            f"job {job_id}: the stored playlist names an object outside "
            "the job; it was not served (see the API log)",
            headers=CORS_HEADERS,
        ) from exc
    return Response(
        body,
        media_type="application/vnd.apple.mpegurl",
        headers={"Cache-Control": "no-store", **CORS_HEADERS},
    )


@router.get(
    f"{API_PREFIX}/jobs/{{job_id}}/preview/{{name}}",
    name="preview_object",
    summary="One init/segment object of the job's preview (signed link, no bearer)",
    response_class=Response,
    responses={200: {"content": {"video/mp4": {}, "video/iso.segment": {}}}},
)
def preview_object(job_id: str, name: str, exp: int, sig: str, deps: Annotated[Deps, Depends(get_deps)]) -> Response:
    _, prefix = _check_link(deps, job_id, exp, sig)
    suffix = name[name.rfind(".") :] if "." in name else ""
    if suffix not in _MEDIA_TYPES or name == PLAYLIST_NAME:
        raise ApiError(404, "not_found", f"{name!r} is not a preview segment of job {job_id}", headers=CORS_HEADERS)
    try:
        data = deps.objects.get_bytes(safe_key(prefix, name))
    except ValueError as exc:
        raise ApiError(404, "not_found", f"{name!r} is not a preview segment of job {job_id}",
                       headers=CORS_HEADERS) from exc
    except ObjectNotFoundError as exc:
        raise ApiError(404, "not_found", f"job {job_id} has no {name}", headers=CORS_HEADERS) from exc
    # segments never change once written: players may cache them for the link's lifetime
    return Response(data, media_type=_MEDIA_TYPES[suffix],
                    headers={"Cache-Control": "private, max-age=3600", **CORS_HEADERS})
