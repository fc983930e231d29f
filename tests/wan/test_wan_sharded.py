"""The ``wan`` family on 2 gloo ranks with the DiT FSDP2-sharded per block (``family_loaders`` +
``render_on_rank``) against the single-process ``render()`` of the same request: the same fMP4 bytes.

Why exact (as for tiny, tests/distributed/test_sharded_render.py): both sides build the weights
through ``WanFamily.modules`` from the same tiny release, the all-gathers reassemble the exact
parameter bytes, every rank and the reference run the same CPU kernels with one thread, and x264 is
deterministic for identical frames. The VAE, wav2vec2, umT5 and CLIP run whole on each rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.inputs import DEMO_IMAGE, speech_wav
from models.wan.tiny_release import write_tiny_infinitetalk
from pipeline.families import FAMILIES
from pipeline.media_types import Fragment, InitSegment
from pipeline.placement.engine import EngineConfig, NodeEngine
from pipeline.placement.loaders import family_loaders
from pipeline.placement.render_job import RankRenderRequest, render_on_rank
from pipeline.render import RenderRequest, render
from pipeline.request import RenderProgress

pytestmark = pytest.mark.distributed


class Recorder:
    def __init__(self) -> None:
        self.events: list[object] = []

    def open(self, init: InitSegment) -> None:
        self.events.append(init)

    def write(self, fragment: Fragment) -> None:
        self.events.append(fragment)

    def close(self, *, ok: bool) -> None:
        pass


def _media(events: list[object]) -> list[bytes]:
    return [e.data for e in events if isinstance(e, InitSegment | Fragment)]


@pytest.mark.timeout(300)
def test_two_rank_sharded_wan_render_equals_single_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    weights = write_tiny_infinitetalk(tmp_path / "weights")
    # 1.3 s = 33 video frames = 9 latents: N0 N1 I0 N2 I1 (3 fragments, both chunk kinds)
    request = RenderRequest(image=DEMO_IMAGE, audio=speech_wav(tmp_path / "speech.wav", 1.3), text="w1 w2",
                            seed=7, family="wan", preset="tiny", checkpoint=weights)
    sink = Recorder()
    single = render(request, [sink])
    config = EngineConfig(world_size=2, loaders=family_loaders(FAMILIES.get("wan"), "tiny", checkpoint=weights),
                          threads_per_rank=1)
    events: list[object] = []
    with NodeEngine(config) as engine:
        result = engine.run(render_on_rank, RankRenderRequest(render, request), on_event=events.append, timeout_s=240)
    warm = result.value.warm
    assert warm.sharded is True and warm.modules_loaded == 5 and warm.loads_this_job == 0
    assert result.value.result.num_frames == single.num_frames == 33
    got = _media([e for e in events if not isinstance(e, RenderProgress)])
    want = _media(sink.events)
    assert len(got) == len(want) == 4  # init + 3 fragments
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"segment {i} differs between 2 sharded ranks and the single process"
