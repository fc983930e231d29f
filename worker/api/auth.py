"""Bearer-token authentication for the HTTP API: one token (or several) per tenant.

The API factory (:func:`worker.api.app.create_app`) builds one :class:`TokenAuth` from
``Settings.api_tokens`` (``LONGTAKE_API_TOKENS="tenantA:tokenA,tenantB:tokenB"``) and calls
:meth:`TokenAuth.tenant_for` once per request. Tokens are compared in constant time against every
configured token (no early exit), so response timing does not reveal which prefix of a token matched
or which tenant exists. A failure raises :class:`AuthError`, which the API turns into
``401`` with a ``WWW-Authenticate: Bearer`` header.

Nothing here keeps request data; the token table is immutable after construction.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterable, Mapping

_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
_MIN_TOKEN_CHARS = 8

__all__ = ["AuthError", "PreviewSigner", "TokenAuth", "parse_tokens"]


class AuthError(Exception):
    """A request carried no usable bearer token. ``error`` is the RFC 6750 error code."""

    def __init__(self, message: str, *, error: str = "invalid_token") -> None:
        super().__init__(message)
        self.message = message
        self.error = error

    def www_authenticate(self) -> str:
        """Value of the ``WWW-Authenticate`` response header for this failure."""
        return f'Bearer realm="longtake", error="{self.error}", error_description="{self.message}"'


def parse_tokens(spec: str | Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    """Check and normalise the token table into ``{token: tenant}``.

    Accepts what ``Settings.api_tokens`` holds (a mapping ``{token: tenant}``, from the JSON object
    in ``LONGTAKE_API_TOKENS``), the compact string ``"tenantA:tokenA,tenantB:tokenB"``, or
    ``(tenant, token)`` pairs.

    A tenant may appear several times (token rotation: old and new token both valid). Raises
    ``ValueError`` naming the bad entry and the fix for a malformed entry, a bad tenant name, a
    token shorter than 8 characters, or a token given to two tenants.
    """
    pairs: list[tuple[str, str]]
    if isinstance(spec, str):
        pairs = []
        for raw in spec.split(","):
            entry = raw.strip()
            if not entry:
                continue
            tenant, sep, token = entry.partition(":")
            if not sep:
                raise ValueError(
                    f"LONGTAKE_API_TOKENS entry {entry[:3]}… has no ':'; write entries as tenant:token, "
                    "comma-separated"
                )
            pairs.append((tenant.strip(), token.strip()))
    elif isinstance(spec, Mapping):
        pairs = [(str(tenant), str(token)) for token, tenant in spec.items()]
    else:
        pairs = [(str(t), str(k)) for t, k in spec]
    table: dict[str, str] = {}
    for tenant, token in pairs:
        if not _TENANT_RE.match(tenant):
            raise ValueError(
                f"LONGTAKE_API_TOKENS: tenant {tenant!r} is not a valid name; use 1-63 letters, digits, "
                "'_' or '-', starting with a letter or digit"
            )
        if len(token) < _MIN_TOKEN_CHARS:
            raise ValueError(
                f"LONGTAKE_API_TOKENS: the token of tenant {tenant!r} is shorter than {_MIN_TOKEN_CHARS} "
                "characters; generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        if token in table and table[token] != tenant:
            raise ValueError(
                f"LONGTAKE_API_TOKENS: tenants {table[token]!r} and {tenant!r} share a token; give each "
                "tenant its own token"
            )
        table[token] = tenant
    return table


class TokenAuth:
    """Maps a bearer token to its tenant. Built once per app; safe to share between threads."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        # Store bytes once; hmac.compare_digest needs equal types and is constant time for equal lengths.
        self._table: tuple[tuple[bytes, str], ...] = tuple(
            (token.encode("utf-8"), tenant) for token, tenant in tokens.items()
        )

    @classmethod
    def from_setting(cls, value: str | Mapping[str, str] | Iterable[tuple[str, str]]) -> TokenAuth:
        """Build from the ``Settings.api_tokens`` value (see :func:`parse_tokens`)."""
        return cls(parse_tokens(value))

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(tenant for _, tenant in self._table)

    def tenant_for(self, authorization: str | None) -> str:
        """Return the tenant of an ``Authorization`` header value; raise :class:`AuthError` otherwise."""
        if not authorization:
            raise AuthError(
                "missing bearer token; send the header 'Authorization: Bearer <your token>'",
                error="invalid_request",
            )
        scheme, _, credentials = authorization.strip().partition(" ")
        credentials = credentials.strip()
        if scheme.lower() != "bearer" or not credentials:
            raise AuthError(
                "the Authorization header must be 'Bearer <your token>'",
                error="invalid_request",
            )
        presented = credentials.encode("utf-8")
        found: str | None = None
        # Walk the whole table every time: the loop length must not depend on which token matched.
        for token, tenant in self._table:
            if hmac.compare_digest(presented, token):
                found = tenant
        if found is None:
            raise AuthError("the bearer token is not valid; check --token / LONGTAKE_API_TOKEN")
        return found


class PreviewSigner:
    """Signs and checks the capability URLs of HLS previews.

    Video players reload a live playlist without sending an ``Authorization`` header, so the preview
    playlist URL carries its own proof instead: ``exp`` (unix seconds) and ``sig`` =
    HMAC-SHA256(key, ``"<job_id>:<exp>"``). The key is derived from the configured API tokens, so
    rotating the tokens also revokes every outstanding preview link. Built once per app by
    :func:`worker.api.app.create_app`.
    """

    def __init__(self, tokens: Mapping[str, str]) -> None:
        material = "\0".join(sorted(tokens)).encode("utf-8")
        self._key = hashlib.sha256(b"longtake-preview-v1\0" + material).digest()

    def sign(self, job_id: str, expires_at: int) -> str:
        mac = hmac.new(self._key, f"{job_id}:{expires_at}".encode(), hashlib.sha256)
        return mac.hexdigest()

    def check(self, job_id: str, expires_at: int, signature: str, *, now: float | None = None) -> bool:
        """True when ``signature`` is ours for this job and ``expires_at`` has not passed."""
        if expires_at < (time.time() if now is None else now):
            return False
        return hmac.compare_digest(self.sign(job_id, expires_at), signature)
