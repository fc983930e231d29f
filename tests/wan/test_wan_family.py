"""The ``wan`` family on the tiny Wan release (public layout, random weights): schedule on the Wan
VAE's grid, streaming == batch, resume == uninterrupted, the two conditioning modes, options, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.inputs import DEMO_IMAGE, speech_wav
from models.wan.tiny_release import write_tiny_infinitetalk
from pipeline.errors import InvalidInputError, ModuleLoadError
from pipeline.families import FAMILIES
from pipeline.families.wan.conditioning import condition, known_latents
from pipeline.families.wan.family import check_weights
from pipeline.families.wan.presets import PRESETS
from pipeline.family_runtime import WARM_FAMILIES
from pipeline.media_types import Fragment, InitSegment
from pipeline.render import RenderRequest, render
from pipeline.schedule import ChunkKind, ChunkPlan, FrameGrid, frames_for_audio
from pipeline.state import RollingState
from tests.unit.test_pipeline import render_batched_and_sequential

WAN = FAMILIES.get("wan")


class Recorder:
    def __init__(self) -> None:
        self.init: InitSegment | None = None
        self.fragments: list[Fragment] = []

    def open(self, init: InitSegment) -> None:
        self.init = init

    def write(self, fragment: Fragment) -> None:
        self.fragments.append(fragment)

    def close(self, *, ok: bool) -> None:
        assert ok


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_infinitetalk(tmp_path_factory.mktemp("wan") / "weights")


@pytest.fixture(scope="module")
def audio(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 2.1 s = 53 video frames = 14 latents: N0 N1 I0 N2 I1 N3 I2 (a 2-latent last chunk)
    return speech_wav(tmp_path_factory.mktemp("wan_audio") / "speech.wav", 2.1)


def _render(request: RenderRequest, **kw: object) -> tuple[np.ndarray, Recorder]:
    parts: list[tuple[int, np.ndarray]] = []
    sink = Recorder()
    render(request, [sink], frame_tap=lambda f0, fr: parts.append((f0, fr.copy())), **kw)  # type: ignore[arg-type]
    parts.sort(key=lambda p: p[0])
    assert [p[0] for p in parts] == sorted({p[0] for p in parts})
    return np.concatenate([p[1] for p in parts]), sink


def _request(release: Path, audio: Path, **kw: object) -> RenderRequest:
    return RenderRequest(image=DEMO_IMAGE, audio=audio, text="w1 w2 w3", seed=5, family="wan", preset="tiny",
                         checkpoint=release, **kw)  # type: ignore[arg-type]


def test_plan_on_the_wan_vae_grid() -> None:
    grid = WAN.frame_grid(PRESETS["tiny"])
    assert grid == FrameGrid(stride=4, causal_first=True, reference_is_first=True)
    assert [grid.timeline_frames(v) for v in (1, 2, 5, 6, 53)] == [1, 2, 2, 3, 14]
    plan = ChunkPlan(14, 4, 1, 2, grid=grid, num_video_frames=53)
    steps = {s.name: s for s in plan.steps}
    assert plan.describe() == "N0 -> N1 -> I0 -> N2 -> I1 -> N3 -> I2"
    n0, n1, i0 = steps["N0"], steps["N1"], steps["I0"]
    # N0: the reference is latent 0, known and generated through; N1 sees 1 context latent
    assert (n0.window, n0.known, n0.generate, n0.reference_slot) == (range(0, 4), (0,), range(0, 4), True)
    assert (n1.window, n1.known, n1.generate, n1.reference_slot) == (range(3, 8), (3,), range(4, 8), False)
    assert (i0.kind, i0.window, i0.known, i0.generate) == (ChunkKind.I, range(3, 7), (3, 6), range(4, 6))
    # emissions tile the video: 1 + 4(L - 1) frames first, 4L after, the last cut at the audio's end
    videos = [plan.video_frames(plan.emission_frames(j)) for j in range(plan.num_emissions)]
    assert videos == [range(0, 13), range(13, 29), range(29, 45), range(45, 53)]
    assert plan.key[6:] == (4, True, True, 53) and ChunkPlan(14, 4, 1, 2).key == (14, 4, 1, 2, True, False)
    with pytest.raises(ValueError, match="num_video_frames"):
        ChunkPlan(14, 4, 1, 2, grid=grid, num_video_frames=60)


def test_buckets_options_and_missing_weights(tmp_path: Path) -> None:
    p = PRESETS["infinitetalk"]
    assert WAN.output_size(p, (1080, 1920)) == (448, 896) and WAN.output_size(p, (1920, 1080)) == (832, 448)
    assert WAN.output_size(PRESETS["infinitetalk-720p"], (1000, 1000)) == (960, 960)
    opts = WAN.options(p, {"steps": 8, "conditioning": "reencode"})
    assert (opts["steps"], opts["shift"], opts["text_guidance"], opts["audio_guidance"]) == (8, 7.0, 5.0, 4.0)
    for bad, field in (({"steps": 0}, "options.steps"), ({"shift": 50.0}, "options.shift"),
                       ({"conditioning": "pixels"}, "options.conditioning"), ({"cfg": 1}, "options.cfg")):
        with pytest.raises(InvalidInputError) as err:
            WAN.options(p, bad)
        assert err.value.field == field, err.value
    with pytest.raises(ModuleLoadError, match="huggingface-cli download MeiGen-AI/InfiniteTalk") as err2:
        check_weights(p, tmp_path)
    assert "Wan2.1-I2V-14B-480P/config.json" in str(err2.value) and "chinese-wav2vec2-base" in str(err2.value)
    with pytest.raises(ModuleLoadError, match="pass --weights DIR"):
        check_weights(p, None)


def test_streaming_equals_batch_and_video_matches_audio(release: Path, audio: Path) -> None:
    request = _request(release, audio)
    streamed, sink = _render(request)
    batched, _ = _render(request, mode="batch")
    v = frames_for_audio(int(2.1 * 16000), 16000, 25)
    assert streamed.shape == batched.shape == (v, 32, 32, 3) == (53, 32, 32, 3)
    diff = np.abs(streamed.astype(np.int16) - batched.astype(np.int16))
    assert diff.max() <= 1 and diff.mean() < 1e-3, (diff.max(), diff.mean())
    assert [f.index for f in sink.fragments] == [0, 1, 2, 3]
    assert streamed.std() > 1.0  # not a constant picture


def test_resume_from_a_stored_state_equals_uninterrupted(release: Path, audio: Path) -> None:
    request = _request(release, audio)
    _, sink = _render(request)
    state = sink.fragments[1].resume_state
    sizes = [len(f.resume_state or b"") for f in sink.fragments[:-1]]
    assert state is not None and max(sizes) < 1.01 * min(sizes), sizes  # the state does not grow
    WARM_FAMILIES._runtimes.clear()  # a fresh runtime, as a new worker process would build
    _, resumed = _render(request, resume_state=state)
    assert [f.index for f in resumed.fragments] == [2, 3]
    assert [f.data for f in resumed.fragments] == [f.data for f in sink.fragments[2:]]
    assert resumed.init is not None and sink.init is not None and resumed.init.data == sink.init.data


def test_reencode_differs_from_latent_only_in_the_context_frames(release: Path, audio: Path) -> None:
    latent, _ = _render(_request(release, audio))
    reencoded, _ = _render(_request(release, audio, options={"conditioning": "reencode"}))
    assert np.array_equal(latent[:13], reencoded[:13])  # N0: the reference alone, both modes
    assert not np.array_equal(latent[13:], reencoded[13:])
    # the DiT's inputs for N1 and I0: only N1's context latent differs between the modes
    runtime = WARM_FAMILIES.get(WAN, "tiny", release)
    a2v = runtime.pipeline.step_stages[1]
    plan = ChunkPlan(14, 4, 1, 2, grid=WAN.frame_grid(PRESETS["tiny"]), num_video_frames=53)
    steps = {s.name: s for s in plan.steps}
    g = torch.Generator().manual_seed(0)
    ref, pad = torch.randn(1, 16, 1, 4, 4, generator=g), torch.randn(1, 16, 1, 4, 4, generator=g)
    state = RollingState(last_n=torch.randn(1, 16, 4, 4, 4, generator=g), prev_last=torch.randn(1, 16, 1, 4, 4, generator=g))
    for name, differ in (("N1", {0}), ("I0", set())):
        step = steps[name]
        conds = [condition(step, known_latents(step, mode, ref, state.last_n, state.prev_last, a2v.reencode), pad)
                 for mode in ("latent", "reencode")]
        (c_lat, k_lat, m_lat), (c_re, k_re, m_re) = conds
        assert torch.equal(m_lat, m_re) and torch.equal(c_lat[:, :4], c_re[:, :4])  # same mask
        changed = {t for t in range(len(step.window)) if not torch.equal(k_lat[:, :, t], k_re[:, :, t])}
        assert changed == differ, (name, changed)
        assert torch.equal(k_lat[:, :, 0], state.last_n[:, :, -1] if name == "N1" else state.prev_last[:, :, 0])


@pytest.mark.parametrize("conditioning", ["latent", "reencode"])
def test_batched_steps_equal_the_sequential_loop(release: Path, audio: Path, conditioning: str) -> None:
    # N0 N1 I0 N2 I1 N3 I2 -> groups N0 | N1 | I0+N2 | I1+N3 | I2 (I2: nothing after it)
    request = _request(release, audio, options={"conditioning": conditioning})
    runtime = WARM_FAMILIES.get(WAN, "tiny", release)
    assert runtime.batch_steps and runtime.pipeline.batched_stage is not None
    results, per_run = render_batched_and_sequential(runtime, runtime.modules["dit"].get(),
                                                     lambda: _render(request))
    (batched, b_sink), (sequential, s_sink) = results["batched"], results["sequential"]
    steps = int(WAN.options(PRESETS["tiny"], {})["steps"])  # one DiT forward per sampler step per group
    assert len(per_run["sequential"]) == 7 * steps and all(w is None for _, w in per_run["sequential"])
    packed = [(t, w) for t, w in per_run["batched"] if w is not None]
    assert len(per_run["batched"]) == 5 * steps and len(packed) == 2 * steps
    # I_{k-1} (two anchors + e = 4 latents) packed with N_{k+1} (C = 1 context + L = 4; N3, the last
    # chunk, generates the 2 latents left)
    assert [w for _, w in packed] == [(4, 5)] * steps + [(4, 3)] * steps
    assert np.array_equal(batched, sequential)
    assert [f.data for f in b_sink.fragments] == [f.data for f in s_sink.fragments]
