"""``render_on_rank`` on a 1-rank NodeEngine (CPU/gloo) with the fake render entry: rank 0 relays
init/fragments/progress/close in order, the rank serves the next job warm, a cooperative cancel keeps
the rank, and a ``should_cancel`` that raises kills the ranks (the next job gets fresh ones)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.errors import CancelledError
from pipeline.media_types import Fragment, InitSegment
from pipeline.placement.engine import EngineConfig, NodeEngine
from pipeline.placement.relay import SinkClosed
from pipeline.placement.render_job import RankRenderRequest, render_on_rank
from pipeline.request import RenderProgress, RenderRequest
from tests.integration import fake_pipeline

pytestmark = pytest.mark.distributed

JOB = render_on_rank


@pytest.fixture(scope="module")
def engine() -> Iterator[NodeEngine]:
    with NodeEngine(EngineConfig(world_size=1)) as engine:
        yield engine


def payload(tmp: Path, seed: int, n: int, sleep_s: float = 0.0) -> RankRenderRequest:
    image = tmp / "face.png"
    image.write_bytes(b"x")
    plan = fake_pipeline.write_plan(tmp / f"plan-{seed}.json", num_fragments=n, sleep_s=sleep_s)
    return RankRenderRequest(fake_pipeline.render, RenderRequest(image=image, audio=plan, seed=seed))


@pytest.mark.timeout(180)
def test_events_in_order_and_warm_rank(engine: NodeEngine, tmp_path: Path) -> None:
    events: list[object] = []
    first = engine.run(JOB, payload(tmp_path, 5, 3), on_event=events.append)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["InitSegment"] + ["Fragment", "RenderProgress"] * 3 + ["SinkClosed"], kinds
    assert isinstance(events[0], InitSegment) and events[-1] == SinkClosed(True)
    frags = [e for e in events if isinstance(e, Fragment)]
    assert events[0].data + b"".join(f.data for f in frags) == fake_pipeline.expected_output(5, 3)
    progress = [e for e in events if isinstance(e, RenderProgress)]
    assert [p.emission_index for p in progress] == [0, 1, 2]
    assert first.value.result.num_frames == 30
    pid = engine.pids[0]
    second = engine.run(JOB, payload(tmp_path, 6, 1), on_event=lambda e: None)
    assert first.value.warm.pid == second.value.warm.pid == pid
    assert (first.value.warm.jobs_on_rank, second.value.warm.jobs_on_rank) == (1, 2)
    assert engine.pids == [pid]


@pytest.mark.timeout(180)
def test_cancel_keeps_rank_and_raising_should_cancel_kills_it(engine: NodeEngine, tmp_path: Path) -> None:
    pid, generation = engine.pids[0], engine.generation
    seen: list[object] = []
    with pytest.raises(CancelledError):
        engine.run(JOB, payload(tmp_path, 7, 50, 0.05), on_event=seen.append,
                   should_cancel=lambda: len(seen) >= 3, poll_s=0.02)
    assert seen[-1] == SinkClosed(False)
    assert engine.pids == [pid] and engine.generation == generation  # cooperative: rank kept

    class Overdue(Exception):
        pass

    def overdue() -> bool:
        if len(seen) >= 2:
            raise Overdue("stop now")
        return False

    seen.clear()
    with pytest.raises(Overdue):
        engine.run(JOB, payload(tmp_path, 8, 50, 0.05), on_event=seen.append, should_cancel=overdue,
                   poll_s=0.02)
    assert not engine.is_running and engine.pids == []  # ranks killed
    again = engine.run(JOB, payload(tmp_path, 9, 1), on_event=lambda e: None)
    assert engine.generation == generation + 1 and engine.pids[0] != pid
    assert again.value.warm.jobs_on_rank == 1
