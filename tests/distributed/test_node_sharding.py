"""FSDP2 sharding through the NodeEngine on CPU/gloo: sharded == unsharded, prefetch order, parking
of sharded models. Reference outputs come from the plain model in this process (1 thread, no_grad).

Observed: outputs are bit-identical (torch.equal) for 1, 2 and 4 ranks. Reason: the AllGather
reassembles the exact parameter bytes and every rank then runs the same kernels on the same
unsharded tensors with one thread. (Comparing against a grad-enabled reference is *not* bit-identical:
nn.MultiheadAttention takes its fused fast path only under no_grad.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pipeline.placement.engine import EngineConfig, NodeEngine
from tests.distributed import placement_support as ps

pytestmark = pytest.mark.distributed



def reference(seed: int) -> torch.Tensor:
    torch.set_num_threads(1)
    with torch.no_grad():
        return ps.build_model()(ps.make_input(seed))


def assert_prefetched(events: list[str], depth: int = ps.DEPTH) -> None:
    """Block n+1's first unshard comes before block n's forward ends, for every n."""
    for n in range(depth - 1):
        first_unshard = events.index(f"unshard blocks.{n + 1}")
        end = events.index(f"end blocks.{n}")
        assert first_unshard < end, f"blocks.{n + 1} was not prefetched before blocks.{n} ended: {events}"


@pytest.fixture(scope="module")
def engine2() -> Iterator[NodeEngine]:
    loaders = {
        "dit": ps.load_sharded,
        "dit_no_prefetch": ps.load_sharded_no_prefetch,
        "parked": ps.load_sharded_parked,
    }
    # park=True: exercise the parking path on CPU (it is off by default without CUDA)
    with NodeEngine(EngineConfig(world_size=2, loaders=loaders, park=True)) as engine:
        yield engine


@pytest.mark.timeout(180)
def test_two_ranks_sharded_equals_unsharded(engine2: NodeEngine) -> None:
    for seed in (0, 1):
        out = engine2.run(ps.job_forward, {"seed": seed}).value
        assert isinstance(out, torch.Tensor)
        assert torch.equal(out, reference(seed)), (out - reference(seed)).abs().max()


@pytest.mark.timeout(180)
def test_forward_prefetch_order(engine2: NodeEngine) -> None:
    events = engine2.run(ps.job_record_unshard_order, {"module": "dit"}).value
    assert isinstance(events, list)
    assert_prefetched(events)
    # the control: without the explicit chain, block n+1 is gathered only after block n ended
    control = engine2.run(ps.job_record_unshard_order, {"module": "dit_no_prefetch"}).value
    assert isinstance(control, list)
    for n in range(ps.DEPTH - 1):
        assert control.index(f"unshard blocks.{n + 1}") > control.index(f"end blocks.{n}"), control


@pytest.mark.timeout(180)
def test_parked_sharded_model_round_trip(engine2: NodeEngine) -> None:
    out = engine2.run(ps.job_park_roundtrip, {}).value
    assert isinstance(out, dict)
    assert out["parked_resident"] == 0
    assert out["restored_resident"] > 0
    assert torch.equal(out["before"], out["after"])
    assert torch.equal(out["after"], reference(3))


@pytest.mark.slow  # 4 spawned ranks each import torch: ~90 s on 2 loaded cores, ~25 s idle
@pytest.mark.timeout(300)
def test_four_ranks_sharded_equals_unsharded() -> None:
    loaders = {"dit": ps.load_sharded}
    with NodeEngine(EngineConfig(world_size=4, loaders=loaders, park=True)) as engine:
        out = engine.run(ps.job_forward, {"seed": 2}).value
        events = engine.run(ps.job_record_unshard_order, {"module": "dit"}).value
        # 4 ranks shard the 10-row head unevenly (padded shards): park before FSDP's lazy init
        fresh = engine.run(ps.job_park_before_first_forward, {"seed": 2}).value
    assert isinstance(fresh, dict) and torch.equal(fresh["out"], reference(2))
    assert int(fresh["bytes_left_after_park"]) == 0
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, reference(2)), (out - reference(2)).abs().max()
    assert isinstance(events, list)
    assert_prefetched(events)


@pytest.mark.timeout(180)
def test_one_rank_runs_the_same_path() -> None:
    loaders = {"dit": ps.load_sharded}
    with NodeEngine(EngineConfig(world_size=1, loaders=loaders)) as engine:
        result = engine.run(ps.job_forward, {"seed": 0})
    assert isinstance(result.value, torch.Tensor)
    assert torch.equal(result.value, reference(0))
    assert [r.rank for r in result.ranks] == [0]
