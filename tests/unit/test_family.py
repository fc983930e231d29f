"""The family interface from the outside: a second, minimal family defined only in this file is
registered with one line and renders through ``render()``, without editing any framework file.

``MiniFamily`` has one module (a 1x1 linear layer) and two stages over the framework's own ports: a
step stage turning each frame's audio loudness into a one-value "latent", and an emission stage
scaling the reference image by it. It shows what a family must provide (``ModelFamily``: presets, its
modules — the one weight builder —, its stages) and that the framework's oracles hold for any family.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from bench.inputs import DEMO_IMAGE
from pipeline import ports as P
from pipeline.errors import InvalidInputError
from pipeline.families import FAMILIES
from pipeline.media_types import Fragment, InitSegment
from pipeline.model_family import FamilyPreset, ModelFamily
from pipeline.module import Module
from pipeline.render import RenderRequest, render
from pipeline.stage import Phase, Stage, Values
from pipeline.stage_common import Timings


@dataclass(frozen=True)
class MiniPreset:
    name: str = "mini"
    height: int = 64
    width: int = 64
    fps: int = 25
    sample_rate: int = 16000
    chunk_frames: int = 8
    context_frames: int = 2
    interp_frames: int = 2
    reference_frame: bool = False


class LoudnessStage(Stage):
    """Per step: RMS of each generated frame's audio through the module -> step_latents (1,1,T,1,1)."""

    name = "loudness"
    phase = Phase.STEP
    inputs = (P.STEP, P.AUDIO)
    outputs = (P.STEP_LATENTS,)

    def __init__(self, gain: Module, preset: MiniPreset, timings: Timings) -> None:
        self.gain, self.preset, self.timings = gain, preset, timings

    @torch.no_grad()
    def run(self, values: Values) -> None:
        step, audio = values.get(P.STEP), values.get(P.AUDIO)
        spf = self.preset.sample_rate // self.preset.fps
        g = step.generate
        wave = audio.read(g.start * spf, g.stop * spf, self.preset.sample_rate).reshape(len(g), spf)
        rms_T1 = torch.from_numpy(np.sqrt(np.mean(wave.astype(np.float64) ** 2, axis=1))).float()[:, None]
        with self.timings.model("gain"):
            out_T1 = self.gain.get()(rms_T1).clamp(0.0, 1.0)
        values.put(P.STEP_LATENTS, out_T1.reshape(1, 1, len(g), 1, 1))


class ShadeStage(Stage):
    """Per emission: the reference image scaled by each frame's latent -> frames."""

    name = "shade"
    phase = Phase.EMISSION
    inputs = (P.EMISSION_LATENTS, P.REFERENCE_RGB)
    outputs = (P.FRAMES,)

    def run(self, values: Values) -> None:
        scale_T = values.get(P.EMISSION_LATENTS).reshape(-1).numpy()
        ref = values.get(P.REFERENCE_RGB).astype(np.float32)
        frames = np.clip(ref[None] * scale_T[:, None, None, None], 0, 255).round().astype(np.uint8)
        values.put(P.FRAMES, frames)


class MiniFamily(ModelFamily):
    name = "mini"
    default_preset = "mini"
    has_sr = False

    def preset(self, name: str) -> MiniPreset:
        if name != "mini":
            raise InvalidInputError(f"preset {name!r} is unknown to family 'mini': use 'mini'", field="preset")
        return MiniPreset()

    def modules(self, preset: FamilyPreset, checkpoint: Path | None, *, device: str = "cpu",
                seed: int = 0) -> dict[str, Module]:
        def build() -> nn.Module:  # brightness = 0.3 + 5 * loudness (a "trained" module, seed unused)
            gain = nn.Linear(1, 1)
            with torch.no_grad():
                gain.weight.fill_(5.0)
                gain.bias.fill_(0.3)
            return gain

        return {"gain": Module("gain", build, checkpoint=checkpoint, prefix="gain.", device=device)}

    def stages(self, preset: FamilyPreset, modules: Mapping[str, Module], timings: Timings) -> list[Stage]:
        assert isinstance(preset, MiniPreset)
        return [LoudnessStage(modules["gain"], preset, timings), ShadeStage()]


class Sink:
    def __init__(self) -> None:
        self.fragments: list[Fragment] = []
        self.closed: bool | None = None

    def open(self, init: InitSegment) -> None:
        self.init = init

    def write(self, fragment: Fragment) -> None:
        self.fragments.append(fragment)

    def close(self, *, ok: bool) -> None:
        self.closed = ok


@pytest.fixture
def mini() -> Iterator[MiniFamily]:
    family = FAMILIES.register(MiniFamily())  # the one registration line
    try:
        yield family
    finally:
        FAMILIES.unregister(family.name)


def _render(request: RenderRequest, mode: str = "streaming", **kw: object) -> tuple[np.ndarray, Sink]:
    parts: list[np.ndarray] = []
    sink = Sink()
    render(request, [sink], mode=mode, frame_tap=lambda f0, fr: parts.append(fr.copy()), **kw)  # type: ignore[arg-type]
    return np.concatenate(parts), sink


def test_a_family_defined_in_a_test_renders_through_render(mini: MiniFamily, speech) -> None:  # type: ignore[no-untyped-def]
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(1.0), family="mini", preset="mini")
    frames, sink = _render(request)
    assert frames.shape == (25, 64, 64, 3) and frames.dtype == np.uint8
    assert sink.closed is True and len(sink.fragments) == 4  # ceil(25 / L=8) emissions, one fragment each
    assert len({int(f.mean()) for f in frames}) > 1  # the frames follow the audio
    batch, batch_sink = _render(request, mode="batch")
    assert np.array_equal(frames, batch)  # the framework's oracle holds for any family
    assert [f.data for f in sink.fragments] == [f.data for f in batch_sink.fragments]


def test_unknown_family_names_the_field_and_the_registered_ones(mini: MiniFamily, speech) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidInputError, match=r"family='nope' is not registered.*\['mini', 'tiny', 'wan'\]") as err:
        render(RenderRequest(image=DEMO_IMAGE, audio=speech(0.2), family="nope"), [Sink()])
    assert err.value.field == "family"


def test_the_job_spec_accepts_registered_families_only(mini: MiniFamily) -> None:
    from pydantic import ValidationError

    from worker.spec import JobSpec

    base = {"image": "s3://bucket/ref.png", "audio": "s3://bucket/speech.wav"}
    assert JobSpec.model_validate(base).family == "tiny"
    assert JobSpec.model_validate({**base, "family": "mini", "preset": "mini"}).family == "mini"
    with pytest.raises(ValidationError, match=r"family: 'nope' is not a registered model family; use one of \['mini', 'tiny', 'wan'\]"):
        JobSpec.model_validate({**base, "family": "nope"})


def test_registering_a_second_family_under_a_taken_name_fails(mini: MiniFamily) -> None:
    with pytest.raises(ValueError, match="family 'mini' is already registered"):
        FAMILIES.register(MiniFamily())
