"""Helpers that write tiny Wan releases in the public layouts, on random weights (no download).
Imported by tests/wan/conftest.py and the tests (pytest puts this folder on sys.path)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from models.wan.config import WanDiTConfig
from models.wan.dit import WanAvatarDiT

AUDIO_MARKERS = ("audio_proj.", ".audio_cross_attn.", ".norm_x.")


def random_dit_state(cfg: WanDiTConfig, seed: int = 0) -> dict[str, Tensor]:
    """Original-key state dict with every tensor random (norm weights too, so the test sees them)."""
    torch.manual_seed(seed)
    model = WanAvatarDiT(cfg)
    out = {}
    for k, v in model.state_dict().items():
        scale = 0.5 if v.ndim < 2 else 1.0 / max(1.0, v[0].numel()) ** 0.5
        base = 1.0 if k.endswith("weight") and v.ndim == 1 else 0.0
        out[k] = (base + scale * torch.randn(v.shape)).contiguous()
    return out


def is_audio_key(key: str) -> bool:
    return any(m in key for m in AUDIO_MARKERS)


def wan_config_json(cfg: WanDiTConfig) -> dict[str, object]:
    """The original Wan ``config.json`` fields, plus the non-default tiny fields."""
    raw: dict[str, object] = {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "model_type": "i2v"}
    default = WanDiTConfig()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in (
            "dim",
            "eps",
            "ffn_dim",
            "freq_dim",
            "in_dim",
            "num_heads",
            "num_layers",
            "out_dim",
            "text_len",
        ):
            raw[f.name] = value
        elif value != getattr(default, f.name):
            raw[f.name] = list(value) if isinstance(value, tuple) else value
    return raw


def write_sharded(
    folder: Path, state: dict[str, Tensor], num_shards: int, stem: str = "diffusion_pytorch_model"
) -> None:
    """``{stem}-0000N-of-0000M.safetensors`` + ``{stem}.safetensors.index.json``, as the Wan-AI repos."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(num_shards):
        name = f"{stem}-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::num_shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
