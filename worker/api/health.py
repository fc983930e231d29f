"""``/healthz`` (database and broker reachability) and ``/metrics`` (the API's Prometheus registry).

Included by :func:`worker.api.app.create_app`; neither needs a bearer token, so ``/healthz`` says
only ``ok`` or ``unavailable`` per dependency: the reason (host, port, driver error text) goes to
the API's log, never to an unauthenticated caller (issue 17 item 3).
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sqlalchemy import text

from worker.api.deps import RETRY_AFTER_S, Deps, get_deps

router = APIRouter()
log = logging.getLogger(__name__)


@router.get("/healthz", summary="Database and broker reachability (200 ok / 503)")
def healthz(deps: Annotated[Deps, Depends(get_deps)]) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        with deps.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        log.warning("healthz: database unreachable: %s: %s", type(exc).__name__, exc)
        checks["database"] = "unavailable"
    try:
        with deps.celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2, timeout=2)
        checks["broker"] = "ok"
    except Exception as exc:
        log.warning("healthz: broker unreachable: %s: %s", type(exc).__name__, exc)
        checks["broker"] = "unavailable"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", **checks},
        status_code=200 if ok else 503,
        headers={} if ok else {"Retry-After": str(RETRY_AFTER_S)},
    )


@router.get("/metrics", include_in_schema=False)
def metrics(deps: Annotated[Deps, Depends(get_deps)]) -> Response:
    return Response(generate_latest(deps.metrics.registry), media_type=CONTENT_TYPE_LATEST)
