"""umT5-XXL text encoder (transformers ``UMT5EncoderModel``) loaded from Wan's
``models_t5_umt5-xxl-enc-bf16.pth``.

The public Wan release ships the encoder as a plain state dict with Wan's own key names
(Wan-Video/Wan2.1 ``wan/modules/t5.py``: ``T5Encoder`` with ``token_embedding``, ``blocks.N.norm1``,
``blocks.N.attn.{q,k,v,o}``, ``blocks.N.pos_embedding.embedding`` — one relative bias per layer,
``shared_pos=False`` — ``blocks.N.norm2``, ``blocks.N.ffn.{gate.0,fc1,fc2}``, ``norm``).
:func:`umt5_key` maps them one to one onto transformers' names. Wan's config ``umt5_xxl``: vocab
256384, dim 4096, ffn 10240, 64 heads, 24 layers, 32 buckets, gated tanh-GELU.

Who calls what: a family's setup stage calls :meth:`WanTextEncoder.encode` once per job (and once for
the negative prompt), then parks the module; the DiT pads the trimmed states back to 512 tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import UMT5Config, UMT5EncoderModel

from models.wan.checkpoint import WanCheckpointError, fill_module, read_pth, state_dict_entries

T5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"
UMT5_XXL = {
    "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
    "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip

_BLOCK = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}


def umt5_key(key: str) -> str | None:
    """Wan ``t5.py`` encoder key → transformers ``UMT5EncoderModel`` key (None: not an encoder key)."""
    if key == "token_embedding.weight":
        return "shared.weight"
    if key == "norm.weight":
        return "encoder.final_layer_norm.weight"
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", key)
    if m and m[2] in _BLOCK:
        return f"encoder.block.{m[1]}.{_BLOCK[m[2]]}"
    return None


class WanTextEncoder(nn.Module):
    def __init__(self, model: UMT5EncoderModel) -> None:
        super().__init__()
        self.model = model

    @torch.no_grad()
    def encode(self, ids_BL: Tensor, mask_BL: Tensor) -> list[Tensor]:
        """Token ids + attention mask (from the ``google/umt5-xxl`` tokenizer, padded to 512) → per
        prompt the states of its real tokens ``[L_i, 4096]`` (Wan trims at the mask, then zero-pads)."""
        out = self.model(input_ids=ids_BL, attention_mask=mask_BL).last_hidden_state
        lens = mask_BL.gt(0).sum(dim=1).tolist()
        return [u[:n] for u, n in zip(out, lens, strict=True)]


def load_umt5(
    path: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    config: dict[str, object] | None = None,
) -> WanTextEncoder:
    """Load Wan's umT5 ``.pth`` strictly into ``UMT5EncoderModel`` (``config`` overrides the XXL shape)."""
    path, state = read_pth(path, T5_FILE)
    unknown = [k for k in state if umt5_key(k) is None]
    if unknown:
        raise WanCheckpointError(
            f"{path}: keys that are not Wan's umT5 encoder layout: {', '.join(sorted(unknown)[:5])}; "
            f"expected {T5_FILE} from the Wan2.1 release (token_embedding, blocks.N.*, norm)"
        )
    entries = state_dict_entries({umt5_key(k): v for k, v in state.items()}, path)  # type: ignore[misc]
    with torch.device("meta"):
        model = UMT5EncoderModel(UMT5Config(**{**UMT5_XXL, **(config or {})}))
    # encoder.embed_tokens is tied to shared: fill once, then re-tie
    model.encoder.embed_tokens = None  # type: ignore[assignment]
    fill_module(model, entries, dtype=dtype, device=device, what=f"umT5-XXL encoder ({T5_FILE})")
    model.encoder.embed_tokens = model.shared
    return WanTextEncoder(model.eval().requires_grad_(False))
