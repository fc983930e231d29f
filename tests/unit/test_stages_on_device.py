"""Both families' stages with every model on CUDA (issue 12), on a CPU-only torch.

``render(..., device="cuda")`` puts every module on the GPU (``pipeline.module.Module``); the stages
must then make their own tensors there (the reference, the audio, the noise, the masks and indices),
read results back through ``.cpu()``, and carry the rolling state on the device. A CPU build cannot
allocate CUDA memory, so the models' parameters become :class:`~as_cuda.OnCuda` tensors: CPU data that
says it lives on cuda:0, under CUDA's device rules (``as_cuda``). The pipeline then runs the plan's
first steps (context setup, N0, N1, I0; SR where the family has it; decode and the resume snapshots)
exactly as ``render`` would. The oracles: no op mixes devices, every tensor a stage hands on is on
cuda:0, and the frames and snapshots are byte-identical to the same steps on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from as_cuda import CUDA, AsCuda, DeviceMismatchError, OnCuda, to_cuda

from bench.inputs import DEMO_IMAGE
from pipeline import ports as P
from pipeline.errors import CancelledError
from pipeline.families import FAMILIES
from pipeline.family_runtime import FamilyRuntime
from pipeline.inputs import load_reference_image
from pipeline.schedule import ChunkPlan, frames_for_audio
from pipeline.stage import Port, Values
from pipeline.state import RollingState


class Tone:
    """A voiced-sounding 16 kHz tone (an ``AudioReader``)."""

    def __init__(self, seconds: float, rate: int = 16000) -> None:
        t = np.arange(int(seconds * rate)) / rate
        self.rate = rate
        self.x = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)

    def num_samples(self, rate: int) -> int:
        return len(self.x) * rate // self.rate

    def wait(self, stop: int | None, rate: int, *, timeout_s: float | None = None) -> bool:
        return True  # whole from the start, like AudioSource

    def read(self, start: int, stop: int, rate: int) -> np.ndarray:
        assert rate == self.rate
        out = np.zeros(stop - start, np.float32)
        lo, hi = max(start, 0), min(stop, len(self.x))
        if hi > lo:
            out[lo - start : hi - start] = self.x[lo:hi]
        return out


@dataclass
class Run:
    published: list[tuple[int, np.ndarray, bytes | None]] = field(default_factory=list)
    devices: dict[str, set[str]] = field(default_factory=dict)  # port -> devices of its tensors

    def open(self) -> None:
        pass

    def publish(self, frames: np.ndarray, *, first_frame: int, index: int, is_last: bool,
                resume_state: bytes | None) -> None:
        assert isinstance(frames, np.ndarray)
        self.published.append((index, frames.copy(), resume_state))

    def finish(self, *, ok: bool) -> None:
        pass


@pytest.fixture
def spy_values(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Run]]:
    """Record the device of every tensor a stage puts (the values passed between stages)."""
    current: list[Run] = []
    put = Values.put

    def recording(self: Values, port: Port[object], value: object) -> None:
        leaves = value if isinstance(value, tuple) else (value,)
        devices = current[-1].devices.setdefault(port.name, set())
        devices.update(str(t.device) for t in leaves if isinstance(t, torch.Tensor))
        put(self, port, value)

    monkeypatch.setattr(Values, "put", recording)
    yield current


def _run(family_name: str, preset_name: str, *, on_cuda: bool, seconds: float, num_steps: int,
         runs: list[Run], options: dict[str, str | int | float] | None = None,
         resume: bytes | None = None) -> Run:
    """The plan's first ``num_steps`` steps through the family's pipeline, as ``render`` runs them."""
    family = FAMILIES.get(family_name)
    preset = family.preset(preset_name)
    runtime = FamilyRuntime(family, preset, family.default_checkpoint(preset))
    audio = Tone(seconds)
    h, w = family.output_size(preset, (256, 256))
    grid = family.frame_grid(preset)
    num_video = frames_for_audio(audio.num_samples(preset.sample_rate), preset.sample_rate, preset.fps)
    plan = ChunkPlan(grid.timeline_frames(num_video), preset.chunk_frames, preset.context_frames,
                     preset.interp_frames, reference_frame=preset.reference_frame, grid=grid,
                     num_video_frames=0 if grid.is_identity else num_video)
    run = Run()
    runs.append(run)
    torch.__future__.set_swap_module_params_on_conversion(True)  # Module.park / get move OnCuda parameters
    try:
        with AsCuda() if on_cuda else torch.no_grad():
            if on_cuda:
                for module in runtime.modules.values():
                    to_cuda(module.get())
                    module.device = CUDA
            if resume is None:
                state = RollingState(plan_key=plan.key)
            else:  # what restore(map_location=device) gives
                state = RollingState.restore(resume, plan_key=plan.key, resume_key={})
                if on_cuda:
                    state.last_n, state.prev_last = (None if t is None else t.to(CUDA)
                                                     for t in (state.last_n, state.prev_last))
                    state.decoder_cache = [t.to(CUDA) for t in state.decoder_cache]
            try:
                runtime.pipeline.run(
                    job_values={P.REFERENCE_RGB: load_reference_image(DEMO_IMAGE, h, w), P.AUDIO: audio,
                                P.TEXT: "a person talking", P.SEED: 3,
                                P.OPTIONS: family.options(preset, options or {})},
                    plan=plan, state=state, publisher=run, should_cancel=lambda: state.next_step >= num_steps)
            except CancelledError:
                pass
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert run.published, "no emission was published"
    return run


def _assert_on_cuda_and_same_as_cpu(cuda: Run, cpu: Run) -> None:
    tensors = {name: devs for name, devs in cuda.devices.items() if devs}
    assert tensors and all(devs == {"cuda:0"} for devs in tensors.values()), tensors
    assert all(devs <= {"cpu"} for devs in cpu.devices.values())
    assert [i for i, _, _ in cuda.published] == [i for i, _, _ in cpu.published]
    for (i, frames, snapshot), (_, frames_cpu, snapshot_cpu) in zip(cuda.published, cpu.published, strict=True):
        assert frames.dtype == np.uint8 and np.array_equal(frames, frames_cpu), f"emission {i}"
        assert snapshot == snapshot_cpu, f"resume snapshot after emission {i}"


def test_tiny_stages_on_cuda(spy_values: list[Run]) -> None:
    # 1.5 s = 38 frames: N0 N1 I0 N2 I1; N0, N1, I0 publish emissions 0 and 1 through SR and decode
    kw = dict(seconds=1.5, num_steps=3, runs=spy_values)
    cuda = _run("tiny", "tiny", on_cuda=True, **kw)  # type: ignore[arg-type]
    cpu = _run("tiny", "tiny", on_cuda=False, **kw)  # type: ignore[arg-type]
    assert len(cuda.published) == 2
    assert {"ref_latent", "noise", "audio_feats", "step_latents", "emission_hr"} <= set(cuda.devices)
    _assert_on_cuda_and_same_as_cpu(cuda, cpu)


@pytest.mark.parametrize("conditioning", ["latent", "reencode"])
def test_wan_stages_on_cuda_and_resume(spy_values: list[Run], conditioning: str) -> None:
    # 1.3 s = 33 video frames = 9 latents: N0 N1 I0 N2 (three emissions); then a resume after emission 0
    kw = dict(seconds=1.3, num_steps=4, runs=spy_values, options={"conditioning": conditioning})
    cuda = _run("wan", "tiny", on_cuda=True, **kw)  # type: ignore[arg-type]
    cpu = _run("wan", "tiny", on_cuda=False, **kw)  # type: ignore[arg-type]
    assert len(cuda.published) == 3
    _assert_on_cuda_and_same_as_cpu(cuda, cpu)
    snapshot = cpu.published[0][2]
    assert snapshot is not None
    resumed = _run("wan", "tiny", on_cuda=True, resume=snapshot, **kw)  # type: ignore[arg-type]
    assert [i for i, _, _ in resumed.published] == [1, 2]
    for (_, frames, _), (_, frames_cpu, _) in zip(resumed.published, cpu.published[1:], strict=True):
        assert np.array_equal(frames, frames_cpu)


def test_as_cuda_follows_cuda_device_rules() -> None:
    """The stand-in fails where CUDA fails and computes what the CPU computes."""
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    expected = lin(x)
    to_cuda(lin)
    with AsCuda():
        with pytest.raises(DeviceMismatchError, match="cpu and cuda:0"):
            lin(x)
        y = lin(x.to(CUDA))
        assert isinstance(y, OnCuda) and y.device == CUDA and torch.equal(y.cpu(), expected)
        with pytest.raises(TypeError, match="can't convert cuda:0"):
            y.numpy()
        assert y.cpu().numpy().shape == (2, 3) and y.tolist() == expected.tolist()
        with pytest.raises(DeviceMismatchError):
            y + torch.ones(2, 3)
        assert (y + torch.tensor(1.0)).device == CUDA  # a CPU 0-dim tensor is a scalar
        assert y[:, torch.tensor([0, 2])].device == CUDA  # CPU indices of a CUDA tensor
        with pytest.raises(DeviceMismatchError):
            y[:, :2] = torch.zeros(2, 2)
        assert torch.zeros(3, device=y.device).device == CUDA
