"""Shapes of the Wan2.1-I2V DiT with the InfiniteTalk / MultiTalk audio additions.

Who calls what: :func:`models.wan.release` reads a release's ``config.json`` into a :class:`WanDiTConfig`
(:meth:`WanDiTConfig.from_wan_json`); tests and one-GPU measurements use :func:`dit_preset`. Field names
follow the original Wan ``config.json`` (``dim``, ``ffn_dim``, ``in_dim`` ...) so a release's file maps
one to one; the audio fields follow the defaults of ``WanModel.__init__`` in MeiGen-AI/InfiniteTalk
``wan/modules/multitalk_model.py`` (the release's ``config.json`` does not carry them).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# InfiniteTalk's ``WanModel.__init__`` argument names → ours (a FlashTalk config.json may carry them).
_UPSTREAM_AUDIO_NAMES = {
    "intermediate_dim": "audio_intermediate_dim",
    "output_dim": "audio_output_dim",
    "context_tokens": "audio_context_tokens",
}


@dataclass(frozen=True)
class WanDiTConfig:
    """One DiT shape. Defaults = the public Wan2.1-I2V-14B-480P + InfiniteTalk config."""

    dim: int = 5120
    ffn_dim: int = 13824
    num_heads: int = 40
    num_layers: int = 40
    in_dim: int = 36  # 16 noise + 4 mask + 16 known-frame latents (I2V conditioning)
    out_dim: int = 16
    freq_dim: int = 256
    text_dim: int = 4096  # umT5-XXL hidden size
    text_len: int = 512  # umT5 context is zero-padded to this many tokens
    image_dim: int = 1280  # CLIP ViT-H/14 width
    patch_size: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6
    cross_attn_norm: bool = True
    qk_norm: bool = True
    # audio (InfiniteTalk / MultiTalk)
    audio_window: int = 5  # wav2vec2 frames around each video frame
    audio_layers: int = 12  # wav2vec2 hidden states stacked (chinese-wav2vec2-base: 12 layers)
    audio_channels: int = 768  # wav2vec2 hidden size
    audio_intermediate_dim: int = 512
    audio_output_dim: int = 768
    audio_context_tokens: int = 32  # audio tokens per latent frame
    vae_scale: int = 4  # video frames per latent frame (after the first)
    norm_input_visual: bool = True
    norm_output_audio: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"WanDiTConfig.dim={self.dim} is not divisible by num_heads={self.num_heads}")
        if (self.dim // self.num_heads) % 2:
            raise ValueError(
                f"WanDiTConfig head dim {self.dim // self.num_heads} must be even (rotary pairs)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @classmethod
    def from_wan_json(cls, path: Path, **overrides: Any) -> WanDiTConfig:
        """Read an original Wan/InfiniteTalk ``config.json``; unknown keys are ignored (``_class_name``...)."""
        raw = json.loads(Path(path).read_text())
        if raw.get("model_type", "i2v") != "i2v":
            raise ValueError(
                f"{path}: model_type={raw.get('model_type')!r}; the avatar DiT needs an image-to-video "
                "release (Wan2.1-I2V-14B-480P or -720P), not a text-to-video one"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        raw = {_UPSTREAM_AUDIO_NAMES.get(k, k): v for k, v in raw.items()}
        values: dict[str, Any] = {k: v for k, v in raw.items() if k in names}
        if "patch_size" in values:
            values["patch_size"] = tuple(values["patch_size"])
        values.update(overrides)
        return cls(**values)


def dit_preset(name: str) -> WanDiTConfig:
    """``14b`` = the public config; ``1.3b`` = same layout at Wan2.1-1.3B width (random init, one-GPU
    measurement); ``tiny`` = CPU tests."""
    if name == "14b":
        return WanDiTConfig()
    if name == "1.3b":
        return WanDiTConfig(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30)
    if name == "tiny":
        return WanDiTConfig(
            dim=32,
            ffn_dim=64,
            num_heads=2,
            num_layers=2,
            freq_dim=32,
            text_dim=24,
            text_len=512,
            image_dim=40,
            audio_window=5,
            audio_layers=3,
            audio_channels=16,
            audio_intermediate_dim=32,
            audio_output_dim=24,
            audio_context_tokens=4,
        )
    raise ValueError(f"unknown Wan DiT preset {name!r}; use one of '14b', '1.3b', 'tiny'")


# component shapes of the tiny release (models.wan.tiny_release); the DiT's is dit_preset("tiny") (text_dim 24, image_dim 40,
# 3 wav2vec2 layers of 16 channels)
TINY_SHAPES: dict[str, dict[str, object]] = {
    "vae": {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2},
    "t5": {"vocab_size": 64, "d_model": 24, "d_kv": 4, "d_ff": 32, "num_layers": 2, "num_heads": 4},
    "clip": {"hidden_size": 40, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
             "image_size": 28, "patch_size": 14},
    "audio": {"hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 32,
              "conv_dim": [8] * 7, "conv_kernel": [10, 3, 3, 3, 3, 2, 2], "conv_stride": [5, 2, 2, 2, 2, 2, 2],
              "feat_extract_norm": "group", "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2,
              "do_stable_layer_norm": False},
}  # fmt: skip
