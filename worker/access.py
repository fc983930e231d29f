"""Which inputs a tenant may name: its own uploads, and objects under the prefixes granted to it.

The workers fetch inputs with their own credentials, so without this check a job spec could make
them read anything they can: another tenant's upload or outputs named by key in the job store, or
any bucket (a confused deputy). The rule:

- ``upload://<id>`` is always the caller's own: the key is built from the job's tenant
  (:func:`worker.delivery.keys.upload_key`), so another tenant's id simply does not exist;
- ``s3://bucket/key`` must lie under one of ``Settings.input_grants[tenant]`` or ``[*]``; and even
  a granted prefix never reaches another tenant's part (``tenants/<other>/``) of the job store;
- ``file://`` is checked against ``Settings.file_root`` by :func:`worker.spec.resolve_file_uri`
  (a root the operator shares with every tenant; refusals there do not show the root).

Who calls what: the API checks every input of a submission (:mod:`worker.api.jobs`) before
anything is stored or queued; the worker checks again in ``JobWorker._fetch`` right before it
downloads, so a row written by anything but the API, or before a grant was withdrawn, cannot make
it read for the tenant what the tenant may not. Messages name the field and the URI the caller
sent, never a server path or another tenant's grants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from worker.settings import Settings

__all__ = ["InputGrants", "InputRefusedError"]


class InputRefusedError(ValueError):
    """An input URI the tenant may not name. ``field`` is the spec field (``image``/``audio``)."""

    code = "input_not_granted"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class InputGrants:
    """The grant table and where the job store lives (its objects are per tenant).

    ``grants``: tenant (or ``*``) -> ``s3://bucket/prefix/`` entries (validated by Settings).
    ``job_store``: ``(bucket, base_prefix)`` of the job object store when it is on S3, else None.
    """

    grants: Mapping[str, Sequence[str]]
    job_store: tuple[str, str] | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> InputGrants:
        store = urlsplit(settings.object_store_url)
        job_store = None
        if store.scheme == "s3":
            base = store.path.strip("/")
            job_store = (store.netloc, f"{base}/" if base else "")
        return cls(settings.input_grants, job_store)

    def prefixes(self, tenant: str) -> tuple[str, ...]:
        """The ``s3://`` prefixes ``tenant`` may read (its own entry, then ``*``)."""
        return tuple(self.grants.get(tenant, ())) + tuple(self.grants.get("*", ()))

    def check(self, tenant: str, field: str, uri: str) -> None:
        """Raise :class:`InputRefusedError` unless ``tenant`` may have the workers read ``uri``."""
        parts = urlsplit(uri)
        if parts.scheme != "s3":
            return  # upload:// is per tenant by construction; file:// has its own root check
        bucket, key = parts.netloc, unquote(parts.path).lstrip("/")
        if self.job_store is not None and bucket == self.job_store[0]:
            own = f"{self.job_store[1]}tenants/{tenant}/"
            if key.startswith(f"{self.job_store[1]}tenants/") and not key.startswith(own):
                raise InputRefusedError(
                    field,
                    f"{field}: {uri!r} is another tenant's object in the job store; name only your own "
                    "uploads (upload://<id>) or objects under the prefixes granted to your tenant",
                )
        target = f"s3://{bucket}/{key}"
        if not any(target.startswith(prefix) for prefix in self.prefixes(tenant)):
            raise InputRefusedError(
                field,
                f"{field}: {uri!r} is not under an s3:// prefix granted to your tenant; upload the file "
                "(POST /v1/uploads, or the multipart POST /v1/jobs/upload) and name it upload://<id>, or "
                "ask the operator to grant its prefix (LONGTAKE_INPUT_GRANTS)",
            )
