"""Node placement: FSDP2 sharding with explicit prefetch, parked models returned just in time, NUMA
binding, and the NodeEngine that runs one request across a node's devices (see docs/node.md).

Import from the submodules (``pipeline.placement.engine`` ...): importing this package pulls in
nothing heavy beyond torch.
"""

from __future__ import annotations

from pipeline.placement.engine import (
    EngineConfig,
    JobFailedError,
    JobResult,
    JobTimeoutError,
    NodeEngine,
    RankDiedError,
)
from pipeline.placement.fsdp import parallelize
from pipeline.placement.numa import NumaBinding, bind_numa
from pipeline.placement.parking import ModelParker
from pipeline.placement.rank import RankContext, RankReport

__all__ = [
    "EngineConfig",
    "JobFailedError",
    "JobResult",
    "JobTimeoutError",
    "ModelParker",
    "NodeEngine",
    "NumaBinding",
    "RankContext",
    "RankDiedError",
    "RankReport",
    "bind_numa",
    "parallelize",
]
