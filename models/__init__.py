"""The reference model family: plain ``nn.Module``s with no framework code (see docs/models.md).

Import the classes from their modules (``models.dit.A2VDiT`` …) or from here.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP workers sleep instead of spinning. Inference shares the
# cores with the publisher thread (encoding, uploads) and, on shared machines, other processes;
# spinning workers starved them (measured 4x slower renders on a loaded 2-core machine). An explicit
# OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from models.audio import AudioEncoder
from models.checkpoint import CheckpointError, build_modules, load_checkpoint, save_checkpoint
from models.dit import A2VDiT
from models.presets import (
    PRESETS,
    AudioConfig,
    DiTConfig,
    ModelPreset,
    SRConfig,
    TextConfig,
    VAEConfig,
    get_preset,
)
from models.sampler import FlowMatchEulerSampler
from models.sr import SRDiT
from models.text import TextEncoder
from models.vae import CausalVAE

__all__ = [
    "PRESETS",
    "A2VDiT",
    "AudioConfig",
    "AudioEncoder",
    "CausalVAE",
    "CheckpointError",
    "DiTConfig",
    "FlowMatchEulerSampler",
    "ModelPreset",
    "SRConfig",
    "SRDiT",
    "TextConfig",
    "TextEncoder",
    "VAEConfig",
    "build_modules",
    "get_preset",
    "load_checkpoint",
    "save_checkpoint",
]
