"""Blocks shared by the DiTs and encoders: attention with RoPE, feed-forward, timestep embedding,
patchify helpers.

Nothing here knows about parallelism or devices: placement code in ``pipeline/`` wraps the blocks.
Attention always goes through ``F.scaled_dot_product_attention`` so the best kernel of the device is
used.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def sinusoidal_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """``t`` of any shape (values in [0, 1] are scaled by 1000) -> ``(*t.shape, dim)`` float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float() * 1000.0)[..., None] * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_axes_split(head_dim: int) -> tuple[int, int, int]:
    """How a head's channels are shared between the (time, height, width) rotary axes (all even)."""
    hw = 2 * (head_dim // 6)
    t = head_dim - 2 * hw
    if t % 2 or t <= 0:
        raise ValueError(
            f"head_dim={head_dim} cannot be split into even (t, h, w) rotary parts; use a multiple of 6 or 8"
        )
    return t, hw, hw


def rope_angles(pos_BN3: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Rotary angles for 3-axis positions ``(B, N, 3)`` (time, row, column) -> cos, sin ``(B, 1, N, head_dim/2)``.

    Positions are floats; only differences between positions of two tokens reach the attention
    scores, which is what makes the DiT depend on relative frame offsets only.
    """
    parts = rope_axes_split(head_dim)
    angles = []
    for axis, d in enumerate(parts):
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=pos_BN3.device, dtype=torch.float64) / d))
        angles.append(pos_BN3[..., axis].double()[..., None] * inv)
    ang = torch.cat(angles, dim=-1)  # float64 so large positions keep their precision
    return ang.cos().float()[:, None], ang.sin().float()[:, None]


def apply_rope(x_BHND: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x = x_BHND.float().unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x_BHND)


class Attention(nn.Module):
    """Multi-head attention with RMS-normalised queries and keys (stable at large widths).

    Self-attention unless built with ``context_dim`` (cross-attention: keys/values from
    ``context_BMD``). ``rope`` applies to queries and keys of self-attention. ``mask_BM`` (True =
    attend) masks keys.
    """

    def __init__(self, dim: int, num_heads: int, context_dim: int | None = None, eps: float = 1e-6) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.is_cross = context_dim is not None
        # fused projections: one matmul for q,k,v (self) or k,v (cross); fewer small kernels on CPU
        if self.is_cross:
            self.q = nn.Linear(dim, dim)
            self.kv = nn.Linear(context_dim or dim, 2 * dim)
        else:
            self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        # normalised over the full width (contiguous, one kernel) rather than per head
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def forward(
        self,
        x_BND: Tensor,
        context_BMD: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        mask_BM: Tensor | None = None,
        segments: tuple[int, ...] | None = None,
    ) -> Tensor:
        """``segments`` (self-attention): the token counts of independent sequences packed along N;
        each attends only to itself, exactly as if run alone (the projections run over all at once)."""
        if self.is_cross:
            if context_BMD is None:
                raise ValueError("cross-attention needs context_BMD")
            q = self.q(x_BND)
            k, v = self.kv(context_BMD).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv(x_BND).chunk(3, dim=-1)
        h = self.num_heads
        q = self.norm_q(q).unflatten(-1, (h, -1)).transpose(1, 2)
        k = self.norm_k(k).unflatten(-1, (h, -1)).transpose(1, 2)
        v = v.unflatten(-1, (h, -1)).transpose(1, 2)
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)
        attn_mask = None if mask_BM is None else mask_BM[:, None, None, :]
        if segments is not None and len(segments) > 1:
            if self.is_cross or attn_mask is not None:
                raise ValueError("segments are for self-attention without a key mask")
            out = torch.cat([F.scaled_dot_product_attention(qs, ks, vs) for qs, ks, vs in zip(
                q.split(segments, dim=2), k.split(segments, dim=2), v.split(segments, dim=2), strict=True)], dim=2)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o(out.transpose(1, 2).flatten(-2))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    """Pre-norm block without timestep modulation: self-attention, optional cross-attention, MLP.

    Used by the SR DiT and the text encoder.
    """

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, cross: bool, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, eps=eps)
        self.norm_x = nn.LayerNorm(dim, eps=eps) if cross else None
        self.cross = Attention(dim, num_heads, context_dim=dim, eps=eps) if cross else None
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.ffn = FeedForward(dim, ffn_dim)

    def forward(
        self,
        x_BND: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        mask_BN: Tensor | None = None,
        context_BMD: Tensor | None = None,
    ) -> Tensor:
        x_BND = x_BND + self.attn(self.norm1(x_BND), rope=rope, mask_BM=mask_BN)
        if self.cross is not None and self.norm_x is not None and context_BMD is not None:
            x_BND = x_BND + self.cross(self.norm_x(x_BND), context_BMD)
        return x_BND + self.ffn(self.norm2(x_BND))


def patchify(x_BCHW: Tensor, p: int) -> Tensor:
    """``(B, C, H, W)`` -> tokens ``(B, (H/p)(W/p), C p p)``, row-major over patches."""
    B, C, H, W = x_BCHW.shape
    x = x_BCHW.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def unpatchify(tokens_BNK: Tensor, p: int, C: int, H: int, W: int) -> Tensor:
    B = tokens_BNK.shape[0]
    x = tokens_BNK.reshape(B, H // p, W // p, C, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, C, H, W)


def grid_positions(h: int, w: int, device: torch.device | None = None) -> Tensor:
    """``(h*w, 2)`` float (row, column) positions of a patch grid, row-major."""
    rows = torch.arange(h, device=device, dtype=torch.float32)
    cols = torch.arange(w, device=device, dtype=torch.float32)
    return torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1).reshape(h * w, 2)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def sincos_2d(pos_N2: Tensor, dim: int) -> Tensor:
    """Fixed 2D sin-cos embedding ``(N, dim)`` of (row, column) positions; size-agnostic, no parameters."""
    quarter = dim // 4
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(quarter, device=pos_N2.device, dtype=torch.float32) / quarter
    )
    parts = []
    for axis in range(2):
        a = pos_N2[:, axis, None].float() * freqs
        parts.extend([a.sin(), a.cos()])
    emb = torch.cat(parts, dim=-1)
    return F.pad(emb, (0, dim - emb.shape[-1]))


def reference_tokens(embed: nn.Linear, ref_BCHW: Tensor, p: int) -> Tensor:
    """Patchify a reference latent, embed each patch, add a fixed 2D position: ``(B, (H/p)(W/p), D)``."""
    H, W = ref_BCHW.shape[-2:]
    if H % p or W % p:
        raise ValueError(f"ref_BCHW: size {H}x{W} not divisible by the reference patch size {p}")
    ref = embed(patchify(ref_BCHW, p))
    return ref + sincos_2d(grid_positions(H // p, W // p, ref.device), ref.shape[-1]).to(ref.dtype)


class WindowKeys(NamedTuple):
    """A reference map's keys and values per window cell (:meth:`ReferenceWindowAttention.read`)."""

    k: Tensor  # (B, heads, H*W, head_dim, K): the K = (2r+1)^2 offsets' keys of each cell
    v: Tensor  # (B, heads, H*W, K, head_dim)
    bias: Tensor  # (heads, H*W, 1, K): the learned bias per head and offset, -inf where the offset leaves the map


class ReferenceWindowAttention(nn.Module):
    """Each cell of a frame's map attends to the reference map's cells within ``radius`` cells of its own
    position (a ``(2r+1)^2`` window, cells outside the map masked), then two 3x3 convs map what it read,
    beside the frame's own map, to a residual on that map. The SR runs it on hr latents
    (``SRConfig.ref_window_radius``), the VAE decoder on its features at twice the latent resolution
    (``VAEConfig.ref_window_radius``); ``ref_channels`` (default ``channels``) is the reference map's
    width when it carries more than the frame's (the decoder's: its features plus the reference's pixels).

    Why a window: the head moves little around the reference pose (tiny's generator: at most ~10 px,
    under 2 latent cells), so the detail a cell needs is in the reference near the same place, and a
    window keeps the cost linear in the number of cells (the 14b hr latent has 14 720). Queries and
    keys are 3x3 convs, so a cell matches on its neighbourhood; a learned bias per head and window
    offset lets attention prefer the aligned cell. The last conv starts at zero: a checkpoint trained
    without this step loads into it (``load_checkpoint(allow_missing=GROWN_PARTS)``) and computes the same
    thing.
    """

    HEAD_DIM = 16

    def __init__(self, channels: int, dim: int, hidden: int, radius: int, ref_channels: int | None = None) -> None:
        super().__init__()
        if radius < 1 or dim % self.HEAD_DIM:
            raise ValueError(f"ReferenceWindowAttention: radius={radius} must be >= 1 and dim={dim} a multiple "
                             f"of {self.HEAD_DIM}")
        self.radius, self.dim, self.num_heads = radius, dim, dim // self.HEAD_DIM
        self.q = nn.Conv2d(channels, dim, 3, padding=1)
        self.kv = nn.Conv2d(ref_channels or channels, 2 * dim, 3, padding=1)
        self.pos_bias = nn.Parameter(torch.zeros(self.num_heads, (2 * radius + 1) ** 2))
        self.out_in = nn.Conv2d(dim + channels, hidden, 3, padding=1)
        self.out = nn.Conv2d(hidden, channels, 3, padding=1)
        for t in self.out.parameters():
            nn.init.zeros_(t)

    def read(self, ref_BCHW: Tensor) -> WindowKeys:
        """The reference map's keys and values gathered per cell: cell (y, x)'s window offset (dy, dx) is
        the map's cell (y + dy, x + dx), zero outside it (masked by the bias). They depend on the reference
        alone: a caller that runs the window on many frames of one reference (the decoder, per emission)
        computes them once (``CausalVAE.reference_features``). A snapshot of the window's weights: gather
        them again after changing those."""
        B, _, H, W = ref_BCHW.shape
        side, hd = 2 * self.radius + 1, self.HEAD_DIM
        kv = F.unfold(self.kv(ref_BCHW), side, padding=self.radius)  # (B, 2*dim*K, HW)
        kv = kv.view(B, 2, self.num_heads, hd, side * side, H * W)
        inside = F.unfold(torch.ones(1, 1, H, W, dtype=kv.dtype, device=kv.device), side, padding=self.radius)[0] > 0
        bias = self.pos_bias.to(kv.dtype)[:, None, None, :].masked_fill(~inside.T[None, :, None, :], float("-inf"))
        return WindowKeys(kv[:, 0].permute(0, 1, 4, 2, 3).contiguous(), kv[:, 1].permute(0, 1, 4, 3, 2).contiguous(),
                          bias)

    def forward(self, z_NCHW: Tensor, ref: Tensor | WindowKeys) -> Tensor:
        """Frames ``(B*T, C, H, W)`` (frames of reference b at rows ``b*T .. b*T+T-1``) and the reference
        map ``(B, ref_channels, H, W)`` or its :meth:`read` -> the same frames with the residual added.

        Two forms of one computation (tested equal). Given the map, each window offset is one
        elementwise product of the padded key map (memory: one map): the fastest when the map is read
        for few frames, or with gradients (the SR; the decoder's training, one frame per reference: its
        step 2.2-2.7x faster than gathering 49 keys per cell). Given the keys, each cell's attention is
        two small matrix products: the fastest for many frames of one reference without gradients (the
        decoder in a render, keys gathered once per job: tiny's whole decoder 12.8-13.6 ms a frame against
        24-27 slid, one thread; docs/models.md)."""
        return self._attend(z_NCHW, ref, False)[0]

    def forward_with_offset(self, z_NCHW: Tensor, ref: Tensor | WindowKeys) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`forward`, and where each cell read the reference from: the attention's expected offset
        ``(B*T, 2, H, W)`` (dy, dx) in cells, averaged over the heads (a soft-argmax: between cells where
        the attention spreads over neighbours), and how far the attention spreads around it ``(B*T, 1,
        H, W)``: its variance in cells², averaged over the heads (near 0 where a cell matched one place,
        large on flat skin, where every offset matches)."""
        out, where = self._attend(z_NCHW, ref, True)
        assert where is not None
        return out, where[0], where[1]

    def _attend(self, z_NCHW: Tensor, ref: Tensor | WindowKeys, with_offset: bool
                ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """The frames with the residual added, and the expected offset and its spread when asked."""
        if isinstance(ref, Tensor):
            read, where = self._slide(z_NCHW, ref, with_offset)
        else:
            read, where = self._gathered(z_NCHW, ref, with_offset)
        return z_NCHW + self.out(F.gelu(self.out_in(torch.cat([read, z_NCHW], dim=1)))), where

    @staticmethod
    def _moments(attn: Tensor, shifts: Tensor) -> tuple[Tensor, Tensor]:
        """Per head, the expected offset ``(..., 2)`` and the variance ``(..., 1)`` of attention
        ``(..., K)`` over the window's offsets ``shifts`` ``(K, 2)``."""
        mean = attn @ shifts
        var = attn @ shifts.pow(2).sum(dim=-1, keepdim=True) - mean.pow(2).sum(dim=-1, keepdim=True)
        return mean, var.clamp(min=0.0)

    def _shifts(self, like: Tensor) -> Tensor:
        """The window's ``K`` offsets ``(K, 2)`` (dy, dx), row-major: the order of its attention."""
        side = torch.arange(-self.radius, self.radius + 1, dtype=like.dtype, device=like.device)
        return torch.stack(torch.meshgrid(side, side, indexing="ij"), dim=-1).reshape(-1, 2)

    def _slide(self, z_NCHW: Tensor, ref_BCHW: Tensor, with_offset: bool
               ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """What each cell read ``(B*T, dim, H, W)``, one slice of the padded key and value maps per offset."""
        N, C, H, W = z_NCHW.shape
        B, r = ref_BCHW.shape[0], self.radius
        T, hd, heads = N // B, self.HEAD_DIM, self.num_heads
        # keys and values of the reference, zero-padded by r: the window of cell (y, x) at offset
        # (dy, dx) is the padded map's cell (y + dy, x + dx). One slice per offset keeps the memory
        # at one map (no (K, H*W) unfold).
        # contiguous (NCHW): a channels-last caller's maps (the VAE decoder's) make every slice below strided
        kv = F.pad(self.kv(ref_BCHW.to(z_NCHW.dtype)).contiguous(), (r, r, r, r)).view(B, 1, 2, heads, hd, H + 2 * r,
                                                                                       W + 2 * r)
        k_pad, v_pad = kv[:, :, 0], kv[:, :, 1]
        inside = F.pad(torch.ones(H, W, dtype=torch.bool, device=z_NCHW.device), (r, r, r, r))
        q = self.q(z_NCHW).contiguous().view(B, T, heads, hd, H, W) / math.sqrt(hd)
        offsets = [(dy, dx) for dy in range(2 * r + 1) for dx in range(2 * r + 1)]
        logits = torch.stack([(q * k_pad[..., dy:dy + H, dx:dx + W]).sum(dim=3) for dy, dx in offsets], dim=3)
        logits = logits + self.pos_bias.to(logits.dtype)[:, :, None, None]  # (B, T, heads, K, H, W)
        outside = ~torch.stack([inside[dy:dy + H, dx:dx + W] for dy, dx in offsets])  # (K, H, W)
        attn = logits.masked_fill(outside, float("-inf")).softmax(dim=3)
        read = attn[:, :, :, 0, None] * v_pad[..., :H, :W]
        for i, (dy, dx) in enumerate(offsets[1:], 1):
            read = read + attn[:, :, :, i, None] * v_pad[..., dy:dy + H, dx:dx + W]
        where = None  # the expected offset and its spread, averaged over the heads
        if with_offset:
            mean, var = self._moments(attn.movedim(3, -1), self._shifts(attn))  # (B, T, heads, H, W, 2 | 1)
            where = (mean.mean(dim=2).movedim(-1, 2).reshape(N, 2, H, W),
                     var.mean(dim=2).movedim(-1, 2).reshape(N, 1, H, W))
        return read.reshape(N, self.dim, H, W), where

    def _gathered(self, z_NCHW: Tensor, keys: WindowKeys, with_offset: bool
                  ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """What each cell read ``(B*T, dim, H, W)``, two small matrix products per cell over its gathered
        keys and values (:meth:`read`)."""
        N, C, H, W = z_NCHW.shape
        B, heads, HW, hd, K = keys.k.shape
        T = N // B
        if HW != H * W or B * T != N:
            raise ValueError(f"ReferenceWindowAttention: {N} frames of {H}x{W} cells against {B} reference(s) of "
                             f"{HW} cells: pass one reference per T frames, at the frames' resolution")
        # (T, hd) @ (hd, K) and (T, K) @ (K, hd), batched over heads and cells (the reference's T frames
        # share its keys). The maps go in and out channels-last (N, H, W, C), so the regrouping moves
        # whole heads, not single floats.
        q = self.q(z_NCHW).permute(0, 2, 3, 1).reshape(B, T, HW, heads, hd).permute(0, 3, 2, 1, 4)  # (B, heads, HW, T, hd)
        logits = torch.baddbmm(keys.bias.expand(B, heads, HW, 1, K).reshape(-1, 1, K), q.reshape(-1, T, hd),
                               keys.k.reshape(-1, hd, K), alpha=1 / math.sqrt(hd))
        attn = logits.softmax(dim=-1).view(B, heads, HW, T, K)
        read = (attn @ keys.v).permute(0, 3, 2, 1, 4).reshape(N, H, W, self.dim).permute(0, 3, 1, 2)
        where = None  # as in _slide
        if with_offset:
            mean, var = self._moments(attn, self._shifts(attn))  # (B, heads, HW, T, 2 | 1)
            where = (mean.mean(dim=1).permute(0, 2, 3, 1).reshape(N, 2, H, W),
                     var.mean(dim=1).permute(0, 2, 3, 1).reshape(N, 1, H, W))
        return read, where
