"""Tiny Wan releases in the exact public layouts, on seeded random weights (no download).

Who calls this: the tests (``tests/wan``), ``bench.peer`` and anyone trying the ``wan`` family on a
CPU. :func:`write_tiny_infinitetalk` writes the three folders an InfiniteTalk user downloads (see
docs/wan.md): ``Wan2.1-I2V-14B-480P/`` (config.json, sharded DiT without the audio layers + index,
``Wan2.1_VAE.pth``, the umT5 and CLIP ``.pth`` files in Wan's own key names, a ``google/umt5-xxl``
tokenizer folder), ``InfiniteTalk/single/infinitetalk.safetensors`` (the audio layers) and
``chinese-wav2vec2-base/`` (config.json + model.safetensors) — at the shapes of :data:`TINY_SHAPES`
and ``dit_preset("tiny")``. The writers invert the loaders' key mappings (diffusers' VAE converter,
``umt5_key``, ``clip_entries``); the tests check each round trip.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from models.wan.config import TINY_SHAPES, WanDiTConfig, dit_preset
from models.wan.dit import WanAvatarDiT

AUDIO_MARKERS = ("audio_proj.", ".audio_cross_attn.", ".norm_x.")



def random_dit_state(cfg: WanDiTConfig, seed: int = 0) -> dict[str, Tensor]:
    """Original-key state dict with every tensor random (norm weights too, so the tests see them)."""
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
    always = ("dim", "eps", "ffn_dim", "freq_dim", "in_dim", "num_heads", "num_layers", "out_dim", "text_len")
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in always:
            raw[f.name] = value
        elif value != getattr(default, f.name):
            raw[f.name] = list(value) if isinstance(value, tuple) else value
    return raw


def write_sharded(folder: Path, state: dict[str, Tensor], num_shards: int, stem: str = "diffusion_pytorch_model") -> None:
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


_RES = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
        "conv2": "residual.6", "conv_shortcut": "shortcut"}  # fmt: skip


def vae_original_key(key: str) -> str:
    """diffusers ``AutoencoderKLWan`` key → the original Wan ``vae.py`` key (the inverse of diffusers'
    ``convert_wan_vae_to_diffusers``; tests/wan/test_wan_vae.py checks the round trip)."""
    top = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
    head, _, leaf = key.rpartition(".")
    if head in top:
        return f"{top[head]}.{leaf}"
    side, rest = key.split(".", 1)
    rest = rest.replace("conv_in.", "conv1.").replace("norm_out.", "head.0.").replace("conv_out.", "head.2.")
    m = re.match(r"mid_block\.(resnets|attentions)\.(\d)\.(.*)", rest)
    if m:
        idx = {"resnets": {"0": 0, "1": 2}, "attentions": {"0": 1}}[m[1]][m[2]]
        rest = f"middle.{idx}.{m[3]}"
    m = re.match(r"down_blocks\.(\d+)\.(.*)", rest)
    if m:
        rest = f"downsamples.{m[1]}.{m[2]}"
    m = re.match(r"up_blocks\.(\d)\.(resnets\.(\d)|upsamplers\.0)\.(.*)", rest)
    if m:
        rest = f"upsamples.{4 * int(m[1]) + (int(m[3]) if m[3] else 3)}.{m[4]}"
    for new, old in _RES.items():
        rest = re.sub(rf"(\.\d+\.){re.escape(new)}(\.|$)", rf"\g<1>{old}\2", rest)
    return f"{side}.{rest}"


def wan_t5_keys(num_layers: int) -> list[str]:
    """Every key of Wan's ``T5Encoder`` (``shared_pos=False``) state dict."""
    per = ["norm1.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight",
           "pos_embedding.embedding.weight", "norm2.weight", "ffn.gate.0.weight", "ffn.fc1.weight", "ffn.fc2.weight"]  # fmt: skip
    return ["token_embedding.weight", "norm.weight"] + [f"blocks.{i}.{p}" for i in range(num_layers) for p in per]


_CLIP_LAYER = {"layer_norm1": "norm1", "self_attn.out_proj": "attn.proj", "layer_norm2": "norm2",
               "mlp.fc1": "mlp.0", "mlp.fc2": "mlp.2"}  # fmt: skip


def clip_original_state(hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers ``CLIPVisionModel`` state → Wan's ``visual.*`` keys (q/k/v fused into ``to_qkv``)."""
    out: dict[str, Tensor] = {}
    e = "embeddings."
    out["visual.patch_embedding.weight"] = hf[e + "patch_embedding.weight"]
    out["visual.cls_embedding"] = hf[e + "class_embedding"].reshape(1, 1, -1)
    out["visual.pos_embedding"] = hf[e + "position_embedding.weight"][None]
    for ours, theirs in (("pre_norm", "pre_layrnorm"), ("post_norm", "post_layernorm")):
        for leaf in ("weight", "bias"):
            out[f"visual.{ours}.{leaf}"] = hf[f"{theirs}.{leaf}"]
    layers = {int(m[1]) for k in hf if (m := re.match(r"encoder\.layers\.(\d+)\.", k))}
    for i in sorted(layers):
        p = f"encoder.layers.{i}."
        for leaf in ("weight", "bias"):
            out[f"visual.transformer.{i}.attn.to_qkv.{leaf}"] = torch.cat(
                [hf[f"{p}self_attn.{x}_proj.{leaf}"] for x in "qkv"])
            for theirs, ours in _CLIP_LAYER.items():
                out[f"visual.transformer.{i}.{ours}.{leaf}"] = hf[f"{p}{theirs}.{leaf}"]
    return out


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` ids (pad 0, eos 1, unk 2) in the layout
    ``AutoTokenizer.from_pretrained`` reads (stands in for ``google/umt5-xxl``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(folder))


def write_tiny_infinitetalk(root: Path, seed: int = 0) -> Path:
    """Write a tiny InfiniteTalk download under ``root`` (the folder ``longtake render --family wan
    --weights`` takes) and return ``root``."""
    from diffusers import AutoencoderKLWan
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        UMT5Config,
        UMT5EncoderModel,
        Wav2Vec2Config,
        Wav2Vec2Model,
    )

    from models.wan.clip import VIT_H_14
    from models.wan.text import UMT5_XXL, umt5_key

    root = Path(root)
    cfg = dit_preset("tiny")
    state = random_dit_state(cfg, seed)
    wan = root / "Wan2.1-I2V-14B-480P"
    write_sharded(wan, {k: v for k, v in state.items() if not is_audio_key(k)}, num_shards=3)
    (wan / "config.json").write_text(json.dumps(wan_config_json(cfg)))
    overlay = root / "InfiniteTalk" / "single" / "infinitetalk.safetensors"
    overlay.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v for k, v in state.items() if is_audio_key(k)}, str(overlay), metadata={"format": "pt"})

    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(**TINY_SHAPES["vae"])  # type: ignore[arg-type]
    torch.save({vae_original_key(k): v for k, v in vae.state_dict().items()}, wan / "Wan2.1_VAE.pth")
    t5_shape = TINY_SHAPES["t5"]
    t5 = UMT5EncoderModel(UMT5Config(**{**UMT5_XXL, **t5_shape}))
    hf = t5.state_dict()
    torch.save({k: hf[umt5_key(k)].to(torch.bfloat16) for k in wan_t5_keys(int(t5_shape["num_layers"]))},  # type: ignore[call-overload]
               wan / "models_t5_umt5-xxl-enc-bf16.pth")
    write_tokenizer(wan / "google" / "umt5-xxl", int(t5_shape["vocab_size"]))  # type: ignore[call-overload]
    clip = CLIPVisionModel(CLIPVisionConfig(**{**VIT_H_14, **TINY_SHAPES["clip"]}))
    torch.save(clip_original_state(clip.state_dict()), wan / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth")
    (wan / "xlm-roberta-large").mkdir(exist_ok=True)
    Wav2Vec2Model(Wav2Vec2Config(**TINY_SHAPES["audio"])).save_pretrained(str(root / "chinese-wav2vec2-base"))
    return root
