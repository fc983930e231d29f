"""The flow-matching audio-to-video DiT (A2V): predicts the velocity of a window of low-res latents.

Who calls it: the pipeline's A2V stage, once per sampler step, for each N or I chunk (DESIGN §3).
One model serves both chunk kinds: the window holds known (clean) frames — context for N chunks,
anchors for I chunks — and unknown frames to generate, and ``known_BT`` tells which is which.

Conditioning:
* timestep: adaLN modulation per frame; known frames get t = 0 (they are clean) plus a learned
  "known" embedding on their tokens;
* reference: the hr reference latent, patchified into rich reference tokens, and the optional text
  tokens are keys/values of a cross-attention in every block;
* audio: each frame's features are split into a few audio tokens, and the frame's video tokens attend
  to their own frame's audio tokens only (frame-local cross-attention): the audio encoder already
  gives every frame its context window, so chunking never changes what a frame hears;
* positions: 3-axis RoPE over (frame, row, column). ``frame_index_BT`` is the absolute timeline index
  of each frame; the window start is subtracted before the rotary angles are taken, so attention sees
  exactly the relative offsets — positions continue across chunks, and a frame at minute 10 looks the
  same to the model as one at second 0.

Conventions (rectified flow): ``x_t = (1 - t) x0 + t noise``, ``v = noise - x0``, t in [0, 1].
No parallelism here: ``blocks`` is the list placement code shards or prefetches.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.layers import (
    Attention,
    FeedForward,
    grid_positions,
    patchify,
    reference_tokens,
    rope_angles,
    sinusoidal_embedding,
    unpatchify,
)
from models.presets import DiTConfig


class A2VBlock(nn.Module):
    """adaLN self-attention over the window, cross-attention to reference/text, frame-local audio
    attention, adaLN MLP. Tokens are ``(B, T, N, D)`` (N tokens per frame)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        d = cfg.dim
        # learned per-block offset to the shared timestep projection (Wan-style: keeps adaLN cheap)
        self.modulation = nn.Parameter(torch.randn(1, 1, 6, d) / d**0.5)
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=cfg.eps)
        self.self_attn = Attention(d, cfg.num_heads, eps=cfg.eps)
        self.norm_ctx = nn.LayerNorm(d, eps=cfg.eps)
        self.ctx_attn = Attention(d, cfg.num_heads, context_dim=d, eps=cfg.eps)
        self.norm_audio = nn.LayerNorm(d, eps=cfg.eps)
        self.audio_attn = Attention(d, cfg.num_heads, context_dim=cfg.audio_token_dim, eps=cfg.eps)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=cfg.eps)
        self.ffn = FeedForward(d, cfg.ffn_dim)

    def forward(
        self,
        x_BTND: Tensor,
        mod_BT6D: Tensor,
        rope: tuple[Tensor, Tensor],
        ctx_BMD: Tensor,
        ctx_mask_BM: Tensor | None,
        audio_BTAK: Tensor,
        windows: tuple[int, ...] | None = None,
    ) -> Tensor:
        B, T, N, D = x_BTND.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = (mod_BT6D + self.modulation).unsqueeze(3).unbind(2)
        h = self.norm1(x_BTND) * (1 + scale1) + shift1
        segments = None if windows is None else tuple(t * N for t in windows)
        x_BTND = x_BTND + gate1 * self.self_attn(h.reshape(B, T * N, D), rope=rope,
                                                 segments=segments).reshape(B, T, N, D)
        h = self.ctx_attn(self.norm_ctx(x_BTND).reshape(B, T * N, D), ctx_BMD, mask_BM=ctx_mask_BM)
        x_BTND = x_BTND + h.reshape(B, T, N, D)
        h = self.audio_attn(self.norm_audio(x_BTND).reshape(B * T, N, D), audio_BTAK.flatten(0, 1))
        x_BTND = x_BTND + h.reshape(B, T, N, D)
        h = self.norm2(x_BTND) * (1 + scale2) + shift2
        return x_BTND + gate2 * self.ffn(h)


class A2VDiT(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, p = cfg.dim, cfg.patch_size
        self.patch_embed = nn.Linear(cfg.in_channels * p * p, d)
        self.known_embed = nn.Embedding(2, d)
        self.time_embed = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.ref_embed = nn.Linear(cfg.ref_channels * cfg.ref_patch_size**2, d)
        self.text_proj = (
            nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
            if cfg.text_dim
            else None
        )
        self.audio_proj = nn.Sequential(
            nn.Linear(cfg.audio_dim, cfg.audio_token_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(cfg.audio_token_dim, cfg.audio_tokens * cfg.audio_token_dim),
        )
        self.blocks = nn.ModuleList([A2VBlock(cfg) for _ in range(cfg.num_layers)])
        self.head_modulation = nn.Parameter(torch.randn(1, 1, 2, d) / d**0.5)
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False, eps=cfg.eps)
        self.head = nn.Linear(d, cfg.in_channels * p * p)

    def embed_context(
        self, ref_BCHW: Tensor, text_BND: Tensor | None = None, text_mask_BN: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Reference (+ text) tokens for the cross-attention; the same for every sampler step, so a
        caller may compute them once per chunk and pass them as ``context=`` to ``forward``."""
        B = ref_BCHW.shape[0]
        ref = reference_tokens(self.ref_embed, ref_BCHW, self.cfg.ref_patch_size)
        if text_BND is None:
            return ref, None
        if self.text_proj is None:
            raise ValueError("text_BND given but this DiT has no text branch (DiTConfig.text_dim is None)")
        if text_mask_BN is None:
            text_mask_BN = torch.ones(text_BND.shape[:2], dtype=torch.bool, device=text_BND.device)
        text_mask_BN = text_mask_BN.to(torch.bool)
        # drop trailing columns that are padding in every row: masked keys change nothing, they only cost
        valid_cols = text_mask_BN.any(dim=0).nonzero()
        n_keep = int(valid_cols.max()) + 1 if valid_cols.numel() else 1
        text_BND, text_mask_BN = text_BND[:, :n_keep], text_mask_BN[:, :n_keep]
        text = self.text_proj(text_BND)
        tokens = torch.cat([ref, text], dim=1)
        if bool(text_mask_BN.all()):
            return tokens, None  # no mask: SDPA may pick its fastest (flash) kernel
        ref_mask = torch.ones(B, ref.shape[1], dtype=torch.bool, device=ref.device)
        return tokens, torch.cat([ref_mask, text_mask_BN], dim=1)

    def forward(
        self,
        x_BCThw: Tensor,
        t_B: Tensor,
        known_BT: Tensor,
        frame_index_BT: Tensor,
        ref_BCHW: Tensor,
        audio_BTD: Tensor,
        text_BND: Tensor | None = None,
        text_mask_BN: Tensor | None = None,
        *,
        context: tuple[Tensor, Tensor | None] | None = None,
        windows: tuple[int, ...] | None = None,
    ) -> Tensor:
        """Velocity ``v_BCThw`` for the window ``x_BCThw`` (clean at known frames) at time ``t_B``:
        ``(B,)``, or ``(B, T)`` for a time per frame (packed windows sampled from different starts).

        ``windows``: the frame counts of several independent windows packed along T (the pipeline's
        batched steps, e.g. ``I_{k-1}`` with ``N_{k+1}``): each window's frames attend only to each
        other and take their rotary positions from their own start, so every window's velocity is
        what it would be alone; the per-token layers run once over all of them."""
        cfg, p = self.cfg, self.cfg.patch_size
        B, C, T, h, w = x_BCThw.shape
        if windows is not None and (sum(windows) != T or min(windows, default=0) < 1):
            raise ValueError(f"windows {windows} must be positive frame counts summing to T = {T}")
        if known_BT.shape != (B, T) or frame_index_BT.shape != (B, T):
            raise ValueError(
                f"known_BT {tuple(known_BT.shape)} / frame_index_BT {tuple(frame_index_BT.shape)} "
                f"must be (B, T) = {(B, T)} like x_BCThw"
            )
        if t_B.shape not in ((B,), (B, T)):
            raise ValueError(f"t_B {tuple(t_B.shape)} must be (B,) = {(B,)} or per frame (B, T) = {(B, T)}")
        if audio_BTD.shape[:2] != (B, T):
            raise ValueError(
                f"audio_BTD has {tuple(audio_BTD.shape[:2])} frames, x_BCThw has (B, T) = {(B, T)}: "
                "pass one audio feature per window frame"
            )
        if h % p or w % p:
            raise ValueError(f"x_BCThw: latent size {h}x{w} not divisible by patch_size={p}")
        gh, gw = h // p, w // p
        n = gh * gw

        frames = x_BCThw.transpose(1, 2).reshape(B * T, C, h, w)
        x = self.patch_embed(patchify(frames, p)).reshape(B, T, n, cfg.dim)
        known = known_BT.to(torch.bool)
        x = x + self.known_embed(known.long())[:, :, None]

        t_all = t_B[:, None].expand(B, T) if t_B.dim() == 1 else t_B  # per frame: packed windows' own times
        t_BT = torch.where(known, torch.zeros_like(t_all), t_all)
        e_BTD = self.time_embed(sinusoidal_embedding(t_BT, cfg.freq_dim).to(x.dtype))
        mod = self.time_proj(e_BTD).unflatten(-1, (6, cfg.dim))

        # relative frame positions: subtract the window start so only offsets reach RoPE
        if windows is None or len(windows) == 1:
            rel = (frame_index_BT - frame_index_BT.min(dim=1, keepdim=True).values).to(torch.float32)
        else:
            rel = torch.cat([f - f.min(dim=1, keepdim=True).values for f in frame_index_BT.split(windows, dim=1)],
                            dim=1).to(torch.float32)
        grid = grid_positions(gh, gw, x.device)
        pos = torch.cat(
            [rel[:, :, None, None].expand(B, T, n, 1), grid[None, None].expand(B, T, n, 2)], dim=-1
        )
        rope = rope_angles(pos.reshape(B, T * n, 3), cfg.head_dim, cfg.rope_theta)

        ctx, ctx_mask = (
            context if context is not None else self.embed_context(ref_BCHW, text_BND, text_mask_BN)
        )
        audio = self.audio_proj(audio_BTD).unflatten(-1, (cfg.audio_tokens, cfg.audio_token_dim))

        for block in self.blocks:
            x = block(x, mod, rope, ctx, ctx_mask, audio, windows)

        shift, scale = (e_BTD[:, :, None] + self.head_modulation).unsqueeze(3).unbind(2)
        out = self.head(self.norm_out(x) * (1 + scale) + shift)  # (B, T, n, C p p)
        v = unpatchify(out.reshape(B * T, n, -1), p, C, h, w)
        return v.reshape(B, T, C, h, w).transpose(1, 2)
