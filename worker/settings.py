"""Deployment settings: the only place that reads environment variables (prefix ``LONGTAKE_``).

Built once per process by its entry point (CLI command, the worker app's first access, API app
factory) with ``Settings()`` and passed down; nothing creates settings at import time.
Each component receives the fields it needs, not the whole object.

The defaults are the embedded ones (SQLite, a local directory as object store) so a laptop needs
no servers; production sets ``LONGTAKE_DATABASE_URL``, ``LONGTAKE_BROKER_URL`` and
``LONGTAKE_OBJECT_STORE_URL``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_TOKENS_FORMAT = (
    "a JSON object token -> tenant, e.g. LONGTAKE_API_TOKENS='{\"<token>\": \"tenant-a\"}', or the "
    "compact form tenant:token[,tenant:token...], e.g. LONGTAKE_API_TOKENS='tenant-a:<token>'"
)

_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
_GRANT_RE = re.compile(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]/([A-Za-z0-9_.\-]+/)*$")


class TenantQuota(BaseModel):
    """One tenant's submit quota (``Settings.tenant_quotas``); None = no limit. Checked by the API at
    submit (:mod:`worker.api.quotas`), from the jobs table, so it holds across API processes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    jobs_in_flight: int | None = Field(
        default=None, ge=0, description="Jobs queued or running at once (0 = submissions closed)"
    )
    submissions_per_hour: int | None = Field(
        default=None, ge=0, description="Jobs created in any 60 minutes (idempotent replays not counted)"
    )


class Settings(BaseSettings):
    """Every field has a docstring-like description and a constraint."""

    # hide_input_in_errors: values hold secrets (tokens, database passwords); messages name the field
    model_config = SettingsConfigDict(
        env_prefix="LONGTAKE_", extra="ignore", frozen=True, hide_input_in_errors=True
    )

    # --- storage of record -------------------------------------------------------------------
    database_url: str = Field(
        default="sqlite:///.longtake/longtake.db",
        description="SQLAlchemy URL of the jobs database, e.g. postgresql+psycopg://user@host/db",
    )
    db_pool_size: int = Field(
        default=5, ge=1, le=100, description="Connections kept per process (PostgreSQL)"
    )
    db_retry_attempts: int = Field(
        default=8, ge=1, le=100, description="Tries of one DB operation on connection loss before giving up"
    )
    db_retry_max_wait_s: float = Field(
        default=4.0, gt=0, le=60, description="Longest back-off between two tries of one DB operation"
    )
    db_outage_max_s: float = Field(
        default=300.0,
        gt=0,
        description="How long a worker's DB operations keep retrying a lost database (its render goes on, "
        "segments spool to disk and are committed once it is back; the reapers hold off meanwhile). "
        "Past this the attempt stops as if its lease were lost and the job resumes after its last "
        "committed segment",
    )
    object_store_url: str = Field(
        default="file://.longtake/objects",
        description="Where outputs go: s3://bucket/prefix or file:///abs/dir (a relative file:// path is "
        "taken from the working directory)",
    )
    kvs_endpoint_url: str | None = Field(
        default=None, description="Kinesis Video Streams control endpoint (a local stand-in); None = AWS"
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (MinIO, moto); None = AWS"
    )
    file_root: Path | None = Field(
        default=None, description="Directory that file:// inputs must lie under; None rejects file:// inputs"
    )
    work_dir: Path = Field(
        default=Path(".longtake/work"), description="Scratch directory for downloaded inputs"
    )

    # --- queue ---------------------------------------------------------------------------------
    broker_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Celery broker URL (redis://host:port/db); 'memory://' for the embedded demo",
    )
    queue_name: str = Field(default="longtake", description="Celery queue the render tasks go to")
    max_job_s: float = Field(
        default=48 * 3600.0,
        gt=0,
        description="Longest a job may run (wall clock); the broker visibility timeout must exceed it",
    )
    visibility_timeout_s: int = Field(
        default=72 * 3600,
        gt=0,
        description="Redis visibility timeout: an unacked message is redelivered after this",
    )
    broker_socket_timeout_s: float = Field(
        default=10.0, gt=0, description="Redis socket (read/connect) timeout"
    )
    broker_retry_max_s: float = Field(
        default=300.0, gt=0, description="How long the worker keeps retrying a lost broker connection"
    )
    republish_after_s: float = Field(
        default=15.0,
        gt=0,
        description="The outbox sweeper (every reaper_interval_s, in each worker) republishes a queued "
        "job whose message was sent more than this long ago and is no longer in the broker (lost to "
        "a Redis restart or a dead worker); a job never published (broker down at submit) is sent on "
        "the next pass. A lost message is re-sent within republish_after_s + reaper_interval_s",
    )

    # --- leases -------------------------------------------------------------------------------
    lease_s: float = Field(
        default=20.0,
        gt=0,
        description="A claim is valid this long unless heartbeated. With reaper_interval_s it states how "
        "long a dead worker's job waits: death -> another worker resumes it within lease_s + "
        "reaper_interval_s (25 s by default; plus the claim and input fetch). A database outage does "
        "not count against it (see db_outage_max_s)",
    )
    heartbeat_s: float = Field(
        default=5.0, gt=0, description="Interval between lease heartbeats (< lease_s / 2)"
    )
    max_attempts: int = Field(
        default=3, ge=1, le=100, description="Claims per job before it is failed for good"
    )
    state_every: int = Field(
        default=8,
        ge=1,
        le=1000,
        description="Store the resume state with every N-th segment (1 = every segment). The tiny "
        "preset's state is ~1.1 MB against ~250 kB of video per segment; a retry re-renders at most "
        "N-1 segments, which reproduce the committed bytes and are not uploaded again",
    )
    reaper_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="How often each worker's reaper thread requeues expired leases (0 = off)",
    )
    reaper_enabled: bool = Field(default=True, description="Run the reaper thread in the worker process")
    cancel_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="After a cancel (or a lost lease): wait this long for the render to stop between "
        "chunks, then kill the node's rank processes (they restart, cold, with the next job)",
    )
    kill_grace_s: float = Field(
        default=5.0, ge=0, description="At worker shutdown: seconds the ranks get to exit before SIGKILL"
    )
    cancel_poll_s: float = Field(
        default=1.0, gt=0, description="How often a running job's cancel flag is read"
    )
    progress_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="A render that sends nothing (no progress, no fragment) for this long is stalled: "
        "its ranks are killed and the attempt is retried ('render_stalled'). If the worker itself is "
        "stuck (a sink that never returns), its lease keeper stops heartbeating once another "
        "cancel_grace_s + lease_s have passed, so the reaper hands the job to another worker. Must "
        "exceed the slowest chunk, the first one's model loading included",
    )

    # --- rendering ----------------------------------------------------------------------------
    node_ranks: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Rank processes of the worker's NodeEngine (one per GPU; 1 on a CPU-only machine)",
    )
    node_device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="Device type of the ranks; auto = cuda when the NVIDIA driver lists a GPU, else cpu "
        "(decided without initialising CUDA in the worker process)",
    )
    node_preset: str = Field(
        default="tiny",
        description="Model preset the ranks load and shard up front when node_ranks > 1 (jobs for "
        "another preset then fail with a clear error); with one rank any preset is loaded on first use",
    )
    node_threads_per_rank: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="torch threads per rank; 0 = the rank's share of the cores minus one for its "
        "publisher thread (pipeline.host.default_threads)",
    )
    checkpoint: Path | None = Field(
        default=None, description="Model checkpoint for the preset (None = preset default)"
    )
    worker_name: str | None = Field(default=None, description="Lease owner name; default host:pid")

    # --- operations ---------------------------------------------------------------------------
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Prometheus endpoint port of a worker; 0 = off"
    )
    log_level: str = Field(default="INFO", description="Root log level")
    log_json: bool = Field(default=True, description="Structured JSON logs (one object per line)")

    # --- HTTP API -----------------------------------------------------------------------------
    api_host: str = Field(default="127.0.0.1", description="Address the API binds")
    api_port: int = Field(default=8000, ge=0, le=65535, description="Port the API binds")
    api_tokens: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="Bearer token -> tenant id: a JSON object in LONGTAKE_API_TOKENS, or the compact "
        "form tenant:token[,tenant:token...] (tenant names and token lengths are checked by the API)",
    )
    presign_expires_s: int = Field(
        default=3600, gt=0, le=7 * 86400, description="Lifetime of presigned output URLs"
    )
    upload_max_bytes: int = Field(default=512 * 1024 * 1024, gt=0, description="Largest accepted upload")
    api_db_retry_attempts: int = Field(
        default=4,
        ge=1,
        le=100,
        description="Tries of one database operation in the API before it answers 503 with "
        "Retry-After (about 1 s with 4; the workers retry far longer: db_outage_max_s)",
    )

    # --- API hardening: input grants, request bounds, rate limits, media checks, quotas -----------
    input_grants: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Tenant -> s3://bucket/prefix/ list the API and the workers may read inputs from for "
        "that tenant ('*' = every tenant), JSON in LONGTAKE_INPUT_GRANTS, e.g. "
        '{"tenant-a": ["s3://assets/tenant-a/"], "*": ["s3://public-assets/"]}. Uploads '
        "(upload://) are always the uploader's own; any other s3:// input is refused",
    )
    api_json_max_bytes: int = Field(
        default=256 * 1024, gt=0, description="Largest body of a JSON request (413 above it)"
    )
    api_rate_per_s: float = Field(
        default=20.0,
        ge=0,
        description="Requests per second each bearer token may make (token bucket, per API process; "
        "0 = no limit); over it the answer is 429 with Retry-After",
    )
    api_rate_burst: int = Field(
        default=60, ge=1, description="Requests a token may make at once before api_rate_per_s applies"
    )
    max_audio_s: float | None = Field(
        default=None,
        gt=0,
        description="Longest driving audio accepted at submit, in seconds (None = no cap); checked on "
        "uploaded audio from its header",
    )
    tenant_quotas: dict[str, TenantQuota] = Field(
        default_factory=dict,
        description="Tenant ('*' = any tenant without its own entry) -> quota checked at submit, JSON in "
        'LONGTAKE_TENANT_QUOTAS, e.g. {"*": {"jobs_in_flight": 10, "submissions_per_hour": 200}}',
    )

    @field_validator("input_grants")
    @classmethod
    def _grants(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for tenant, prefixes in value.items():
            if tenant != "*" and not _TENANT_RE.match(tenant):
                raise ValueError(
                    f"LONGTAKE_INPUT_GRANTS: {tenant!r} is not a tenant name; use the tenant of "
                    "LONGTAKE_API_TOKENS or '*' for every tenant"
                )
            for prefix in prefixes:
                if not _GRANT_RE.match(prefix) or "/../" in prefix or "/./" in prefix or "//" in prefix[5:]:
                    raise ValueError(
                        f"LONGTAKE_INPUT_GRANTS[{tenant!r}]: {prefix!r} is not a grant; write "
                        "s3://bucket/ or s3://bucket/prefix/ (ending in '/', no '..')"
                    )
        return value

    # --- live sessions (issue 13, docs/sessions.md) ----------------------------------------------
    session_max_s: float = Field(
        default=4 * 3600.0,
        gt=0,
        description="Longest live session, in seconds of its timeline: the session ends there "
        "('max_duration', a final segment, the job succeeds). A session also ends at max_job_s of wall "
        "time, whichever comes first",
    )
    session_idle_max_s: float = Field(
        default=300.0,
        gt=0,
        description="Longest idle timeout a session spec may ask for (session.idle_timeout_s)",
    )
    session_max_ahead_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="Audio a sender may send ahead of real time: beyond it the API stops reading the "
        "WebSocket (TCP back-pressure) until the live clock catches up",
    )
    session_max_lag_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="When the sender is late by more than this, the live clock renders silence (the "
        "avatar listens) and places the late audio after it",
    )
    session_message_max_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        le=16 * 1024 * 1024,
        description="Largest WebSocket message a sender may send (a PCM message or a JSON control "
        "message); over it the stream is refused with close code 1009",
    )
    session_ready_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="How long a session's WebSocket waits for a worker to pick the job up before it "
        "gives up (close code 1013, the job is cancelled)",
    )

    # --- preview page (worker/api/preview.py) -----------------------------------------------------
    preview_segments: Literal["auto", "api", "presigned"] = Field(
        default="auto",
        description="Where the preview playlist points players for init/segments: 'api' = the API "
        "serves them (signed links, same origin as the preview page: no bucket CORS needed); "
        "'presigned' = presigned object-store URLs (S3 serves the bytes; the bucket needs a CORS rule "
        "allowing GET from the page's origin); 'auto' = 'api' for a file:// store (players refuse "
        "file:// URLs), else 'presigned'",
    )

    # --- API clients (the `longtake submit/status/wait/fetch/cancel/preview` commands) -------------
    api_url: str | None = Field(
        default=None,
        description="Base URL the client commands talk to, e.g. http://127.0.0.1:8000 (`longtake up` "
        "prints it); None = http://api_host:api_port",
    )
    api_token: str | None = Field(
        default=None,
        repr=False,
        description="Bearer token the client commands send (`longtake up` prints it; one of the "
        "tokens in LONGTAKE_API_TOKENS of the server)",
    )

    @field_validator("api_tokens", mode="before")
    @classmethod
    def _parse_api_tokens(cls, value: object) -> object:
        """LONGTAKE_API_TOKENS as a JSON object or as ``tenant:token,...``; other types pass through
        to pydantic (a dict given in code)."""
        if not isinstance(value, str):
            return value
        return parse_api_tokens_env(value)

    def client_api_url(self) -> str:
        """Where the client commands send requests: ``api_url``, else the API's own bind address."""
        return self.api_url or f"http://{self.api_host}:{self.api_port}"

    def resolved_node_device(self) -> str:
        """``node_device`` with ``auto`` decided from the driver's GPU list (no CUDA call here: the
        Celery process must never initialise CUDA)."""
        if self.node_device != "auto":
            return self.node_device
        gpus = Path("/proc/driver/nvidia/gpus")
        return "cuda" if gpus.is_dir() and any(gpus.iterdir()) else "cpu"

    def resolved_node_threads(self) -> int:
        if self.node_threads_per_rank:
            return self.node_threads_per_rank
        from pipeline.host import default_threads

        return default_threads(self.node_ranks)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.visibility_timeout_s <= self.max_job_s:
            raise ValueError(
                f"visibility_timeout_s={self.visibility_timeout_s} must exceed max_job_s={self.max_job_s}, "
                "or Redis redelivers a running job's message; raise LONGTAKE_VISIBILITY_TIMEOUT_S"
            )
        if self.heartbeat_s * 2 > self.lease_s:
            raise ValueError(
                f"heartbeat_s={self.heartbeat_s} must be at most lease_s/2={self.lease_s / 2}; "
                "lower LONGTAKE_HEARTBEAT_S or raise LONGTAKE_LEASE_S"
            )
        return self

    # --- model weights (issue 12) -----------------------------------------------------------------
    models: dict[str, Path] = Field(
        default_factory=dict,
        description="Model name -> weights directory (JSON object in LONGTAKE_MODELS, e.g. "
        '{"infinitetalk": "/weights"}): the only models a job spec may name (JobSpec.model); a request '
        "never carries a path. The directory is what `longtake render --weights` takes (docs/wan.md)",
    )

    def model_weights(self, name: str | None) -> Path | None:
        """The weights directory of model ``name`` (None: ``checkpoint``, the preset's default);
        raises ``InvalidInputError(field="model")`` for a name this deployment does not configure."""
        if name is None:
            return self.checkpoint
        if name not in self.models:
            from pipeline.errors import InvalidInputError

            raise InvalidInputError(f"model: {name!r} is not configured on this worker; configured: "
                                    f"{sorted(self.models)} (LONGTAKE_MODELS)", field="model")
        return self.models[name]


def _redacted(value: str) -> str:
    """``value`` with every token masked to its first 3 characters (tokens are secrets): what
    follows a ``:`` or opens a JSON string; a compact entry without ``:`` may be a bare token."""
    if ":" not in value:
        return value[:3] + "…"
    return re.sub(r"(:|\")([^,\"]{3})[^,\"]*", r"\1\2…", value)[:80]


def parse_api_tokens_env(value: str) -> dict[str, str]:
    """Parse the text of ``LONGTAKE_API_TOKENS`` into ``{token: tenant}``.

    Called by :class:`Settings` for the environment value. Accepts a JSON object (token -> tenant)
    or ``tenant:token[,tenant:token...]``; anything else raises ``ValueError`` naming the variable,
    the (redacted) value and both accepted formats.
    """
    text = value.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"LONGTAKE_API_TOKENS={_redacted(text)!r} is not valid JSON ({exc.msg} at char {exc.pos}); "
                f"write {_TOKENS_FORMAT}"
            ) from exc
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()
        ):
            raise ValueError(
                f"LONGTAKE_API_TOKENS={_redacted(text)!r} must map token strings to tenant strings; "
                f"write {_TOKENS_FORMAT}"
            )
        return loaded
    table: dict[str, str] = {}
    for raw in text.split(","):
        entry = raw.strip()
        tenant, sep, token = entry.partition(":")
        if not entry:
            continue
        if not sep or not tenant.strip() or not token.strip():
            raise ValueError(
                f"LONGTAKE_API_TOKENS entry {_redacted(entry)!r} is not tenant:token; write {_TOKENS_FORMAT}"
            )
        table[token.strip()] = tenant.strip()
    return table
