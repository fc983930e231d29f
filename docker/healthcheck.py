# ruff: noqa: TID251  (a deployment script, not pipeline/ or models/: it reads the worker's settings)
"""Container health check of the longtake images (``HEALTHCHECK`` in docker/*.Dockerfile).

``healthcheck.py api``: GET ``/healthz`` of the API in this container (the route checks the
database and the broker; 200 = healthy). ``healthcheck.py worker``: the worker serves no HTTP
route that is up before its first job (its metrics endpoint opens with the first task) and a
Celery ``inspect ping`` goes unanswered while the solo pool renders, so the check is what the
worker needs to take and finish a job: the jobs database answers ``SELECT 1`` and the broker
accepts a connection, with the settings the worker itself reads (``worker.settings.Settings``).
Exit 0 healthy, 1 not. Standard library + the packages the images already install; no torch.
"""

from __future__ import annotations

import sys
import urllib.request


def check_api() -> str:
    from worker.settings import Settings

    port = Settings().api_port  # type: ignore[call-arg]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=4) as resp:  # noqa: S310
        if resp.status != 200:
            raise RuntimeError(f"/healthz answered {resp.status}")
        return resp.read().decode()[:200]


def check_worker() -> str:
    from kombu import Connection
    from sqlalchemy import create_engine, text

    from worker.settings import Settings

    s = Settings()  # type: ignore[call-arg]
    engine = create_engine(s.database_url, pool_pre_ping=True)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    finally:
        engine.dispose()
    with Connection(s.broker_url, connect_timeout=4) as conn:
        conn.ensure_connection(max_retries=1)
    return "database ok, broker ok"


def main(argv: list[str]) -> int:
    role = argv[1] if len(argv) > 1 else ""
    checks = {"api": check_api, "worker": check_worker}
    if role not in checks:
        print(f"usage: healthcheck.py {{{'|'.join(checks)}}}", file=sys.stderr)
        return 2
    try:
        print(checks[role]())
    except Exception as exc:  # any failure is "unhealthy", with the reason in `docker inspect`
        print(f"unhealthy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
