"""The render job specification: what a user asks for, validated once, stored on the job row.

Who builds one: the HTTP API (from JSON or a multipart upload), the Python client, the CLI. The store
keeps ``JobSpec.model_dump(mode="json")`` in ``jobs.spec``; the worker rebuilds it with
``JobSpec.model_validate`` when it claims the job. The tenant is NOT part of the spec: it comes from
authentication and is passed to :meth:`worker.jobs.store.JobStore.create` separately.

Input URIs take one of three forms:

- ``s3://bucket/key`` — an object the worker downloads before rendering;
- ``file:///abs/path`` — a local file, only under the operator's allowed root
  (``Settings.file_root``); rejected when no root is configured;
- ``upload://<upload_id>`` — a file uploaded through the API, stored at
  ``tenants/<tenant>/uploads/<upload_id>`` in the job object store.

The allowed root is passed as validation context (``JobSpec.model_validate(data,
context=spec_context(settings))``). Without a context, ``file://`` URIs are checked for syntax only;
the worker checks the root again before it reads anything (:func:`resolve_file_uri`).

``options`` (the family's sampling options, e.g. ``{"steps": 3}``) are checked by the job's family
for its preset (``ModelFamily.options``, torch-free), as ``preset`` is, with or without a context,
but not when the spec is rebuilt from its row (``STORED_KEY``): there ``render()``'s check of the
same options decides, at run time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pipeline.errors import InvalidInputError
from pipeline.families import DEFAULT_FAMILY, FAMILIES
from pipeline.request import MAX_TEXT_CHARS

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_UPLOAD_ID_RE = re.compile(r"^[A-Za-z0-9_\-]{8,64}$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_\-.:]{1,128}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,256}$")
_REGION_RE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
_PRESET_RE = re.compile(r"^[a-z0-9][a-z0-9._\-]{0,31}$")


FILE_ROOT_KEY = "file_root"
"""Validation-context key: the directory ``file://`` inputs must lie under (None: no file:// at all)."""
MODELS_KEY = "models"
"""Validation-context key: the model names a spec may request (``Settings.models``)."""
SESSION_IDLE_MAX_KEY = "session_idle_max_s"
"""Validation-context key: the longest ``session.idle_timeout_s`` a spec may ask for
(``Settings.session_idle_max_s``)."""
STORED_KEY = "stored"
"""Validation-context key: True when the spec is rebuilt from its job row
(:func:`worker.jobs.records.record_of`). The family's check of ``options`` is not repeated then: a
row whose options this deployment's family no longer takes stays readable (the API shows it, a
worker claims it) and its render refuses them, failing the job ``invalid_input`` with the reason."""


class SpecFieldError(ValueError):
    """A refusal that names a field below the validator's own (``options.steps`` for the ``options``
    validator); the API reports ``field`` as the error's field (:func:`worker.api.deps.field_errors`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def spec_context(
    file_root: Path | str | None,
    models: Iterable[str] | None = None,
    *,
    session_idle_max_s: float | None = None,
) -> dict[str, object]:
    """The context the API passes to ``JobSpec.model_validate`` so ``file://`` URIs are checked
    against the operator's allowed root (``Settings.file_root``), ``model`` against the
    operator's model names (``Settings.models``; None: the name's form only) and a session's idle
    timeout against the operator's cap (``Settings.session_idle_max_s``; None: not checked)."""
    context: dict[str, object] = {FILE_ROOT_KEY: Path(file_root).resolve() if file_root is not None else None}
    if models is not None:
        context[MODELS_KEY] = sorted(models)
    if session_idle_max_s is not None:
        context[SESSION_IDLE_MAX_KEY] = session_idle_max_s
    return context


def _check_no_traversal(field: str, uri: str, path: str) -> None:
    parts = path.split("/")
    if ".." in parts or "." in parts or "//" in path or "\\" in path or "\x00" in path:
        raise ValueError(
            f"{field}: {uri!r} contains '.', '..', '//', a backslash or NUL in its path; "
            "give a normalised path with none of them"
        )


def resolve_file_uri(uri: str, file_root: Path | None, *, field: str = "input") -> Path:
    """Map a ``file://`` URI to a local path that lies under ``file_root`` (symlinks resolved).

    Called at validation (with the API's context) and again by the worker right before it opens
    the file, so a spec stored before the root changed cannot escape it.
    """
    if file_root is None:
        raise ValueError(
            f"{field}: {uri!r} is a file:// URI but this deployment allows none; upload the file "
            "(upload://…) or give an s3:// URI, or ask the operator to set LONGTAKE_FILE_ROOT"
        )
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{field}: {uri!r} names host {parts.netloc!r}; use file:///absolute/path")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"{field}: {uri!r} is not absolute; use file:///absolute/path")
    _check_no_traversal(field, uri, path)
    root = Path(file_root).resolve()
    resolved = Path(path).resolve()
    if resolved != root and root not in resolved.parents:
        raise ValueError(
            f"{field}: {uri!r} resolves outside the allowed root for file:// inputs "
            "(LONGTAKE_FILE_ROOT, set by the operator); put the file under it or upload it"
        )
    return resolved


def _validate_input_uri(field: str, value: str, info: ValidationInfo) -> str:
    if len(value) > 2048:
        raise ValueError(f"{field}: URI of {len(value)} characters; keep it under 2048")
    parts = urlsplit(value)
    scheme = parts.scheme.lower()
    if scheme == "s3":
        if not _BUCKET_RE.match(parts.netloc):
            raise ValueError(f"{field}: {value!r} has no valid bucket name; use s3://bucket/key")
        key = unquote(parts.path).lstrip("/")
        if not key or key.endswith("/"):
            raise ValueError(f"{field}: {value!r} names no object; use s3://bucket/path/to/file")
        _check_no_traversal(field, value, "/" + key)
        if parts.query or parts.fragment:
            raise ValueError(f"{field}: {value!r} has a query or fragment; remove it")
        return value
    if scheme == "file":
        ctx = info.context if isinstance(info.context, dict) else None
        if ctx is not None and FILE_ROOT_KEY in ctx:
            resolve_file_uri(value, ctx[FILE_ROOT_KEY], field=field)
        else:
            path = unquote(parts.path)
            if parts.netloc not in ("", "localhost") or not path.startswith("/"):
                raise ValueError(f"{field}: {value!r} is not file:///absolute/path")
            _check_no_traversal(field, value, path)
        return value
    if scheme == "upload":
        if not _UPLOAD_ID_RE.match(parts.netloc) or parts.path not in ("", "/"):
            raise ValueError(
                f"{field}: {value!r} is not an upload reference; use upload://<id> with the id the "
                "upload endpoint returned (8-64 letters, digits, '-' or '_')"
            )
        return value
    raise ValueError(
        f"{field}: {value!r} has scheme {scheme or '(none)'!r}; use s3://bucket/key, "
        "file:///path under the allowed root, or upload://<id>"
    )


class KvsPreviewSpec(BaseModel):
    """A live preview into an AWS Kinesis Video Streams stream (the stream must already exist)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    stream_name: str = Field(description="KVS stream name (1-256 of A-Z a-z 0-9 _ . -)")
    region: str = Field(description="AWS region of the stream, e.g. us-east-1")

    @field_validator("stream_name")
    @classmethod
    def _stream_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(
                f"preview.kvs.stream_name: {v!r} is not a KVS stream name; use 1-256 of A-Z a-z 0-9 _ . -"
            )
        return v

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        if not _REGION_RE.match(v):
            raise ValueError(f"preview.kvs.region: {v!r} is not an AWS region; use e.g. 'us-east-1'")
        return v


class PreviewSpec(BaseModel):
    """Watching a render while it runs."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    hls: bool = Field(
        default=True, description="Keep an HLS EVENT playlist updated as fragments are uploaded"
    )
    kvs: KvsPreviewSpec | None = Field(default=None, description="Also stream to this KVS stream, or none")


class OutputSpec(BaseModel):
    """What the finished job leaves in object storage."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    container: Literal["mp4"] = Field(default="mp4", description="Final file format (fragmented MP4)")
    keep_segments: bool = Field(
        default=True, description="Keep the per-fragment objects after the final MP4 is made"
    )


SESSION_SAMPLE_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
SESSION_IDLE_DEFAULT_S = 10.0
"""``session.idle_timeout_s`` when the spec gives none (the operator's cap may be lower)."""


class SessionSpec(BaseModel):
    """A live session (issue 13): no audio file; the client streams PCM over the WebSocket
    ``/v1/jobs/{id}/audio`` (docs/sessions.md) and the video is rendered on a live clock."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    sample_rate: int = Field(description=f"Sample rate of the PCM the client sends, one of {SESSION_SAMPLE_RATES} Hz")
    channels: int = Field(default=1, description="Interleaved channels of the PCM, 1 or 2")
    format: str = Field(
        default="s16le", description="Sample format of the PCM; only 's16le' (signed 16-bit little-endian)"
    )
    latency: Literal["default", "low"] = Field(
        default="default",
        description="'default': N and I chunks (about one chunk of look-ahead, smoothest seams); "
        "'low': N chunks only (less delay, seams between chunks)",
    )
    idle_timeout_s: float = Field(
        default=SESSION_IDLE_DEFAULT_S,
        gt=0,
        description="End the session (a final segment, not an error) after this long without audio; "
        "at most the operator's cap (LONGTAKE_SESSION_IDLE_MAX_S)",
    )

    @field_validator("sample_rate")
    @classmethod
    def _sample_rate(cls, v: int) -> int:
        if v not in SESSION_SAMPLE_RATES:
            raise ValueError(f"session.sample_rate: {v!r} Hz is not accepted; use one of {list(SESSION_SAMPLE_RATES)}")
        return v

    @field_validator("channels")
    @classmethod
    def _channels(cls, v: int) -> int:
        if v not in (1, 2):
            raise ValueError(f"session.channels: {v!r}; send mono (1) or interleaved stereo (2)")
        return v

    @field_validator("format")
    @classmethod
    def _format(cls, v: str) -> str:
        if v != "s16le":
            raise ValueError(
                f"session.format: {v!r} is not accepted; send 's16le' (signed 16-bit little-endian PCM, "
                "e.g. `ffmpeg -f s16le`), converting float or 8-bit samples first"
            )
        return v

    @field_validator("idle_timeout_s")
    @classmethod
    def _idle(cls, v: float, info: ValidationInfo) -> float:
        cap = (info.context or {}).get(SESSION_IDLE_MAX_KEY) if isinstance(info.context, dict) else None
        if cap is not None and v > cap:
            raise ValueError(
                f"session.idle_timeout_s: {v:g} s is over this service's cap of {cap:g} s "
                "(LONGTAKE_SESSION_IDLE_MAX_S); ask for at most that"
            )
        return v


class JobSpec(BaseModel):
    """One render request. Frozen; unknown fields are an error (``extra="forbid"``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    image: str = Field(
        description="Reference image URI: s3://, file:// (under the allowed root) or upload://"
    )
    audio: str | None = Field(
        default=None,
        description="Driving audio URI: s3://, file:// (under the allowed root) or upload://; "
        "none for a live session (give `session` instead)",
    )
    session: SessionSpec | None = Field(
        default=None,
        description="A live session: the audio is streamed over the WebSocket /v1/jobs/{id}/audio "
        "instead of given as a file (exactly one of audio / session)",
    )
    text: str | None = Field(
        default=None, description=f"Optional text/scene prompt, at most {MAX_TEXT_CHARS} characters"
    )
    seed: int = Field(
        default=0, ge=0, lt=2**63, description="Seed; the same seed and inputs give the same video"
    )
    family: str = Field(
        default=DEFAULT_FAMILY, description="Model family, a name registered in pipeline.families (e.g. 'tiny')"
    )
    preset: str = Field(default="tiny", description="Model preset name of the family (e.g. 'tiny')")
    model: str | None = Field(
        default=None,
        description="Weights by name, one the operator configured (LONGTAKE_MODELS); None = the preset's default",
    )
    options: dict[str, str | int | float] = Field(
        default_factory=dict,
        description="The family's sampling options for this render, e.g. {\"steps\": 3, \"audio_guidance\": 2.0} "
        "(tiny); checked at submission by the family for the preset (a key it does not take is refused naming "
        "the ones it does) and stored as it reads them (an int option given 3.0 is stored as 3); a key left "
        "out takes the preset's default",
    )
    priority: int = Field(default=5, ge=0, le=9, description="Queue priority 0 (lowest) to 9 (highest)")
    idempotency_key: str | None = Field(
        default=None, description="Client key; a second submission with the same key returns the first job"
    )
    output: OutputSpec = Field(default_factory=OutputSpec)
    preview: PreviewSpec = Field(default_factory=PreviewSpec)

    @field_validator("image", "audio")
    @classmethod
    def _input_uri(cls, v: str | None, info: ValidationInfo) -> str | None:
        return None if v is None else _validate_input_uri(str(info.field_name), v, info)

    @model_validator(mode="after")
    def _audio_or_session(self) -> JobSpec:
        if self.audio is None and self.session is None:
            raise ValueError(
                "audio: required; give the driving audio URI, or `session` "
                '(e.g. {"sample_rate": 16000}) to stream it live over the WebSocket'
            )
        if self.audio is not None and self.session is not None:
            raise ValueError(
                "session: a live session takes its audio from the WebSocket, not from `audio`; "
                "give one of the two"
            )
        return self

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if len(v) > MAX_TEXT_CHARS:
            raise ValueError(
                f"text: {len(v)} characters is over the limit of {MAX_TEXT_CHARS}; shorten the prompt"
            )
        if "\x00" in v:
            raise ValueError("text: contains a NUL character; remove it")
        return v

    @field_validator("family")
    @classmethod
    def _family(cls, v: str) -> str:
        names = FAMILIES.names()
        if v not in names:
            raise ValueError(f"family: {v!r} is not a registered model family; use one of {list(names)}")
        return v

    @field_validator("preset")
    @classmethod
    def _preset(cls, v: str, info: ValidationInfo) -> str:
        if not _PRESET_RE.match(v):
            raise ValueError(
                f"preset: {v!r} is not a preset name; use lowercase letters, digits, '.', '_' or '-' (e.g. 'tiny')"
            )
        family = info.data.get("family")
        if family is not None:  # None: the family itself was refused, and says so
            try:
                FAMILIES.get(family).preset(v)  # torch-free: presets are plain descriptions
            except InvalidInputError as exc:
                raise ValueError(f"preset: {exc}; pick a preset of family {family!r}") from exc
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | None, info: ValidationInfo) -> str | None:
        # weights are chosen by name from the operator's allow-list, never by a path in the request
        if v is None:
            return None
        allowed = (info.context or {}).get(MODELS_KEY)
        if not _PRESET_RE.match(v) or (allowed is not None and v not in allowed):
            raise ValueError(f"model: {v!r} is not a model this service offers; use one of {list(allowed or [])}")
        return v

    @field_validator("options", mode="before")
    @classmethod
    def _options(cls, v: object, info: ValidationInfo) -> object:
        # before the strict types: the family's message (key, value, bounds, preset default) is the
        # one a bad value gets, not pydantic's per-type ones
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise ValueError(
                f"options: must be an object of option names to values (got {type(v).__name__}); send e.g. "
                '{"steps": 3, "audio_guidance": 2.0}'
            )
        family, preset = info.data.get("family"), info.data.get("preset")
        stored = isinstance(info.context, dict) and info.context.get(STORED_KEY)
        if family is not None and preset is not None and not stored:  # None: refused, and says so
            fam = FAMILIES.get(family)
            try:  # the family's own check (torch-free), the one render() applies again
                checked = fam.options(fam.preset(preset), v)
            except InvalidInputError as exc:
                raise SpecFieldError(exc.field or "options", str(exc)) from exc
            v = {key: checked.get(key, value) for key, value in v.items()}
        for key, value in v.items():
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise SpecFieldError(
                    f"options.{key}", f"options.{key}: must be a number or a string (got {type(value).__name__})"
                )
        return v

    @field_validator("idempotency_key")
    @classmethod
    def _idempotency_key(cls, v: str | None) -> str | None:
        if v is not None and not _KEY_RE.match(v):
            raise ValueError(
                f"idempotency_key: {v!r} is not allowed; use 1-128 of A-Z a-z 0-9 _ - . : (e.g. a UUID)"
            )
        return v
