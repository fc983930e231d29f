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

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.layers import (
    TransformerBlock,
    grid_positions,
    patchify,
    reference_tokens,
    rope_angles,
    unpatchify,
)
from models.presets import SRConfig


class ReferenceWindowAttention(nn.Module):
    """Each hr latent cell of a frame attends to the reference latent's cells within ``radius`` cells of
    its own position (a ``(2r+1)^2`` window, cells outside the latent masked), then two 3x3 convs map what
    it read, beside the frame's own latent, to a residual on that latent.

    Why a window: the head moves little around the reference pose (tiny's generator: at most ~10 px,
    under 2 latent cells), so the detail a cell needs is in the reference near the same place, and a
    window keeps the cost linear in the number of cells (the 14b hr latent has 14 720). Queries and
    keys are 3x3 convs, so a cell matches on its neighbourhood; a learned bias per head and window
    offset lets attention prefer the aligned cell. The last conv starts at zero: a checkpoint trained
    without this step loads into it (``load_checkpoint(allow_missing=GROWN_PARTS)``) and computes the same
    thing.
    """

    HEAD_DIM = 16

    def __init__(self, channels: int, dim: int, hidden: int, radius: int) -> None:
        super().__init__()
        if radius < 1 or dim % self.HEAD_DIM:
            raise ValueError(f"ReferenceWindowAttention: radius={radius} must be >= 1 and dim={dim} a multiple "
                             f"of {self.HEAD_DIM}")
        self.radius, self.dim, self.num_heads = radius, dim, dim // self.HEAD_DIM
        self.q = nn.Conv2d(channels, dim, 3, padding=1)
        self.kv = nn.Conv2d(channels, 2 * dim, 3, padding=1)
        self.pos_bias = nn.Parameter(torch.zeros(self.num_heads, (2 * radius + 1) ** 2))
        self.out_in = nn.Conv2d(dim + channels, hidden, 3, padding=1)
        self.out = nn.Conv2d(hidden, channels, 3, padding=1)
        for t in self.out.parameters():
            nn.init.zeros_(t)

    def forward(self, z_NCHW: Tensor, ref_BCHW: Tensor) -> Tensor:
        """Frames ``(B*T, C, H, W)`` (frames of reference b at rows ``b*T .. b*T+T-1``) -> the same frames
        with the residual added."""
        N, C, H, W = z_NCHW.shape
        B, r = ref_BCHW.shape[0], self.radius
        T, hd, heads = N // B, self.HEAD_DIM, self.num_heads
        # keys and values of the reference, zero-padded by r: the window of cell (y, x) at offset
        # (dy, dx) is the padded map's cell (y + dy, x + dx). One slice per offset keeps the memory
        # at one map (no (K, H*W) unfold) and is the fastest form here, forward and backward.
        kv = F.pad(self.kv(ref_BCHW.to(z_NCHW.dtype)), (r, r, r, r)).view(B, 1, 2, heads, hd, H + 2 * r, W + 2 * r)
        k_pad, v_pad = kv[:, :, 0], kv[:, :, 1]
        inside = F.pad(torch.ones(H, W, dtype=torch.bool, device=z_NCHW.device), (r, r, r, r))
        q = self.q(z_NCHW).view(B, T, heads, hd, H, W) / math.sqrt(hd)
        offsets = [(dy, dx) for dy in range(2 * r + 1) for dx in range(2 * r + 1)]
        logits = torch.stack([(q * k_pad[..., dy:dy + H, dx:dx + W]).sum(dim=3) for dy, dx in offsets], dim=3)
        logits = logits + self.pos_bias.to(logits.dtype)[:, :, None, None]  # (B, T, heads, K, H, W)
        outside = ~torch.stack([inside[dy:dy + H, dx:dx + W] for dy, dx in offsets])  # (K, H, W)
        attn = logits.masked_fill(outside, float("-inf")).softmax(dim=3)
        read = attn[:, :, :, 0, None] * v_pad[..., :H, :W]
        for i, (dy, dx) in enumerate(offsets[1:], 1):
            read = read + attn[:, :, :, i, None] * v_pad[..., dy:dy + H, dx:dx + W]
        read = read.reshape(N, self.dim, H, W)
        return z_NCHW + self.out(F.gelu(self.out_in(torch.cat([read, z_NCHW], dim=1))))


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
