"""The tiny family: the reference models of ``models/`` (presets ``tiny``, the trained demo, and the
random-init ``1.3b`` / ``14b`` for speed and memory), four stages (context, A2V, SR, decode).

The folder: ``family.py`` (modules and stage wiring), ``ports.py``, ``stages/``. This file is the
family's definition as the registry sees it; it imports no torch (the API and the Celery parent read
the registry), so the models are imported when a render first needs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import InvalidInputError
from pipeline.model_family import FamilyPreset, ModelFamily, OptionBounds, ParallelPlan, check_option

if TYPE_CHECKING:
    from models.presets import ModelPreset
    from pipeline.module import Module
    from pipeline.stage import Stage
    from pipeline.stage_common import Timings

CHECKPOINT_DIR = Path(__file__).resolve().parents[3] / "models" / "checkpoints"

OPTION_BOUNDS: OptionBounds = {
    "audio_guidance": (float, 1.0, 10.0),  # 1: no guidance (one DiT forward per sampler step, no silence)
    "audio_guidance_peak": (float, 1.0, 10.0),  # the guidance on the cells the audio moves most (the mouth's)
    "steps": (int, 1, 50),  # the A2V's sampler steps
    "start_noise": (float, 0.1, 1.0),  # the flow time N chunks start at, from a guess (1: pure noise)
    "interp_start_noise": (float, 0.1, 1.0),  # the same for I chunks, from their anchors' line
}
"""The request options of :meth:`TinyFamily.options` (``RenderRequest.options``), each defaulting to
the preset's value (``ModelPreset.audio_guidance`` / ``audio_guidance_peak`` / ``num_steps`` /
``start_noise`` / ``interp_start_noise``); models/checkpoints/MODEL_CARD.md measured the tiny preset
at guidance 2 / 2.5 / 3 / 3.5 / 4.5 / 5.5, with a peak of 5.5 / 7 / 9, 3 / 5 / 8 / 10 steps,
start_noise 1 / 0.8 / 0.6 / 0.5 / 0.4 (with guidance 2.5 / 3 / 3.5) and interp_start_noise 0.6 /
0.15 / 0.1."""


class TinyFamily(ModelFamily):
    name = "tiny"
    default_preset = "tiny"
    has_sr = True
    overlap_emissions = True
    # A2V and SR DiTs sharded per block; the VAE, audio and text encoders whole on every rank.
    # embed_context / embed_reference run once per job outside forward and read root parameters.
    parallel = ParallelPlan(sharded=("a2v", "sr"),
                            forward_methods={"a2v": ("embed_context",), "sr": ("embed_reference",)})

    def preset(self, name: str) -> ModelPreset:
        from models.presets import get_preset

        try:
            return get_preset(name)
        except (KeyError, ValueError) as exc:
            raise InvalidInputError(f"preset {name!r} is unknown: {exc}", field="preset") from exc

    def default_checkpoint(self, preset: FamilyPreset) -> Path | None:
        """The checkpoint shipped with the repository for ``preset``, if any."""
        path = CHECKPOINT_DIR / f"{preset.name}.safetensors"
        return path if path.is_file() else None

    def audio_lookahead_frames(self, preset: FamilyPreset) -> int:
        # the context stage reads ``AudioConfig.context_frames`` video frames past each window
        return _model_preset(preset).audio.context_frames

    def options(self, preset: FamilyPreset, options: Mapping[str, str | int | float]) -> dict[str, str | int | float]:
        """``audio_guidance``, ``audio_guidance_peak``, ``steps``, ``start_noise`` and
        ``interp_start_noise`` within :data:`OPTION_BOUNDS`; the preset's values otherwise (a preset
        without a peak: the request's ``audio_guidance``, guidance the same on every cell).
        The context stage computes silence features only when the request's guidance is not 1; with
        guidance 1 there is no guidance to shape and the peak is not used."""
        p = _model_preset(preset)
        out: dict[str, str | int | float] = {
            "audio_guidance": p.audio_guidance,
            "audio_guidance_peak": p.audio_guidance if p.audio_guidance_peak is None else p.audio_guidance_peak,
            "steps": p.num_steps, "start_noise": p.start_noise, "interp_start_noise": p.interp_start_noise}
        for key, value in options.items():
            out[key] = check_option(self.name, p, key, value, out, OPTION_BOUNDS)
        if p.audio_guidance_peak is None and "audio_guidance_peak" not in options:
            out["audio_guidance_peak"] = out["audio_guidance"]
        return out

    def modules(self, preset: FamilyPreset, checkpoint: Path | None, *, device: str = "cpu",
                seed: int = 0) -> dict[str, Module]:
        from pipeline.families.tiny.family import family_modules

        return family_modules(_model_preset(preset), checkpoint, device=device, seed=seed)

    def stages(self, preset: FamilyPreset, modules: Mapping[str, Module], timings: Timings) -> list[Stage]:
        from pipeline.families.tiny.family import family_stages

        return family_stages(_model_preset(preset), modules, timings)


def _model_preset(preset: FamilyPreset) -> ModelPreset:
    from models.presets import ModelPreset

    if not isinstance(preset, ModelPreset):
        raise TypeError(f"the tiny family takes a models.presets.ModelPreset, got {type(preset).__name__}")
    return preset
