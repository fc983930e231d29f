"""GPU-only: both families render end to end with ``device="cuda"`` (skipped without CUDA by the root
conftest). On the CPU the stages are proved device-clean with a cuda:0 stand-in
(``tests/unit/test_stages_on_device.py``); this runs the real thing: every stage, the encoder and the
sinks, through ``pipeline.render``, and compares the frames with the same render on the CPU. Frames
are not bit-equal across devices (cuDNN convolutions run in TF32 by default, kernels differ), so the
oracle is a small mean difference in 8-bit levels, the same frame count and a sink closed ok with fragments."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.inputs import DEMO_IMAGE, speech_wav
from models.wan.tiny_release import write_tiny_infinitetalk
from pipeline.render import RenderRequest
from tests.unit.test_pipeline import _frames

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["tiny", "wan"])
def test_render_on_cuda_matches_the_cpu(family: str, tmp_path: Path) -> None:
    audio = speech_wav(tmp_path / "speech.wav", 2.1)
    if family == "wan":  # the public InfiniteTalk layout, random weights, float32 (the tiny preset)
        request = RenderRequest(image=DEMO_IMAGE, audio=audio, text="w1 w2 w3", seed=5, family="wan",
                                preset="tiny", checkpoint=write_tiny_infinitetalk(tmp_path / "weights"))
    else:  # the shipped checkpoint
        request = RenderRequest(image=DEMO_IMAGE, audio=audio, seed=5)
    on_gpu, sink = _frames(request, device="cuda")
    on_cpu, _ = _frames(request, device="cpu")
    assert sink.closed and sink.init is not None and sink.fragments
    assert on_gpu.shape == on_cpu.shape
    diff = np.abs(on_gpu.astype(np.float32) - on_cpu.astype(np.float32)).mean(axis=(1, 2, 3))
    print(f"{family}: {len(diff)} frames, mean |cuda - cpu| {diff.mean():.3f} levels, worst frame {diff.max():.3f}")
    assert diff.mean() < 2.0 and diff.max() < 6.0
