"""Tiny Wan releases written in the public layouts, on random weights (no download)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor
from wan_fixtures import is_audio_key, random_dit_state, wan_config_json, write_sharded

from models.wan.config import WanDiTConfig, dit_preset


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def tiny_cfg() -> WanDiTConfig:
    return dit_preset("tiny")


@pytest.fixture
def infinitetalk_release(
    tmp_path: Path, tiny_cfg: WanDiTConfig
) -> Callable[..., tuple[Path, Path, dict[str, Tensor]]]:
    """Write ``Wan2.1-I2V-14B-480P/`` (base DiT, 3 shards + index, no audio keys) and
    ``InfiniteTalk/single/infinitetalk.safetensors`` (the audio keys). Returns the two paths + state."""

    def make(
        dtype: torch.dtype = torch.float32, mutate: Callable[[dict[str, Tensor]], None] | None = None
    ) -> tuple[Path, Path, dict[str, Tensor]]:
        state = random_dit_state(tiny_cfg)
        if mutate is not None:
            mutate(state)
        state = {k: v.to(dtype) for k, v in state.items()}
        wan = tmp_path / "Wan2.1-I2V-14B-480P"
        write_sharded(wan, {k: v for k, v in state.items() if not is_audio_key(k)}, num_shards=3)
        (wan / "config.json").write_text(json.dumps(wan_config_json(tiny_cfg)))
        it = tmp_path / "InfiniteTalk" / "single" / "infinitetalk.safetensors"
        it.parent.mkdir(parents=True)
        save_file({k: v for k, v in state.items() if is_audio_key(k)}, str(it), metadata={"format": "pt"})
        return wan, it, state

    return make
