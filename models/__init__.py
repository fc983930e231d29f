"""The reference model family: plain ``nn.Module``s with no framework code (see docs/models.md)."""

from __future__ import annotations

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

__all__ = ["PRESETS", "AudioConfig", "DiTConfig", "ModelPreset", "SRConfig", "TextConfig", "VAEConfig", "get_preset"]
