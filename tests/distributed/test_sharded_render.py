"""The real pipeline rendered on N gloo ranks with A2V and SR FSDP2-sharded (``family_loaders`` +
``render_on_rank``) against the single-process ``render()`` of the same request.

Observed: bit-identical frames and byte-identical fMP4 (init segment and every fragment). Why exact:
both sides build the weights through the tiny family's ``modules()`` (same seeds), the AllGather
reassembles the exact parameter bytes, every rank and the reference run the same CPU kernels with one
thread under ``torch.no_grad``, and x264 is deterministic for identical frames. The encoders run whole
on each rank, so only the DiT forwards go through FSDP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from bench.inputs import DEMO_IMAGE, speech_wav
from pipeline.errors import CancelledError, ModuleLoadError
from pipeline.families import FAMILIES
from pipeline.media_types import Fragment, InitSegment
from pipeline.placement.engine import EngineConfig, NodeEngine
from pipeline.placement.loaders import family_loaders
from pipeline.placement.rank import RankContext
from pipeline.placement.relay import SinkClosed
from pipeline.placement.render_job import RankRenderRequest, RankRenderResult, render_on_rank
from pipeline.render import RenderRequest, render
from pipeline.request import RenderProgress

pytestmark = pytest.mark.distributed

JOB = render_on_rank
SECONDS = 1.3  # 33 frames at 25 fps: N0 N1 I0 N2 — every chunk kind, both stage switches, 3 fragments
SEED = 7


class Recorder:
    """A FrameSink keeping the bytes (single-process side)."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def open(self, init: InitSegment) -> None:
        self.events.append(init)

    def write(self, fragment: Fragment) -> None:
        self.events.append(fragment)

    def close(self, *, ok: bool) -> None:
        self.events.append(SinkClosed(ok))


def _mp4(events: list[object]) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, InitSegment | Fragment))


def _decode(data: bytes, path: Path) -> np.ndarray:
    path.write_bytes(data)
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[RankRenderRequest, list[object], np.ndarray]:
    """The single-process render (this process, one thread): payload, sink events, tapped frames."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("sharded")
    audio = speech_wav(tmp / "speech.wav", SECONDS)
    request = RenderRequest(image=DEMO_IMAGE, audio=audio, seed=SEED)
    sink = Recorder()
    parts: list[tuple[int, np.ndarray]] = []
    render(request, [sink], frame_tap=lambda f0, fr: parts.append((f0, fr.copy())))
    frames = np.concatenate([p[1] for p in sorted(parts, key=lambda p: p[0])])
    return RankRenderRequest(render, request), sink.events, frames


def _check_sharded(world_size: int, reference: tuple[RankRenderRequest, list[object], np.ndarray],
                   tmp_path: Path, *, park: bool | None = None,
                   extra: Callable[[NodeEngine], None] | None = None) -> None:
    payload, ref_events, ref_frames = reference
    config = EngineConfig(world_size=world_size, loaders=family_loaders(FAMILIES.get("tiny"), "tiny"), threads_per_rank=1,
                          park=park)
    events: list[object] = []
    with NodeEngine(config) as engine:
        result = engine.run(JOB, payload, on_event=events.append, timeout_s=240)
        if extra is not None:
            extra(engine)
    warm = result.value.warm
    assert warm.sharded is True and warm.loads_this_job == 0 and warm.modules_loaded == 5
    assert result.value.result.num_frames == ref_frames.shape[0] == 33
    media = [e for e in events if not isinstance(e, RenderProgress)]
    assert [type(e).__name__ for e in media] == [type(e).__name__ for e in ref_events]
    assert media[-1] == SinkClosed(True)
    # frames first (the requirement), then the bytes (identical frames must encode identically)
    frames = _decode(_mp4(media), tmp_path / "sharded.mp4")
    ref_decoded = _decode(_mp4(ref_events), tmp_path / "reference.mp4")
    assert frames.shape == ref_decoded.shape == ref_frames.shape
    diff = np.abs(frames.astype(np.int16) - ref_decoded.astype(np.int16))
    assert diff.max() == 0, f"{world_size} ranks: decoded frames differ, max {diff.max()}, mean {diff.mean()}"
    for got, want in zip(media, ref_events, strict=True):
        if isinstance(want, InitSegment | Fragment):
            assert got == want, f"{type(want).__name__} {getattr(want, 'index', '')} differs"


@pytest.mark.timeout(240)
def test_two_rank_sharded_render_equals_single_process(
    reference: tuple[RankRenderRequest, list[object], np.ndarray], tmp_path: Path
) -> None:
    payload = reference[0]

    def wrong_preset(engine: NodeEngine) -> None:
        # the ranks hold the tiny family: a request for another preset fails clearly, ranks stay warm
        pids = engine.pids
        bad = dataclasses.replace(payload, request=dataclasses.replace(payload.request, preset="1.3b"))
        with pytest.raises(ModuleLoadError, match="family_loaders"):
            engine.run(JOB, bad)
        assert engine.pids == pids

        # a cancel mid-render: every rank stops at the same step (agreed_cancel), none is left in an
        # all-gather, so the job ends as cancelled and the ranks stay up
        seen: list[object] = []
        generation = engine.generation
        with pytest.raises(CancelledError):
            engine.run(JOB, payload, on_event=seen.append, poll_s=0.02,
                       should_cancel=lambda: any(isinstance(e, Fragment) for e in seen))
        assert seen[-1] == SinkClosed(False)
        assert sum(isinstance(e, Fragment) for e in seen) < 3  # stopped before the end
        assert engine.pids == pids and engine.generation == generation
        # only rank 1 sees the request: without agreement rank 0 would block in an all-gather
        with pytest.raises(CancelledError):
            engine.run(job_render_rank1_cancels, payload, timeout_s=60)
        assert engine.pids == pids and engine.generation == generation
        placement = engine.run(job_placement, {}).value
        assert isinstance(placement, dict)
        for name, (sharded, local, full) in placement.items():  # A2V and SR split, encoders whole
            assert sharded == (name in ("a2v", "sr")), (name, sharded)
            assert (local < 0.6 * full) if sharded else (local == full), (name, local, full)

    _check_sharded(2, reference, tmp_path, extra=wrong_preset)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_four_rank_sharded_parked_render_equals_single_process(
    reference: tuple[RankRenderRequest, list[object], np.ndarray], tmp_path: Path
) -> None:
    # parking forced on (CPU default: off): each stage's Module.get() activates its model through the
    # parker, the other DiT is parked and returned block by block just in time
    def parked_after_render(engine: NodeEngine) -> None:
        # the render ended with SR (then the VAE decode): A2V parked, SR resident
        resident = engine.run(job_resident_bytes, {}).value
        assert isinstance(resident, dict) and set(resident) == {"a2v", "sr"}, resident
        assert resident["a2v"] == 0 < resident["sr"], resident

    _check_sharded(4, reference, tmp_path, park=True, extra=parked_after_render)


def job_placement(ctx: RankContext, payload: Mapping[str, object]) -> dict[str, tuple[bool, int, int]]:
    """Rank job: per engine module, (FSDP-sharded, local parameter elements, full elements)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, module in ctx.modules.items():
        params = list(module.parameters())
        sharded = any(isinstance(p, DTensor) for p in params)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
        out[name] = (sharded, local, sum(p.numel() for p in params))
    return out


def job_resident_bytes(ctx: RankContext, payload: Mapping[str, object]) -> dict[str, int]:
    """Rank job: the parker's resident bytes per registered model (after a render)."""
    return dict(ctx.parker.resident_bytes())


def job_render_rank1_cancels(ctx: RankContext, job: RankRenderRequest) -> RankRenderResult:
    """Rank job: ``render_on_rank`` where only rank 1 sees a cancel request, from its third poll on
    (the widest possible skew between ranks' views of the shared cancel flag)."""
    polls = [0]

    def skewed() -> bool:
        polls[0] += 1
        return ctx.rank == 1 and polls[0] >= 3

    ctx.cancel_requested = skewed  # type: ignore[method-assign]  # this job only; restored below
    try:
        return render_on_rank(ctx, job)
    finally:
        del ctx.cancel_requested
