"""NodeEngine pieces that need no rank processes: job names, config validation, error codes."""

from __future__ import annotations

import pytest

from pipeline.placement.engine import EngineConfig, JobFailedError, RankDiedError, job_name
from tests.distributed import placement_support as ps


def test_jobs_are_module_level_functions_only() -> None:
    assert job_name(ps.job_forward) == "tests.distributed.placement_support:job_forward"

    def local_job(ctx: object, payload: object) -> None:
        return None

    with pytest.raises(ValueError, match="must be a module-level function"):
        job_name(local_job)
    with pytest.raises(ValueError, match="must be a module-level function"):
        job_name(lambda ctx, payload: None)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        EngineConfig(world_size=0)
    with pytest.raises(ValueError, match="device_type must be 'cuda' or 'cpu', got 'tpu'"):
        EngineConfig(device_type="tpu")
    # an import path instead of the function failed only inside each rank ("'str' object is not callable")
    with pytest.raises(TypeError, match=r"loaders\['dit'\] is 'tests.x:load', not a callable; pass the loader function"):
        EngineConfig(loaders={"dit": "tests.x:load"})  # type: ignore[dict-item]
    EngineConfig(loaders={"dit": job_name})  # any callable passes


def test_error_codes() -> None:
    assert RankDiedError("x").retryable and RankDiedError.code == "rank_died"
    assert not JobFailedError("x").retryable and JobFailedError.code == "job_failed"
