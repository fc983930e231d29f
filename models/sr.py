"""One-step, identity-aware super-resolution in latent space (SR DiT).

Who calls it: the pipeline's SR stage, once per emitted chunk, on the final low-res latents of that
chunk. It is one deterministic forward (no noise, no sampler): the low-res latent is upsampled and a
transformer predicts the residual that restores detail, attending to the tokens of the hr reference
latent (identity). With ``SRConfig.ref_window_radius`` > 0 a second, full-resolution step follows: every
hr latent cell attends to the reference latent's cells around its own position
(:class:`ReferenceWindowAttention`) and a small conv turns what it read into a further residual, so
detail the low-res latent lost (glasses, earrings, the eyes) can be copied from the reference cell by
cell instead of through 64 patch tokens; ``SRConfig.ref_window_layers`` > 1 repeats that step, each reading
the reference again from the latent the previous one corrected. Every frame is processed on its own (frames are folded into
the batch), so chunking never changes the output and frames can be batched freely.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from models.layers import (
    ReferenceWindowAttention,
    TransformerBlock,
    grid_positions,
    patchify,
    reference_tokens,
    rope_angles,
    unpatchify,
)
from models.presets import SRConfig


class SRDiT(nn.Module):
    def __init__(self, cfg: SRConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, p, c = cfg.dim, cfg.patch_size, cfg.channels
        self.patch_embed = nn.Linear(c * p * p, d)
        self.ref_embed = nn.Linear(c * p * p, d)
        self.ref_norm = nn.LayerNorm(d, eps=cfg.eps)
        self.blocks = nn.ModuleList(
            [
                TransformerBlock(d, cfg.num_heads, cfg.ffn_dim, cross=True, eps=cfg.eps)
                for _ in range(cfg.num_layers)
            ]
        )
        self.norm_out = nn.LayerNorm(d, eps=cfg.eps)
        self.head = nn.Linear(d, c * p * p)
        if cfg.ref_window_layers < 1:
            raise ValueError(f"SRConfig.ref_window_layers={cfg.ref_window_layers}: must be >= 1 (ref_window_radius=0 "
                             "turns the reference window off)")

        def window() -> ReferenceWindowAttention:
            return ReferenceWindowAttention(c, cfg.ref_window_dim, cfg.ref_window_hidden, cfg.ref_window_radius)

        # the first step keeps its own name (``ref_window.*``: the keys of the checkpoints that had one step);
        # further steps each start as a no-op, so a checkpoint with fewer steps warm-starts this one
        self.ref_window = window() if cfg.ref_window_radius > 0 else None
        self.ref_window_more = nn.ModuleList(
            [window() for _ in range(cfg.ref_window_layers - 1)] if cfg.ref_window_radius > 0 else [])

    def embed_reference(self, ref_BCHW: Tensor) -> Tensor:
        """Reference tokens ``(B, M, D)``; depend only on the reference, so a caller may compute them once."""
        return self.ref_norm(reference_tokens(self.ref_embed, ref_BCHW, self.cfg.patch_size))

    def forward(self, lr_BCThw: Tensor, ref_BCHW: Tensor, *, ref_tokens: Tensor | None = None) -> Tensor:
        """Low-res latents ``(B, C, T, h, w)`` -> hr latents ``(B, C, T, h*s, w*s)``."""
        cfg, p, s = self.cfg, self.cfg.patch_size, self.cfg.scale
        B, C, T, h, w = lr_BCThw.shape
        H, W = h * s, w * s
        if H % p or W % p:
            raise ValueError(f"lr_BCThw: hr size {H}x{W} not divisible by SR patch_size={p}")
        frames = lr_BCThw.transpose(1, 2).reshape(B * T, C, h, w)
        up = F.interpolate(frames, scale_factor=s, mode="bilinear", align_corners=False)
        x = self.patch_embed(patchify(up, p))  # (B*T, n, D)
        ref = ref_tokens if ref_tokens is not None else self.embed_reference(ref_BCHW)
        ref = ref.repeat_interleave(T, dim=0) if T > 1 else ref
        gh, gw = H // p, W // p
        pos = grid_positions(gh, gw, x.device)
        pos3 = F.pad(pos, (1, 0))[None].expand(B * T, -1, -1)  # time axis 0: frames are independent
        rope = rope_angles(pos3, cfg.head_dim, cfg.rope_theta)
        for block in self.blocks:
            x = block(x, rope=rope, context_BMD=ref)
        z = up + unpatchify(self.head(self.norm_out(x)), p, C, H, W)
        if self.ref_window is not None:
            z = self.ref_window(z, ref_BCHW)
        for step in self.ref_window_more:
            z = step(z, ref_BCHW)
        return z.reshape(B, T, C, H, W).transpose(1, 2)
