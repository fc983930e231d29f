"""Byte-level text encoder: UTF-8 bytes -> embeddings -> a small transformer. No tokenizer, no downloads.

Who calls it: the pipeline once per job (the text prompt is job-scoped conditioning); the A2V DiT
attends to the tokens it returns. A BOS token is always present and valid, so an empty prompt gives one
valid token and attention never sees an all-masked row. Text longer than ``max_length - 1`` bytes is
truncated here; the pipeline validates the length earlier and tells the user.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.layers import TransformerBlock, rope_angles
from models.presets import TextConfig

_BOS = 256
_PAD = 257


class TextEncoder(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(258, cfg.dim)
        self.blocks = nn.ModuleList(
            [
                TransformerBlock(cfg.dim, cfg.num_heads, cfg.ffn_dim, cross=False)
                for _ in range(cfg.num_layers)
            ]
        )
        self.norm_out = nn.LayerNorm(cfg.dim)

    def tokenize(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """-> ids ``(B, max_length)`` long, mask ``(B, max_length)`` bool (True = valid)."""
        n = self.cfg.max_length
        ids = torch.full((len(texts), n), _PAD, dtype=torch.long)
        for i, text in enumerate(texts):
            data = list(text.encode("utf-8"))[: n - 1]
            ids[i, 0] = _BOS
            ids[i, 1 : 1 + len(data)] = torch.tensor(data, dtype=torch.long)
        return ids, ids != _PAD

    def forward(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """-> tokens ``(B, max_length, dim)``, mask ``(B, max_length)`` (True = valid)."""
        if not texts:
            raise ValueError("TextEncoder: texts is empty; pass one string per batch item")
        ids, mask = self.tokenize(texts)
        dev = self.embed.weight.device
        ids, mask = ids.to(dev), mask.to(dev)
        x = self.embed(ids)
        pos = torch.arange(ids.shape[1], device=dev, dtype=torch.float32)
        pos3 = F.pad(pos[:, None], (0, 2))[None].expand(ids.shape[0], -1, -1)
        rope = rope_angles(pos3, self.cfg.dim // self.cfg.num_heads, 10000.0)
        for block in self.blocks:
            x = block(x, rope=rope, mask_BN=mask)
        return self.norm_out(x) * mask[..., None], mask
