"""Uploaded media probed at submit: bad images and audio are refused before anything is queued.

Who calls what: the submit routes of :mod:`worker.api.jobs` call :func:`probe_upload` on each file
of a multipart submit (before it is stored) and :func:`probe_stored` on each ``upload://`` input of
a JSON submit (the file was stored earlier by ``POST /v1/uploads``, whose caller did not say
whether it is an image or audio). Both copy the bytes into a private temporary directory and run
:mod:`pipeline.probe` (the CLI's rules and messages, torch-free); the refusal is ``422
invalid_media`` naming the field, with the temporary path replaced by what the caller sent (its
file name or ``upload://`` URI), so no server path is shown. ``s3://`` and ``file://`` inputs are
not read by the API; the worker checks them with the same rules before rendering.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

from pipeline.errors import InvalidInputError
from worker.api.deps import ApiError, Deps

_SUFFIX_RE = re.compile(r"^\.[A-Za-z0-9]{1,8}$")


def probe_upload(deps: Deps, field: str, data: BinaryIO, filename: str | None) -> None:
    """Probe one uploaded file (rewound afterwards); raise ``ApiError(422, "invalid_media")``."""
    shown = Path(filename or field).name[:128] or field
    with tempfile.TemporaryDirectory(prefix="longtake-probe-") as tmp:
        path = Path(tmp) / f"{field}{_suffix(shown)}"
        data.seek(0)
        with path.open("wb") as out:
            shutil.copyfileobj(data, out)
        data.seek(0)
        _probe(deps, field, path, shown)


def probe_stored(deps: Deps, field: str, key: str, uri: str) -> None:
    """Probe an object of the job store (an earlier upload) by downloading it once."""
    with tempfile.TemporaryDirectory(prefix="longtake-probe-") as tmp:
        path = Path(tmp) / field
        deps.objects.download_to(key, path)
        _probe(deps, field, path, uri)


def _probe(deps: Deps, field: str, path: Path, shown: str) -> None:
    # Imported on the first probe: `import worker.api` and /healthz stay free of numpy, PyAV and
    # Pillow (tests/unit/test_deploy.py); the API image installs them for this probe, not torch.
    from pipeline.probe import probe_audio, probe_image

    try:
        if field == "image":
            probe_image(path)
        else:
            probe_audio(path, max_duration_s=deps.settings.max_audio_s)
    except InvalidInputError as exc:
        message = f"{field}: " + str(exc).replace(str(path), shown).replace(str(path.parent), "")
        deps.metrics.rejected.labels("invalid_media").inc()
        raise ApiError(422, "invalid_media", message, errors=[{"field": field, "message": message}]) from exc


def _suffix(name: str) -> str:
    suffix = Path(name).suffix
    return suffix.lower() if _SUFFIX_RE.match(suffix) else ""
