"""The HTTP API (FastAPI) app factory: one router per resource, the error handlers, the OpenAPI document.

Who calls what: ``longtake api`` (and ``longtake up``) build the app once per process with
:func:`create_app` and serve it with uvicorn; tests build it with their own settings. The app holds
one :class:`worker.api.deps.Deps`: one SQLAlchemy engine (through :class:`worker.jobs.store.JobStore`),
one object store and one Celery app (used only to *send* messages). The routes are
:mod:`worker.api.jobs` (submit, get, list, cancel, outputs; the submission order is described
there), :mod:`worker.api.sessions` (the audio WebSocket of a live session), :mod:`worker.api.uploads`,
:mod:`worker.api.preview` and :mod:`worker.api.health`; they are plain ``def`` so FastAPI runs the
blocking store calls in its thread pool (the WebSocket route is async and runs its blocking calls
on a thread of its own).

The response bodies are the wire models of :mod:`worker.client`, so the Python client and the
server share one schema. Errors are ``{"error": code, "message": text, "errors": [...]}``; the
message names the field, the bad value and the fix. Another tenant's job is answered exactly like a
missing one (404), so job ids do not leak across tenants.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import Celery
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.api import health, jobs, preview, sessions, uploads
from worker.api.auth import PreviewSigner, TokenAuth
from worker.api.deps import RETRY_AFTER_S, ApiError, ApiMetrics, Deps
from worker.api.gate import BodyTooLargeError, RequestGate, TokenBucket
from worker.delivery.object_store import ObjectStore
from worker.delivery.storage import open_object_store
from worker.jobs.db import DbRetry, is_connection_error, make_engine
from worker.jobs.queue import create_celery_app
from worker.jobs.store import JobStore
from worker.settings import Settings
from worker.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["ApiError", "create_app"]


def create_app(
    settings: Settings,
    *,
    engine: Engine | None = None,
    objects: ObjectStore | None = None,
    celery: Celery | None = None,
    kvs_endpoint_url: str | None = None,
) -> FastAPI:
    """Build the API app. ``engine``/``objects``/``celery`` default to what ``settings`` describe
    (``celery`` is only used to publish). Nothing connects at build time: the first request does."""
    auth = TokenAuth.from_setting(settings.api_tokens)
    if not auth.tenants:
        logger.warning("no API tokens configured (LONGTAKE_API_TOKENS): every request will get 401")
    if engine is None:
        engine = make_engine(settings.database_url, pool_size=settings.db_pool_size)
    if objects is None:
        objects = open_object_store(settings.object_store_url, endpoint_url=settings.s3_endpoint_url)
    if celery is None:
        celery = create_celery_app(settings)
    deps = Deps(
        settings=settings,
        auth=auth,
        signer=PreviewSigner(settings.api_tokens),
        engine=engine,
        # a few quick tries, then 503: a client (30 s timeout) hears of an outage in seconds
        store=JobStore(engine, retry=DbRetry(settings.api_db_retry_attempts, 1.0)),
        objects=objects,
        celery=celery,
        kvs_endpoint_url=kvs_endpoint_url or getattr(settings, "kvs_endpoint_url", None),
        metrics=ApiMetrics(),
    )
    app = FastAPI(
        title="longtake",
        version="0.1.0",
        description="Render audio-driven avatar videos of any length. Authenticate with "
        "`Authorization: Bearer <token>`; each token belongs to one tenant, which sees only its own jobs.",
    )
    app.state.deps = deps
    # one bucket per token for HTTP requests (the gate) and audio WebSocket connections (the route)
    app.state.rate_bucket = bucket = TokenBucket(settings.api_rate_per_s, settings.api_rate_burst)
    app.add_middleware(RequestGate, deps=deps, bucket=bucket)  # inside _count (added next): refusals are counted too
    _install_handlers(app, deps)
    _install_outage_handler(app)
    for router in (jobs.router, sessions.router, uploads.router, preview.router, health.router):
        app.include_router(router)
    _publish_spec_schema(app)
    return app


# ---------------------------------------------------------------------------------------------- handlers


def _install_handlers(app: FastAPI, deps: Deps) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        body: dict[str, object] = {"error": exc.code, "message": exc.message}
        if exc.errors:
            body["errors"] = exc.errors
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(BodyTooLargeError)
    async def _too_large(_request: Request, exc: BodyTooLargeError) -> JSONResponse:
        error = {"field": "(body)", "message": exc.message}
        return JSONResponse({"error": "request_too_large", "message": exc.message, "errors": [error]}, 413)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own answers (no such route, method not allowed) in the API's error format.
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        if exc.status_code == 400:  # the form parser refused the body (malformed, too many parts)
            field, message = "(body)", f"(body): {exc.detail}; send a well-formed multipart/form-data body"
        else:
            field = "(path)"
            message = f"(path): {request.method} {request.url.path[:200]}: {exc.detail}; see /docs for the routes"
        error = {"field": field, "message": message}
        return JSONResponse(
            {"error": code, "message": message, "errors": [error]}, exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ()) if p not in ("query", "body", "path")]
            field = ".".join(loc) or "(request)"
            errors.append({"field": field, "message": f"{field}: {err.get('msg')}; fix the value"})
        message = "; ".join(e["message"] for e in errors)
        return JSONResponse({"error": "invalid_request", "message": message, "errors": errors}, 422)

    @app.middleware("http")
    async def _count(request: Request, call_next: Callable[[Request], Any]) -> Response:
        start = time.perf_counter()
        response: Response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", "unmatched")
        deps.metrics.requests.labels(name, str(response.status_code)).inc()
        deps.metrics.latency.labels(name).observe(time.perf_counter() - start)
        return response


def _install_outage_handler(app: FastAPI) -> None:
    """A database connection error that outlived the API store's short retries
    (``Settings.api_db_retry_attempts``) answers ``503 database_unavailable`` with ``Retry-After``,
    not a bare 500: the request may be repeated as is (a submit with its ``idempotency_key``). The
    driver's text (host, port) is logged, never sent."""

    @app.exception_handler(SQLAlchemyError)
    async def _database(_request: Request, exc: SQLAlchemyError) -> JSONResponse:
        if not is_connection_error(exc):
            raise exc  # a bug, not an outage: the ordinary 500 with its traceback in the log
        logger.warning("database unreachable: %s: %s", type(exc).__name__, exc)
        return JSONResponse(
            {
                "error": "database_unavailable",
                "message": f"the job database is unreachable; retry in {RETRY_AFTER_S} s "
                "(with the same idempotency_key for a submit)",
            },
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


def _publish_spec_schema(app: FastAPI) -> None:
    # The JSON submit endpoint reads its body itself (so auth runs first and errors read well);
    # publish JobSpec's schema in the OpenAPI document by hand.
    spec_schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    extra_schemas: dict[str, Any] = dict(spec_schema.pop("$defs", {}))
    extra_schemas["JobSpec"] = spec_schema

    def _openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(extra_schemas)
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = _openapi  # type: ignore[method-assign]
