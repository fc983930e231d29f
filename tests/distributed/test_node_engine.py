"""NodeEngine supervision on CPU/gloo with 2 ranks: failing jobs, a killed rank, a partial failure,
published events, cancellation, and per-rank peak memory flat from N to 4N chunks."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch

from pipeline.errors import InvalidInputError, ModuleLoadError, SinkError
from pipeline.media_types import Fragment, InitSegment
from pipeline.placement.engine import EngineConfig, JobFailedError, NodeEngine, RankDiedError
from pipeline.placement.relay import SinkRelay
from tests.distributed import placement_support as ps

pytestmark = pytest.mark.distributed

MiB = 1 << 20


@pytest.fixture(scope="module")
def engine() -> Iterator[NodeEngine]:
    config = EngineConfig(world_size=2, loaders={"dit": ps.load_sharded}, error_grace_s=3.0)
    with NodeEngine(config) as engine:
        yield engine


def expected(seed: int) -> torch.Tensor:
    torch.set_num_threads(1)
    with torch.no_grad():
        return ps.build_model()(ps.make_input(seed))


@pytest.mark.timeout(120)
def test_job_exception_keeps_ranks_warm(engine: NodeEngine) -> None:
    pids = engine.pids
    with pytest.raises(JobFailedError, match=r"ValueError on rank 0: bad payload on rank 0"):
        engine.run(ps.job_raise, {})
    with pytest.raises(InvalidInputError, match="payload field 'seed'") as info:
        engine.run(ps.job_raise, {"kind": "invalid_input", "seed": -1})
    assert info.value.field == "seed"
    engine.run(ps.job_forward, {"seed": 1})  # FSDP state initialized; then a failure mid-forward:
    with pytest.raises(JobFailedError, match="shape mismatch inside blocks.2"):
        engine.run(ps.job_raise_mid_forward, {})
    assert engine.pids == pids, "a job's exception must not restart the ranks"
    out = engine.run(ps.job_forward, {"seed": 1}).value
    assert isinstance(out, torch.Tensor) and torch.equal(out, expected(1))


@pytest.mark.timeout(180)
def test_killed_rank_fails_job_and_engine_comes_back(engine: NodeEngine) -> None:
    engine.start()
    victim = engine.pids[1]
    generation = engine.generation
    killed: list[int] = []

    def kill_rank1(event: object) -> None:
        if not killed:  # rank 0 said the job started: kill rank 1 in the middle of it
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    with pytest.raises(RankDiedError, match=rf"rank 1 \(pid {victim}\) killed by signal SIGKILL") as info:
        engine.run(ps.job_slow_collectives, {"steps": 500}, on_event=kill_rank1, timeout_s=120)
    assert info.value.retryable
    assert not engine.is_running
    out = engine.run(ps.job_forward, {"seed": 0}).value  # restarts a fresh group
    assert engine.generation == generation + 1 and victim not in engine.pids
    assert isinstance(out, torch.Tensor) and torch.equal(out, expected(0))


@pytest.mark.timeout(180)
def test_partial_failure_restarts_group(engine: NodeEngine) -> None:
    engine.start()
    generation = engine.generation
    with pytest.raises(JobFailedError, match=r"RuntimeError on rank 1: rank 1 failed mid-job.*ranks \[0\]"):
        engine.run(ps.job_raise_on_rank1, {})
    out = engine.run(ps.job_forward, {"seed": 2}).value
    assert engine.generation == generation + 1
    assert isinstance(out, torch.Tensor) and torch.equal(out, expected(2))


@pytest.mark.timeout(120)
def test_events_and_cancel(engine: NodeEngine) -> None:
    seen: list[object] = []
    result = engine.run(ps.job_chunks, {"chunks": 3}, on_event=seen.append)
    assert result.value == 0 and len(seen) == 3 and all(isinstance(s, float) for s in seen)
    assert engine.run(ps.job_wait_for_cancel, {}, should_cancel=lambda: True).value == "cancelled"

    class LeaseLost(Exception):
        pass

    def lose_lease(event: object) -> None:
        raise LeaseLost("lease gone")

    with pytest.raises(LeaseLost):
        engine.run(ps.job_wait_for_cancel, {}, on_event=lose_lease)
    assert engine.run(ps.job_forward, {"seed": 0}).value is not None


@pytest.mark.timeout(180)
def test_peak_memory_flat_from_n_to_4n_chunks(engine: NodeEngine) -> None:
    n = 4
    engine.run(ps.job_chunks, {"chunks": n})  # warm-up: allocator pools, gloo buffers
    peak_n = [r.peak_bytes for r in engine.run(ps.job_chunks, {"chunks": n}).ranks]
    peak_4n = [r.peak_bytes for r in engine.run(ps.job_chunks, {"chunks": 4 * n}).ranks]
    assert all(r > 0 for r in peak_n)
    for rank, (a, b) in enumerate(zip(peak_n, peak_4n, strict=True)):
        assert b - a < 4 * MiB, (
            f"rank {rank} peak RSS grew {(b - a) / MiB:.1f} MiB from {n} to {4 * n} chunks"
        )
    # the control: a job that keeps every chunk's output grows, so the check above can fail
    leak_n = [r.peak_bytes for r in engine.run(ps.job_chunks, {"chunks": n, "leak": True}).ranks]
    leak_4n = [r.peak_bytes for r in engine.run(ps.job_chunks, {"chunks": 4 * n, "leak": True}).ranks]
    assert all(b - a > 8 * MiB for a, b in zip(leak_n, leak_4n, strict=True)), (leak_n, leak_4n)


@pytest.mark.timeout(120)
def test_loader_failure_is_a_module_load_error() -> None:
    config = EngineConfig(world_size=1, loaders={"a2v": ps.load_broken})
    engine = NodeEngine(config)
    with pytest.raises(
        ModuleLoadError, match=r"rank 0 failed to start.*FileNotFoundError: checkpoint /nonexistent"
    ):
        engine.start()
    assert not engine.is_running


class RecordingSink:
    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[str] = []
        self.fail_at = fail_at

    def open(self, init: InitSegment) -> None:
        self.calls.append(f"open {init.data.decode()}")

    def write(self, fragment: Fragment) -> None:
        if fragment.index == self.fail_at:
            raise SinkError(f"upload of fragment {fragment.index} failed")
        self.calls.append(f"write {fragment.index} {fragment.data.hex()}")

    def close(self, *, ok: bool) -> None:
        self.calls.append(f"close ok={ok}")


@pytest.mark.timeout(120)
def test_fragments_relay_to_parent_sinks(engine: NodeEngine) -> None:
    sink = RecordingSink()
    assert (
        engine.run(ps.job_relay_fragments, {"fragments": 3}, on_event=SinkRelay([sink]).on_event).value == 3
    )
    assert sink.calls == ["open ftyp-moov", *[f"write {i} {'00' * 8}" for i in range(3)], "close ok=True"]
    failing = RecordingSink(fail_at=1)
    with pytest.raises(SinkError, match="upload of fragment 1 failed"):
        engine.run(ps.job_relay_fragments, {"fragments": 50}, on_event=SinkRelay([failing]).on_event)
    assert failing.calls[:2] == ["open ftyp-moov", f"write 0 {'00' * 8}"]
    assert engine.run(ps.job_forward, {"seed": 0}).value is not None
