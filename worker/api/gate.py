"""The API's front door: authenticate, rate-limit and bound every request before its body is read.

FastAPI reads a route's body (its ``File``/``Form`` parameters, a body dependency) before the route
function runs, so an authentication check inside the route comes too late: an unauthenticated
200 MB body used to be read into memory before its 401. :class:`RequestGate` is a plain ASGI
middleware installed by :func:`worker.api.app.create_app` around the routes; for every request it

1. authenticates ``/v1/…`` requests from the ``Authorization`` header alone and answers ``401``
   without receiving a byte of the body (a client sending ``Expect: 100-continue`` never gets the
   ``100``, so it sends no body at all). Exempt: ``OPTIONS`` (CORS preflights carry no token) and
   the signed-link routes (:data:`SIGNED_LINK_PATH`: players fetch them without a header; the
   signature is checked by the route);
2. takes one token from the caller's bucket (:class:`TokenBucket`, per bearer token, **per API
   process**: N processes allow N times the rate); an empty bucket is ``429`` with ``Retry-After``;
3. bounds the body: a ``Content-Length`` over the route's limit is ``413`` at once; a body without
   one (chunked) is counted as it is received and cut off with ``413`` when it passes the limit.
   Limits: ``Settings.api_json_max_bytes`` for JSON routes, one file plus 1 MiB for
   ``POST /v1/uploads``, two files plus 1 MiB for ``POST /v1/jobs/upload``
   (``Settings.upload_max_bytes`` per file; each file is also checked on its own by
   :func:`worker.api.uploads.store_upload`).

The routes still call :func:`worker.api.deps.tenant_of` (same answer: the gate has already
refused a bad token); the gate keeps nothing of the request.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.api.auth import AuthError
from worker.api.deps import API_PREFIX, Deps

SIGNED_LINK_PATH = re.compile(rf"^{API_PREFIX}/jobs/[^/]+/(preview\.m3u8|preview\.html|preview/[^/]+)$")
"""``/v1`` routes authorised by a signed link instead of a bearer token (video players and the
preview page send none): the playlist, the page and the init/segments it lists
(:mod:`worker.api.preview` checks each link's signature)."""

MULTIPART_OVERHEAD_BYTES = 1024 * 1024
"""Room for the multipart framing and the ``spec`` form field around the files."""


class BodyTooLargeError(HTTPException):
    """Raised from the gate's ``receive`` when a body without ``Content-Length`` passes its limit;
    FastAPI passes it through body parsing and the app answers it as ``413 request_too_large``."""

    def __init__(self, limit: int, path: str) -> None:
        super().__init__(413, _too_large_message(limit, path))
        self.message = _too_large_message(limit, path)


def _too_large_message(limit: int, path: str) -> str:
    setting = (
        "LONGTAKE_UPLOAD_MAX_BYTES"
        if path.endswith("upload") or path.endswith("uploads")
        else ("LONGTAKE_API_JSON_MAX_BYTES")
    )
    return (
        f"(body): the request body is over the {limit}-byte limit of {path}; send a smaller body "
        f"or ask the operator to raise {setting}"
    )


class TokenBucket:
    """Per-key token bucket: ``rate`` tokens a second, at most ``burst`` saved. Thread-safe; kept in
    this process only (each API process has its own buckets)."""

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str) -> float:
        """Take one token for ``key``: 0.0 when allowed, else the seconds until one is available."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate


class RequestGate:
    """ASGI middleware: authentication, rate limit and body bound before any route reads the body."""

    def __init__(self, app: ASGIApp, deps: Deps, bucket: TokenBucket | None = None) -> None:
        self.app = app
        self.deps = deps
        self.bucket = bucket or TokenBucket(deps.settings.api_rate_per_s, deps.settings.api_rate_burst)

    def body_limit(self, path: str) -> int:
        s = self.deps.settings
        if path == f"{API_PREFIX}/uploads":
            return s.upload_max_bytes + MULTIPART_OVERHEAD_BYTES
        if path == f"{API_PREFIX}/jobs/upload":
            return 2 * s.upload_max_bytes + MULTIPART_OVERHEAD_BYTES
        return s.api_json_max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = Headers(scope=scope)
        refusal = self._authenticate(scope, path, headers)
        if refusal is None:
            refusal = self._check_length(path, headers)
        if refusal is not None:
            # Answer without calling receive(): the body is never read. "Connection: close" makes
            # the server drop the connection after the answer instead of draining the unread body.
            refusal.headers["Connection"] = "close"
            await refusal(scope, _no_body, send)
            return
        await self.app(scope, self._bounded(receive, self.body_limit(path), path), send)

    def _authenticate(self, scope: Scope, path: str, headers: Headers) -> JSONResponse | None:
        if not path.startswith(f"{API_PREFIX}/") or scope["method"] == "OPTIONS":
            return None
        if SIGNED_LINK_PATH.match(path):
            return None
        authorization = headers.get("authorization")
        try:
            self.deps.auth.tenant_for(authorization)
        except AuthError as exc:
            return _error(
                401,
                "unauthorized",
                "Authorization",
                exc.message,
                {"WWW-Authenticate": exc.www_authenticate()},
            )
        wait = self.bucket.take(str(authorization).split()[-1])
        if wait > 0:
            retry_after = max(1, math.ceil(wait))
            return _error(
                429,
                "rate_limited",
                "Authorization",
                f"Authorization: over {self.deps.settings.api_rate_per_s:g} requests/s (burst "
                f"{self.deps.settings.api_rate_burst}) for your token on this API process; retry after "
                f"{retry_after} s (Retry-After)",
                {"Retry-After": str(retry_after)},
            )
        return None

    def _check_length(self, path: str, headers: Headers) -> JSONResponse | None:
        raw = headers.get("content-length")
        if raw is None:
            return None
        limit = self.body_limit(path)
        if not raw.isdigit():
            return _error(
                400,
                "invalid_request",
                "Content-Length",
                f"Content-Length: {raw[:32]!r} is not a byte count; fix it",
            )
        if int(raw) > limit:
            return _error(413, "request_too_large", "(body)", _too_large_message(limit, path))
        return None

    @staticmethod
    def _bounded(receive: Receive, limit: int, path: str) -> Receive:
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLargeError(limit, path)
            return message

        return bounded


def _error(
    status: int, code: str, field: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": code, "message": message, "errors": [{"field": field, "message": message}]},
        status_code=status,
        headers=headers,
    )


async def _no_body() -> Message:
    return {"type": "http.disconnect"}
