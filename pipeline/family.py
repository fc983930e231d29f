"""The reference avatar model family wired into the framework: modules, stages, pipeline.

``AvatarFamily`` builds one :class:`~pipeline.module.Module` per model of a preset (lazily loaded,
from the checkpoint when there is one, else a seeded random init) and the four stages over them. A
process keeps its families warm between renders (:func:`get_family`), so a worker pays for model
loading once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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
from pipeline.errors import InvalidInputError
from pipeline.module import Module
from pipeline.pipeline import Pipeline
from pipeline.stages.a2v import A2VStage
from pipeline.stages.common import Timings
from pipeline.stages.context import ContextStage
from pipeline.stages.decode import DecodeStage
from pipeline.stages.super_resolution import SRStage

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


class AvatarFamily:
    def __init__(self, preset: ModelPreset, checkpoint: Path | None, *, device: str = "cpu") -> None:
        self.preset = preset
        self.checkpoint = checkpoint
        p = preset
        factories: dict[str, Callable[[], nn.Module]] = {
            "vae": lambda: CausalVAE(p.vae),
            "audio": lambda: AudioEncoder(p.audio),
            "a2v": lambda: A2VDiT(p.dit),
            "sr": lambda: SRDiT(p.sr),
        }
        if p.text is not None:
            text_cfg = p.text
            factories["text"] = lambda: TextEncoder(text_cfg)
        self.modules = {
            name: Module(name, _seeded(f, RANDOM_INIT_SEED + i), checkpoint=checkpoint, prefix=f"{name}.",
                         device=device)
            for i, (name, f) in enumerate(factories.items())
        }
        self.timings = Timings()
        self.sampler = FlowMatchEulerSampler(p.num_steps, p.shift)
        self.pipeline = Pipeline(
            [
                ContextStage(self.modules["vae"], self.modules["audio"], self.modules.get("text"), fps=p.fps,
                             sample_rate=p.sample_rate, latent_channels=p.latent_channels,
                             lr_latent_hw=p.lr_latent_hw, timings=self.timings),
                A2VStage(self.modules["a2v"], self.sampler, timings=self.timings),
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
