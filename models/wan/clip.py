"""CLIP ViT-H/14 vision tower (transformers ``CLIPVisionModel``) loaded from Wan's
``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``.

The public file is the whole XLM-RoBERTa CLIP of Wan-Video/Wan2.1 ``wan/modules/clip.py`` (keys
``visual.*`` and ``textual.*``); only ``visual.*`` is used: ``patch_embedding`` (no bias, pre-norm),
``cls_embedding``, ``pos_embedding`` (257 positions), ``pre_norm``, ``transformer.N.{norm1, attn.to_qkv,
attn.proj, norm2, mlp.0, mlp.2}``, ``post_norm``, ``head``. Wan's I2V model reads the output of the
first 31 of 32 blocks (``use_31_block=True``) = transformers' ``hidden_states[-2]``: 257 tokens × 1280.

Who calls what: a family's setup stage calls :meth:`WanImageEncoder.encode` once per job on the
reference image, then parks the module.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import CLIPVisionConfig, CLIPVisionModel

from models.wan.checkpoint import Entry, WanCheckpointError, constant, fill_module, read_pth

CLIP_FILE = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
VIT_H_14 = {
    "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
    "image_size": 224, "patch_size": 14, "hidden_act": "gelu", "layer_norm_eps": 1e-5, "projection_dim": 1024,
}  # fmt: skip
MEAN = (0.48145466, 0.4578275, 0.40821073)  # open_clip / OpenAI normalisation, as Wan's transforms
STD = (0.26862954, 0.26130258, 0.27577711)

_LAYER = {"norm1": "layer_norm1", "attn.proj": "self_attn.out_proj", "norm2": "layer_norm2",
          "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2"}  # fmt: skip


def clip_entries(state: dict[str, Tensor], path: Path) -> dict[str, Entry]:
    """Wan ``visual.*`` tensors → transformers ``CLIPVisionModel`` entries (``to_qkv`` split q, k, v)."""
    out: dict[str, Entry] = {}

    def put(key: str, t: Tensor) -> None:
        out[key] = Entry(path, tuple(t.shape), t.dtype, constant(t))

    for k, v in state.items():
        if not k.startswith("visual.") or k == "visual.head":
            continue  # the text tower and the projection head are not used by the I2V model
        name = k.removeprefix("visual.")
        emb = "embeddings."
        if name == "patch_embedding.weight":
            put(emb + "patch_embedding.weight", v)
        elif name == "cls_embedding":
            put(emb + "class_embedding", v.reshape(-1))
        elif name == "pos_embedding":
            put(emb + "position_embedding.weight", v.reshape(v.shape[-2], v.shape[-1]))
        elif m := re.fullmatch(r"(pre_norm|post_norm)\.(weight|bias)", name):
            put(f"{'pre_layrnorm' if m[1] == 'pre_norm' else 'post_layernorm'}.{m[2]}", v)
        elif m := re.fullmatch(r"transformer\.(\d+)\.attn\.to_qkv\.(weight|bias)", name):
            for part, t in zip("qkv", v.chunk(3, dim=0), strict=True):
                put(f"encoder.layers.{m[1]}.self_attn.{part}_proj.{m[2]}", t)
        elif (m := re.fullmatch(r"transformer\.(\d+)\.(.+)\.(weight|bias)", name)) and m[2] in _LAYER:
            put(f"encoder.layers.{m[1]}.{_LAYER[m[2]]}.{m[3]}", v)
        else:
            raise WanCheckpointError(f"{path}: {k} is not in Wan's CLIP ViT-H/14 visual layout ({CLIP_FILE})")
    return out


class WanImageEncoder(nn.Module):
    def __init__(self, model: CLIPVisionModel) -> None:
        super().__init__()
        self.model = model

    @torch.no_grad()
    def encode(self, image_B3HW: Tensor) -> Tensor:
        """Reference image(s) in [-1, 1] → ``[B, 257, 1280]`` (penultimate block, as Wan's I2V reads)."""
        size = int(self.model.config.image_size)
        x = F.interpolate(image_B3HW.float(), size=(size, size), mode="bicubic", align_corners=False)
        mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
        x = ((x * 0.5 + 0.5) - mean) / std
        out = self.model(pixel_values=x.to(self.model.dtype), output_hidden_states=True)
        return out.hidden_states[-2]


def load_clip_vision(
    path: Path,
    *,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
    config: dict[str, object] | None = None,
) -> WanImageEncoder:
    """Load the visual tower of Wan's CLIP ``.pth`` strictly (``config`` overrides the ViT-H/14 shape)."""
    path, state = read_pth(path, CLIP_FILE)
    entries = clip_entries(state, path)
    with torch.device("meta"):
        model = CLIPVisionModel(CLIPVisionConfig(**{**VIT_H_14, **(config or {})}))
    # position_ids is a non-persistent buffer in the checkpoint's absence: fill it here
    n_pos = model.embeddings.num_positions
    entries["embeddings.position_ids"] = Entry(
        path, (1, n_pos), torch.int64, constant(torch.arange(n_pos)[None])
    )
    fill_module(model, entries, dtype=dtype, device=device, what=f"CLIP ViT-H/14 visual tower ({CLIP_FILE})")
    return WanImageEncoder(model.eval().requires_grad_(False))
