"""The tiny family's wiring: the reference models (``models/``) as modules, and the four stages.

Who calls what: :class:`~pipeline.families.tiny.TinyFamily` delegates here (imported on first use,
so the family registry stays free of torch). :func:`family_modules` is the one place that says how
each model of a preset is made: ``models.checkpoint.build_module`` (seeded random init, the very
builder training starts from), then the checkpoint's tensors under ``"<name>."``. The in-process
render builds through it lazily; a NodeEngine rank (``family_loaders``) builds the same weights
through it, shards the large ones and hands them back as ``FamilyRuntime(..., loaded=ctx.modules)``,
so a sharded render computes with exactly the parameters of the single-process one.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

from models.checkpoint import build_module, module_factories
from models.presets import ModelPreset
from pipeline.families.tiny.stages.a2v import A2VStage
from pipeline.families.tiny.stages.context import ContextStage
from pipeline.families.tiny.stages.decode import DecodeStage
from pipeline.families.tiny.stages.super_resolution import SRStage
from pipeline.module import Module
from pipeline.stage import Stage
from pipeline.stage_common import Timings


def family_modules(p: ModelPreset, checkpoint: Path | None, *, device: str = "cpu", seed: int = 0
                   ) -> dict[str, Module]:
    """One unloaded :class:`Module` per model of ``p`` ("vae", "audio", "a2v", "sr" and "text" if any):
    ``build_module(p, name, seed)``, then ``checkpoint`` (keys prefixed ``"<name>."``) when given.
    Nothing is built until ``Module.get()``."""
    return {
        name: Module(name, functools.partial(build_module, p, name, seed), checkpoint=checkpoint,
                     prefix=f"{name}.", device=device)
        for name in module_factories(p)
    }


def family_stages(p: ModelPreset, modules: Mapping[str, Module], timings: Timings) -> list[Stage]:
    """Context → A2V (per step), SR → decode (per emission), over ``modules``. The request's options
    (``TinyFamily.options``: audio guidance, sampler steps) reach the context and A2V stages through
    ``pipeline.ports.OPTIONS`` at run time, so one warm pipeline serves every request of the preset."""
    return [
        ContextStage(modules["vae"], modules["audio"], modules.get("text"), fps=p.fps,
                     sample_rate=p.sample_rate, latent_channels=p.latent_channels,
                     lr_latent_hw=p.lr_latent_hw, timings=timings),
        A2VStage(modules["a2v"], timings=timings, shift=p.shift, guidance_focus=p.audio_guidance_focus),
        SRStage(modules["sr"], timings=timings),
        DecodeStage(modules["vae"], timings=timings),
    ]
