"""The reference avatar model family wired into the framework: modules, stages, pipeline.

``AvatarFamily`` builds one :class:`~pipeline.module.Module` per model of a preset (lazily loaded,
from the checkpoint when there is one, else a seeded random init) and the four stages over them. A
process keeps its families warm between renders (:func:`get_family`), so a worker pays for model
loading once.

Who builds the models: :func:`family_modules`, the one place that says how each model of a preset is
made (factory, random-init seed, checkpoint prefix). The single-process family uses it lazily; a
NodeEngine rank (``pipeline.placement.loaders.family_loaders``) uses it to build the same weights,
shards the large ones and hands them back as ``AvatarFamily(..., loaded=ctx.modules)``, so a sharded
render computes with exactly the parameters of the single-process one.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from models.audio import AudioEncoder
from models.dit import A2VDiT
from models.presets import ModelPreset, get_preset
from models.sampler import FlowMatchEulerSampler
from models.sr import SRDiT
from models.text import TextEncoder
from models.vae import CausalVAE
from pipeline.errors import InvalidInputError, ModuleLoadError
from pipeline.module import Module
from pipeline.pipeline import Pipeline
from pipeline.families.tiny.stages.a2v import A2VStage
from pipeline.stage_common import Timings
from pipeline.families.tiny.stages.context import ContextStage
from pipeline.families.tiny.stages.decode import DecodeStage
from pipeline.families.tiny.stages.super_resolution import SRStage

CHECKPOINT_DIR = Path(__file__).resolve().parent.parent / "models" / "checkpoints"
RANDOM_INIT_SEED = 20261129


def default_checkpoint(preset: str) -> Path | None:
    """The checkpoint shipped with the repository for ``preset``, if any."""
    path = CHECKPOINT_DIR / f"{preset}.safetensors"
    return path if path.is_file() else None


def _seeded(factory: Callable[[], nn.Module], seed: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return factory()

    return build


def _factories(p: ModelPreset) -> dict[str, Callable[[], nn.Module]]:
    # The order fixes each module's random-init seed (RANDOM_INIT_SEED + position): append only.
    factories: dict[str, Callable[[], nn.Module]] = {
        "vae": lambda: CausalVAE(p.vae),
        "audio": lambda: AudioEncoder(p.audio),
        "a2v": lambda: A2VDiT(p.dit),
        "sr": lambda: SRDiT(p.sr),
    }
    if p.text is not None:
        text_cfg = p.text
        factories["text"] = lambda: TextEncoder(text_cfg)
    return factories


def family_module_names(preset: ModelPreset) -> tuple[str, ...]:
    """The models a family of ``preset`` uses ("vae", "audio", "a2v", "sr" and "text" if any)."""
    return tuple(_factories(preset))


def family_modules(preset: ModelPreset, checkpoint: Path | None, *, device: str = "cpu") -> dict[str, Module]:
    """One unloaded :class:`Module` per model of ``preset``: seeded random init, then ``checkpoint``
    (keys prefixed ``"<name>."``) when given. Nothing is built until ``Module.get()``; every caller
    that builds a preset's models goes through here, so they all get the same weights."""
    return {
        name: Module(name, _seeded(f, RANDOM_INIT_SEED + i), checkpoint=checkpoint, prefix=f"{name}.",
                     device=device)
        for i, (name, f) in enumerate(_factories(preset).items())
    }


class AvatarFamily:
    """The modules, sampler, stages and pipeline of one preset; one render at a time uses it.

    ``loaded``: models the caller already holds (a NodeEngine rank's ``ctx.modules``, some of them
    FSDP2-sharded), built by :func:`family_modules` (through ``family_loaders``) so they carry the
    same weights; the family then builds nothing. ``on_use(name)`` runs each time a stage takes
    model ``name`` (``Module.get``), just before its forward: a rank passes its parker's
    ``activate`` so the stage's model is brought back and the others parked.
    """

    def __init__(
        self,
        preset: ModelPreset,
        checkpoint: Path | None,
        *,
        device: str = "cpu",
        loaded: Mapping[str, nn.Module] | None = None,
        on_use: Callable[[str], None] | None = None,
    ) -> None:
        self.preset = preset
        self.checkpoint = checkpoint
        p = preset
        if loaded is None:
            self.modules = family_modules(p, checkpoint, device=device)
            if on_use is not None:
                for name, module in self.modules.items():
                    module.on_use = functools.partial(on_use, name)
        else:
            names = family_module_names(p)
            missing = [n for n in names if n not in loaded]
            if missing:
                raise ModuleLoadError(
                    f"preset {p.name!r}: loaded modules lack {missing} (have {sorted(loaded)}); load every "
                    f"module of the family ({list(names)}), e.g. family_loaders({p.name!r}, {list(names)})"
                )
            self.modules = {
                n: Module.from_loaded(n, loaded[n], checkpoint=checkpoint,
                                      on_use=functools.partial(on_use, n) if on_use is not None else None)
                for n in names
            }
        # SR + decode of one emission overlap the next step on a second core (Pipeline.run); not
        # over a rank's loaded modules: sharded forwards issue collectives that every rank must run
        # in the same order, and on_use parks models as each stage takes its turn
        self.overlap_emissions = loaded is None and on_use is None
        self.timings = Timings()
        self.sampler = FlowMatchEulerSampler(p.num_steps, p.shift)
        self.pipeline = Pipeline(
            [
                ContextStage(self.modules["vae"], self.modules["audio"], self.modules.get("text"), fps=p.fps,
                             sample_rate=p.sample_rate, latent_channels=p.latent_channels,
                             lr_latent_hw=p.lr_latent_hw, timings=self.timings,
                             silence_features=p.audio_guidance != 1.0),
                A2VStage(self.modules["a2v"], self.sampler, timings=self.timings, audio_guidance=p.audio_guidance),
                SRStage(self.modules["sr"], timings=self.timings),
                DecodeStage(self.modules["vae"], timings=self.timings),
            ],
            timings=self.timings,
        )

    @property
    def is_random_init(self) -> bool:
        return self.checkpoint is None


_families: dict[tuple[str, str, str], AvatarFamily] = {}
_lock = threading.Lock()


def resolve_preset(name: str) -> ModelPreset:
    try:
        return get_preset(name)
    except (KeyError, ValueError) as exc:
        raise InvalidInputError(f"preset {name!r} is unknown: {exc}", field="preset") from exc


def get_family(preset: str, checkpoint: Path | None = None, *, device: str = "cpu") -> AvatarFamily:
    """The warm family for (preset, checkpoint, device), built on first use in this process."""
    ckpt = checkpoint if checkpoint is not None else default_checkpoint(preset)
    key = (preset, str(ckpt), device)
    with _lock:
        family = _families.get(key)
        if family is None:
            family = AvatarFamily(resolve_preset(preset), ckpt, device=device)
            _families[key] = family
        return family
