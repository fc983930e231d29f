"""The ``wan`` family: the public Wan2.1-I2V avatar checkpoints (InfiniteTalk, SoulX-FlashTalk) of
``models/wan`` on the streaming pipeline. Three stages: context (per step: wav2vec2 window features
and noise; per job: reference latent, CLIP and umT5 tokens), A2V (flow-matching sampling with the
checkpoint's guidance), decode (the streaming Wan VAE, its causal cache in the rolling state). No SR.

The folder: ``presets.py`` (releases, published defaults, buckets; no torch), ``family.py`` (module
builders / release loaders and stage wiring), ``ports.py``, ``conditioning.py`` (the known frames of
a window: ``latent`` and ``reencode`` modes), ``stages/``. This file is what the registry sees; it
imports no torch (the models are imported when a render first needs them).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import InvalidInputError
from pipeline.families.wan.presets import (
    AUDIO_WINDOW,
    CONDITIONING_MODES,
    OPTION_BOUNDS,
    PRESETS,
    WAN_NEGATIVE_PROMPT,
    WanPreset,
)
from pipeline.model_family import FamilyPreset, ModelFamily, ParallelPlan, check_option
from pipeline.schedule import FrameGrid

if TYPE_CHECKING:
    from pipeline.module import Module
    from pipeline.stage import Stage
    from pipeline.stage_common import Timings

MAX_NEGATIVE_PROMPT_CHARS = 2000


class WanFamily(ModelFamily):
    name = "wan"
    default_preset = "infinitetalk"
    has_sr = False
    overlap_emissions = True
    # the DiT sharded per block (FSDP2); VAE and wav2vec2 whole on every rank; umT5 and CLIP whole, run
    # at setup and parked (Module.park). embed_context / audio_tokens read root parameters outside forward.
    parallel = ParallelPlan(sharded=("dit",), forward_methods={"dit": ("embed_context", "audio_tokens")})

    def preset(self, name: str) -> WanPreset:
        preset = PRESETS.get(name)
        if preset is None:
            raise InvalidInputError(f"preset {name!r} is not a wan preset; use one of {sorted(PRESETS)}",
                                    field="preset")
        return preset

    def frame_grid(self, preset: FamilyPreset) -> FrameGrid:
        # the Wan VAE: 4x temporal compression, causal first frame; the reference is the first frame (I2V)
        return FrameGrid(stride=_wan(preset).vae_stride, causal_first=True, reference_is_first=True)

    def audio_lookahead_frames(self, preset: FamilyPreset) -> int:
        # WanContextStage: half the wav2vec2 frame window past the window's last video frame, then
        # ``audio_context`` frames of transformer context, then the CNN's receptive field (< 1 frame)
        return AUDIO_WINDOW // 2 + _wan(preset).audio_context + 1

    def output_size(self, preset: FamilyPreset, source_hw: tuple[int, int]) -> tuple[int, int]:
        return _wan(preset).bucket(source_hw)

    def options(self, preset: FamilyPreset, options: Mapping[str, str | int | float]) -> dict[str, str | int | float]:
        """``steps``, ``shift``, ``text_guidance``, ``audio_guidance`` within :data:`OPTION_BOUNDS`,
        ``conditioning`` ("latent" default, "reencode"), ``negative_prompt``; the rest from the preset."""
        p = _wan(preset)
        out: dict[str, str | int | float] = {
            "steps": p.num_steps, "shift": p.shift, "text_guidance": p.text_guidance,
            "audio_guidance": p.audio_guidance, "conditioning": "latent", "negative_prompt": WAN_NEGATIVE_PROMPT,
        }  # fmt: skip
        for key, value in options.items():
            if key == "conditioning":
                if value not in CONDITIONING_MODES:
                    raise InvalidInputError(f"options.conditioning={value!r}: use one of {list(CONDITIONING_MODES)}",
                                            field="options.conditioning")
                out[key] = str(value)
            elif key == "negative_prompt":
                if not isinstance(value, str) or len(value) > MAX_NEGATIVE_PROMPT_CHARS:
                    raise InvalidInputError(f"options.negative_prompt: a string of at most {MAX_NEGATIVE_PROMPT_CHARS} "
                                            "characters", field="options.negative_prompt")
                out[key] = value
            else:  # a numeric option of OPTION_BOUNDS, or refused naming the keys wan takes
                out[key] = check_option(self.name, p, key, value, out, OPTION_BOUNDS)
        return out

    def modules(self, preset: FamilyPreset, checkpoint: Path | None, *, device: str = "cpu",
                seed: int = 0) -> dict[str, Module]:
        from pipeline.families.wan.family import family_modules

        return family_modules(_wan(preset), checkpoint, device=device, seed=seed)

    def stages(self, preset: FamilyPreset, modules: Mapping[str, Module], timings: Timings) -> list[Stage]:
        from pipeline.families.wan.family import family_stages

        return family_stages(_wan(preset), modules, timings)


def _wan(preset: FamilyPreset) -> WanPreset:
    if not isinstance(preset, WanPreset):
        raise TypeError(f"the wan family takes a WanPreset, got {type(preset).__name__}")
    return preset
