"""NodeEngine pieces that need no rank processes: job paths, config validation, loader resolution."""

from __future__ import annotations

import pytest

from pipeline.placement.engine import EngineConfig, JobFailedError, RankDiedError, job_path
from pipeline.placement.rank import resolve
from tests.distributed import placement_support as ps


def test_job_path_of_module_level_functions_only() -> None:
    assert job_path(ps.job_forward) == "tests.distributed.placement_support:job_forward"
    assert job_path("pkg.mod:fn") == "pkg.mod:fn"

    def local_job(ctx: object, payload: object) -> None:
        return None

    with pytest.raises(ValueError, match="must be a module-level function"):
        job_path(local_job)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a module-level function"):
        job_path(lambda ctx, payload: None)


def test_resolve_names_the_bad_path() -> None:
    assert resolve("tests.distributed.placement_support:job_forward") is ps.job_forward
    with pytest.raises(ValueError, match="expected a 'package.module:function' path, got 'no_colon'"):
        resolve("no_colon")
    with pytest.raises(TypeError, match="resolves to a int, not a callable"):
        resolve("tests.distributed.placement_support:DIM")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        EngineConfig(world_size=0)
    with pytest.raises(ValueError, match="device_type must be 'cuda' or 'cpu', got 'tpu'"):
        EngineConfig(device_type="tpu")


def test_error_codes() -> None:
    assert RankDiedError("x").retryable and RankDiedError.code == "rank_died"
    assert not JobFailedError("x").retryable and JobFailedError.code == "job_failed"
