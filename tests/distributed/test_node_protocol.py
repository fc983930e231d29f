"""The rank -> engine pipe under load and under corruption (issue 17, items 1-2).

Rank 0 publishes from its render thread (progress) and its publisher lane (fragments) at once;
every event must arrive whole and in each thread's order. A message that is not the protocol's
(bytes that do not unpickle, a pickle of the wrong shape) must end the job at once with a
retryable error that carries the reason, kill the ranks (they may still be rendering the old job)
and leave the engine able to run the next job on a fresh group.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from pipeline.placement.engine import EngineConfig, NodeEngine, RankProtocolError
from tests.distributed import placement_support as ps

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def engine() -> Iterator[NodeEngine]:
    with NodeEngine(EngineConfig(world_size=1, loaders={"dit": ps.load_plain})) as engine:
        yield engine


@pytest.mark.timeout(180)
def test_events_published_from_several_threads_arrive_whole_and_in_order(engine: NodeEngine) -> None:
    threads, events, size = 4, 150, 70_000  # above the pipe's atomic write size: a send is 2 writes
    seen: list[object] = []
    result = engine.run(
        ps.job_publish_from_threads, {"threads": threads, "events": events, "size": size}, on_event=seen.append
    )
    assert result.value == threads * events
    assert len(seen) == threads * events
    next_seq = [0] * threads
    for event in seen:
        assert isinstance(event, tuple) and len(event) == 3, f"torn event: {type(event).__name__}"
        t, seq, data = event
        assert seq == next_seq[t], f"thread {t}: event {seq} arrived after {next_seq[t] - 1}"
        assert data == bytes([(t * 31 + seq) % 256]) * size, f"thread {t} event {seq}: bytes corrupted"
        next_seq[t] += 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("job", [ps.job_send_garbage, ps.job_send_unknown_message])
def test_a_protocol_error_fails_fast_kills_the_ranks_and_the_engine_recovers(
    engine: NodeEngine, job: object
) -> None:
    engine.start()
    pids, generation = engine.pids, engine.generation
    started = time.monotonic()
    with pytest.raises(RankProtocolError) as info:
        engine.run(job, {"sleep_s": 60.0}, timeout_s=90)  # type: ignore[arg-type]
    assert time.monotonic() - started < 20, "a protocol error must end the job at once, not at its timeout"
    err = info.value
    assert err.retryable and err.code == "rank_protocol"
    assert "rank 0" in str(err) and "restart" in str(err)
    assert "Traceback" in str(err) or "unknown message" in str(err)
    assert not engine.is_running, "the ranks may still be inside the job: they must be gone"
    out = engine.run(ps.job_forward, {"seed": 3}).value
    assert engine.generation == generation + 1 and not set(pids) & set(engine.pids)
    torch.set_num_threads(1)
    with torch.no_grad():
        assert isinstance(out, torch.Tensor) and torch.equal(out, ps.build_model()(ps.make_input(3)))
