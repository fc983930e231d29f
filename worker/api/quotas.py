"""Per-tenant submit quotas: jobs in flight and submissions per hour (``Settings.tenant_quotas``).

Who calls what: both submit routes of :mod:`worker.api.jobs` call :func:`check_quota` after the
spec is valid and before anything is stored or queued. The counts come from the jobs table, so the
quota holds across API processes; two submissions racing at the limit may both pass (a soft limit,
off by at most the number of concurrent submits). An idempotent replay (its key already has a job)
is never refused: it creates nothing. Over a quota: ``429 quota_exceeded`` naming the limit, with
``Retry-After``.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select

from worker.api.deps import ApiError, Deps
from worker.jobs.tables import JobRow
from worker.settings import TenantQuota
from worker.spec import JobSpec

_IN_FLIGHT = ("queued", "running")
_WINDOW = timedelta(hours=1)
_IN_FLIGHT_RETRY_S = 30


def quota_of(deps: Deps, tenant: str) -> TenantQuota | None:
    quotas = deps.settings.tenant_quotas
    return quotas.get(tenant, quotas.get("*"))


def check_quota(deps: Deps, tenant: str, spec: JobSpec) -> None:
    """Raise ``ApiError(429, "quota_exceeded")`` when a new job of ``tenant`` would pass its quota."""
    quota = quota_of(deps, tenant)
    if quota is None or (quota.jobs_in_flight is None and quota.submissions_per_hour is None):
        return
    with deps.engine.connect() as conn:
        if spec.idempotency_key is not None:
            replay = conn.execute(
                select(JobRow.id).where(
                    JobRow.tenant == tenant, JobRow.idempotency_key == spec.idempotency_key
                )
            ).first()
            if replay is not None:
                return
        if quota.jobs_in_flight is not None:
            in_flight = conn.execute(
                select(func.count())
                .select_from(JobRow)
                .where(JobRow.tenant == tenant, JobRow.status.in_(_IN_FLIGHT))
            ).scalar_one()
            if in_flight >= quota.jobs_in_flight:
                _refuse(
                    f"jobs_in_flight: your tenant has {in_flight} jobs queued or running, its quota is "
                    f"{quota.jobs_in_flight}; wait for one to finish (or cancel one) and submit again",
                    _IN_FLIGHT_RETRY_S,
                )
        if quota.submissions_per_hour is not None:
            since = datetime.now(UTC) - _WINDOW
            count, oldest = conn.execute(
                select(func.count(), func.min(JobRow.created_at)).where(
                    JobRow.tenant == tenant, JobRow.created_at > since
                )
            ).one()
            if count >= quota.submissions_per_hour:
                wait = _IN_FLIGHT_RETRY_S
                if oldest is not None:
                    oldest = oldest if oldest.tzinfo else oldest.replace(tzinfo=UTC)
                    wait = max(1, math.ceil((oldest + _WINDOW - datetime.now(UTC)).total_seconds()))
                _refuse(
                    f"submissions_per_hour: your tenant created {count} jobs in the last hour, its quota "
                    f"is {quota.submissions_per_hour}; submit again in {wait} s",
                    wait,
                )


def _refuse(message: str, retry_after_s: int) -> None:
    field = message.split(":", 1)[0]
    raise ApiError(
        429,
        "quota_exceeded",
        message,
        errors=[{"field": field, "message": message}],
        headers={"Retry-After": str(retry_after_s)},
    )
