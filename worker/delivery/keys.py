"""Object keys: every key the worker and the API build goes through here.

Who calls what: the job's delivery builds its prefix with :func:`job_prefix` and every object name
under it with :func:`safe_key`; the API stores an ``upload://<id>`` input at :func:`upload_key` and
the task reads it back from the same key (:func:`parse_upload_uri` reads the id back from the URI). Keys are *relative* to
the store's own root; both stores re-check every key with :func:`check_relative_key`, so a
caller-supplied name can never reach another tenant's objects.
"""

from __future__ import annotations

import re

# Ids (tenant, job) are one path segment of safe characters; names under a prefix are one or more.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
UPLOAD_SCHEME = "upload://"


def upload_key(tenant: str, upload_id: str) -> str:
    """Object key of the ``upload://<upload_id>`` input of ``tenant``: the API writes it, the task
    downloads it."""
    return f"tenants/{tenant}/uploads/{upload_id}"


def parse_upload_uri(uri: str) -> str | None:
    """The id of an ``upload://<id>`` URI; None for any other URI."""
    return uri[len(UPLOAD_SCHEME) :].rstrip("/") if uri.startswith(UPLOAD_SCHEME) else None




def job_prefix(tenant: str, job_id: str) -> str:
    """``tenants/<tenant>/jobs/<job_id>/``; each id must be one safe path segment."""
    for field, value in (("tenant", tenant), ("job_id", job_id)):
        if not isinstance(value, str) or not _ID_RE.fullmatch(value) or ".." in value:
            raise ValueError(
                f"{field}={value!r} is not a valid id: use 1-128 characters of A-Z a-z 0-9 _ . - "
                "starting with a letter or digit (no '/', no '..')"
            )
    return f"tenants/{tenant}/jobs/{job_id}/"


def check_relative_key(key: str, *, field: str = "key") -> str:
    """Validate a store-relative key: '/'-separated safe segments, nothing that climbs or encodes."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"{field}={key!r} is empty; pass a relative object name like 'out/final.mp4'")
    segments = key.split("/")
    for seg in segments:
        if seg in ("", ".", "..") or not _SEGMENT_RE.fullmatch(seg):
            raise ValueError(
                f"{field}={key!r} is not a safe object key (segment {seg!r}): use '/'-separated "
                "segments of A-Z a-z 0-9 _ . - that do not start with '.', with no leading '/', "
                "'..', '%', '\\' or empty segments"
            )
    return key


def safe_key(prefix: str, name: str) -> str:
    """``prefix + name`` after checking that ``name`` stays inside ``prefix``.

    ``prefix`` must end with '/' (as :func:`job_prefix` returns). Rejected: absolute names,
    ``..``/``.`` segments, empty segments, backslashes, percent-encoding, control characters and
    anything outside the safe alphabet, so no decoding layer (URL, shell, filesystem) can turn the
    key into a path outside the prefix.
    """
    if not prefix.endswith("/"):
        raise ValueError(f"prefix={prefix!r} must end with '/' (build it with job_prefix())")
    check_relative_key(prefix.rstrip("/"), field="prefix")
    check_relative_key(name, field="name")
    return prefix + name
