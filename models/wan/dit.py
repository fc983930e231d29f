"""The Wan2.1-I2V DiT with the InfiniteTalk / MultiTalk per-block audio cross-attention.

Written from the public Wan-Video/Wan2.1 ``wan/modules/model.py`` and MeiGen-AI/InfiniteTalk
``wan/modules/multitalk_model.py`` + ``wan/modules/attention.py`` (single-person path). Parameter names
are the *original* Wan names (``blocks.0.self_attn.q.weight``, ``patch_embedding``, ``text_embedding.0``,
``img_emb.proj.*``, ``blocks.0.audio_cross_attn.q_linear``, ``audio_proj.proj1`` ...), so the public
shards load without renaming (:mod:`models.wan.checkpoint`). Equivalence with diffusers'
``WanTransformer3DModel`` (audio output zeroed) is tested in ``tests/unit/test_wan_dit.py``.

Who calls what: a family's denoise stage calls :meth:`WanAvatarDiT.forward` once per step per chunk;
the audio tokens (:meth:`WanAvatarDiT.audio_tokens`) and the text/image context
(:meth:`WanAvatarDiT.embed_context`) can be computed once per chunk / job and passed back in.
``blocks`` is a plain ``nn.ModuleList`` of identical blocks so a ``parallelize`` plan can shard or
offload per block. No parallelism lives here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.wan.config import WanDiTConfig

try:  # optional faster backend; SDPA otherwise
    from flash_attn import flash_attn_func as _flash_attn_func  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the machine
    _flash_attn_func = None


def attention(q_BLHD: Tensor, k_BLHD: Tensor, v_BLHD: Tensor) -> Tensor:
    """Full (non-causal) attention on ``[B, L, heads, head_dim]``; flash-attn on CUDA half precision
    when installed, PyTorch SDPA otherwise. Returns ``[B, L, heads, head_dim]``."""
    if _flash_attn_func is not None and q_BLHD.is_cuda and q_BLHD.dtype in (torch.float16, torch.bfloat16):
        return _flash_attn_func(q_BLHD, k_BLHD, v_BLHD)
    out = F.scaled_dot_product_attention(
        q_BLHD.transpose(1, 2), k_BLHD.transpose(1, 2), v_BLHD.transpose(1, 2)
    )
    return out.transpose(1, 2)


class WanRMSNorm(nn.Module):
    """RMS norm over the last dim in float32 (Wan's ``WanRMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class WanLayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32, returned in the input dtype (Wan's ``WanLayerNorm``)."""

    def __init__(self, dim: int, eps: float, elementwise_affine: bool = False) -> None:
        super().__init__(dim, eps=eps, elementwise_affine=elementwise_affine)

    def forward(self, x: Tensor) -> Tensor:
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).type_as(x)


def rope_cos_sin(
    head_dim: int, grid_THW: tuple[int, int, int], device: torch.device
) -> tuple[Tensor, Tensor]:
    """3-D rotary angles for a ``T×H×W`` token grid: the head dim's pairs split time / height / width as
    ``d - 4(d//6)``, ``2(d//6)``, ``2(d//6)`` (Wan's ``rope_params``). Returns cos, sin ``[L, d/2]``."""
    t, h, w = grid_THW
    dims = (head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6), 2 * (head_dim // 6))
    parts = []
    for n, axis_dim in zip((t, h, w), dims, strict=True):
        inv = 1.0 / torch.pow(
            10000.0, torch.arange(0, axis_dim, 2, dtype=torch.float64, device=device) / axis_dim
        )
        parts.append(torch.outer(torch.arange(n, dtype=torch.float64, device=device), inv))
    ang_L = torch.cat(
        [
            parts[0][:, None, None, :].expand(t, h, w, -1),
            parts[1][None, :, None, :].expand(t, h, w, -1),
            parts[2][None, None, :, :].expand(t, h, w, -1),
        ],
        dim=-1,
    ).reshape(t * h * w, -1)
    return ang_L.cos().float(), ang_L.sin().float()


def apply_rope(x_BLHD: Tensor, cos_LD2: Tensor, sin_LD2: Tensor) -> Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` in float32 (Wan rotates complex pairs in float64)."""
    x = x_BLHD.float().unflatten(-1, (-1, 2))
    x1, x2 = x[..., 0], x[..., 1]
    cos, sin = cos_LD2[None, :, None, :], sin_LD2[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x_BLHD)


class WanSelfAttention(nn.Module):
    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.num_heads = cfg.num_heads
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm_q = WanRMSNorm(d, cfg.eps) if cfg.qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(d, cfg.eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x_BLD: Tensor, rope: tuple[Tensor, Tensor], segments: tuple[int, ...] | None = None) -> Tensor:
        """``segments``: token counts of windows packed along L, each attending only to itself."""
        q = apply_rope(self.norm_q(self.q(x_BLD)).unflatten(-1, (self.num_heads, -1)), *rope)
        k = apply_rope(self.norm_k(self.k(x_BLD)).unflatten(-1, (self.num_heads, -1)), *rope)
        v = self.v(x_BLD).unflatten(-1, (self.num_heads, -1))
        k, v = k.type_as(q), v.type_as(q)
        if segments is None:
            out = attention(q, k, v)
        else:  # one attention per window: no mask, no padding
            out = torch.cat([attention(*qkv) for qkv in zip(q.split(segments, 1), k.split(segments, 1),
                                                            v.split(segments, 1), strict=True)], dim=1)
        return self.o(out.flatten(2).type_as(x_BLD))


class WanI2VCrossAttention(nn.Module):
    """Cross-attention to the text tokens plus a parallel one to the CLIP image tokens, summed."""

    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.num_heads = cfg.num_heads
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.k_img, self.v_img = nn.Linear(d, d), nn.Linear(d, d)
        self.norm_q = WanRMSNorm(d, cfg.eps) if cfg.qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(d, cfg.eps) if cfg.qk_norm else nn.Identity()
        self.norm_k_img = WanRMSNorm(d, cfg.eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x_BLD: Tensor, text_BND: Tensor, image_BMD: Tensor) -> Tensor:
        h = self.num_heads
        q = self.norm_q(self.q(x_BLD)).unflatten(-1, (h, -1))
        k = self.norm_k(self.k(text_BND)).unflatten(-1, (h, -1))
        v = self.v(text_BND).unflatten(-1, (h, -1))
        k_img = self.norm_k_img(self.k_img(image_BMD)).unflatten(-1, (h, -1))
        v_img = self.v_img(image_BMD).unflatten(-1, (h, -1))
        out = attention(q, k, v).flatten(2) + attention(q, k_img, v_img).flatten(2)
        return self.o(out)


class AudioCrossAttention(nn.Module):
    """Per latent frame, that frame's video tokens attend to that frame's audio tokens (no rotary, no
    q/k norm: the single-person ``SingleStreamAttention`` of InfiniteTalk, built with qk_norm=False)."""

    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q_linear = nn.Linear(cfg.dim, cfg.dim)
        self.kv_linear = nn.Linear(cfg.audio_output_dim, 2 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x_BLD: Tensor, audio_BTMC: Tensor) -> Tensor:
        b, n_t = audio_BTMC.shape[:2]
        x = x_BLD.reshape(b * n_t, -1, x_BLD.shape[-1])  # tokens are frame-major: (T H W)
        q = self.q_linear(x).unflatten(-1, (self.num_heads, -1))
        kv = self.kv_linear(audio_BTMC.flatten(0, 1)).unflatten(-1, (2, self.num_heads, -1))
        out = attention(q, kv[:, :, 0], kv[:, :, 1]).flatten(2)
        return self.proj(out).reshape(x_BLD.shape)


class WanAvatarBlock(nn.Module):
    """Self-attn (modulated) → text/image cross-attn → audio cross-attn → FFN (modulated)."""

    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.norm1 = WanLayerNorm(d, cfg.eps)
        self.self_attn = WanSelfAttention(cfg)
        self.norm3 = (
            WanLayerNorm(d, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        )
        self.cross_attn = WanI2VCrossAttention(cfg)
        self.norm_x = (
            WanLayerNorm(d, cfg.eps, elementwise_affine=True) if cfg.norm_input_visual else nn.Identity()
        )
        self.audio_cross_attn = AudioCrossAttention(cfg)
        self.norm2 = WanLayerNorm(d, cfg.eps)
        self.ffn = nn.Sequential(
            nn.Linear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, d)
        )
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)

    def forward(
        self,
        x_BLD: Tensor,
        e_B6D: Tensor,
        rope: tuple[Tensor, Tensor],
        text_BND: Tensor,
        image_BMD: Tensor,
        audio_BTMC: Tensor | None,
        segments: tuple[int, ...] | None = None,
    ) -> Tensor:
        dtype = x_BLD.dtype
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.float() + e_B6D.float()).chunk(
            6, dim=1
        )
        y = self.self_attn((self.norm1(x_BLD).float() * (1 + scale1) + shift1).to(dtype), rope, segments)
        x_BLD = (x_BLD.float() + y.float() * gate1).to(dtype)
        x_BLD = x_BLD + self.cross_attn(self.norm3(x_BLD), text_BND, image_BMD)
        if audio_BTMC is not None:
            x_BLD = x_BLD + self.audio_cross_attn(self.norm_x(x_BLD), audio_BTMC.to(dtype))
        y = self.ffn((self.norm2(x_BLD).float() * (1 + scale2) + shift2).to(dtype))
        return (x_BLD.float() + y.float() * gate2).to(dtype)


class AudioProjection(nn.Module):
    """wav2vec2 windows per video frame → ``audio_context_tokens`` tokens per latent frame.

    Input ``audio_BFWLC``: for each of the ``F = 1 + vae_scale·(T−1)`` video frames of the chunk, the
    ``W = audio_window`` wav2vec2 frames centred on it, all ``L`` hidden layers, ``C`` channels. The first
    latent frame sees its one video frame's window (``proj1``); each later latent frame sees its
    ``vae_scale`` video frames' windows trimmed to ``W + vae_scale − 1`` distinct wav2vec2 frames
    (first frame's left half, the middle frames' centres, the last frame's right half; ``proj1_vf``),
    as in InfiniteTalk ``WanModel.forward`` / ``AudioProjModel``.
    """

    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        per_frame = cfg.audio_layers * cfg.audio_channels
        self.proj1 = nn.Linear(cfg.audio_window * per_frame, cfg.audio_intermediate_dim)
        self.proj1_vf = nn.Linear(
            (cfg.audio_window + cfg.vae_scale - 1) * per_frame, cfg.audio_intermediate_dim
        )
        self.proj2 = nn.Linear(cfg.audio_intermediate_dim, cfg.audio_intermediate_dim)
        self.proj3 = nn.Linear(cfg.audio_intermediate_dim, cfg.audio_context_tokens * cfg.audio_output_dim)
        # upstream: nn.LayerNorm (eps 1e-5) applied under float32 autocast
        self.norm = WanLayerNorm(cfg.audio_output_dim, 1e-5, True) if cfg.norm_output_audio else nn.Identity()

    def forward(self, audio_BFWLC: Tensor) -> Tensor:
        cfg = self.cfg
        b, f = audio_BFWLC.shape[:2]
        if (f - 1) % cfg.vae_scale or audio_BFWLC.shape[2:] != (
            cfg.audio_window,
            cfg.audio_layers,
            cfg.audio_channels,
        ):
            raise ValueError(
                f"audio windows have shape {tuple(audio_BFWLC.shape)}; expected [B, 1 + {cfg.vae_scale}·(T−1), "
                f"{cfg.audio_window}, {cfg.audio_layers}, {cfg.audio_channels}] (one window per video frame)"
            )
        mid = cfg.audio_window // 2
        first = audio_BFWLC[:, :1]
        later = audio_BFWLC[:, 1:].unflatten(1, (-1, cfg.vae_scale))  # B, T-1, vae_scale, W, L, C
        later = torch.cat(
            [later[:, :, 0, : mid + 1], later[:, :, 1:-1, mid], later[:, :, -1, mid:]], dim=2
        )  # B, T-1, W + vae_scale - 1, L, C
        tok_first = torch.relu(self.proj1(first.flatten(2)))
        tok_later = torch.relu(self.proj1_vf(later.flatten(2)))
        h = torch.relu(self.proj2(torch.cat([tok_first, tok_later], dim=1)))
        tokens = self.proj3(h).unflatten(-1, (cfg.audio_context_tokens, cfg.audio_output_dim))
        return self.norm(tokens)  # B, T, M, C


class WanHead(nn.Module):
    """Output norm (modulated by the time embedding) and projection to patch pixels."""

    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        self.norm = WanLayerNorm(cfg.dim, cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.out_dim * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def forward(self, x_BLD: Tensor, e_BD: Tensor) -> Tensor:
        shift, scale = (self.modulation.float() + e_BD.float()[:, None]).chunk(2, dim=1)
        return _linear32(self.norm(x_BLD).float() * (1 + scale) + shift, self.head)


class ImageProjection(nn.Module):
    """CLIP tokens → DiT width (Wan's ``MLPProj``: LayerNorm, Linear, GELU, Linear, LayerNorm)."""

    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        self.proj = nn.Sequential(
            nn.LayerNorm(cfg.image_dim),
            nn.Linear(cfg.image_dim, cfg.image_dim),
            nn.GELU(),
            nn.Linear(cfg.image_dim, cfg.dim),
            nn.LayerNorm(cfg.dim),
        )

    def forward(self, clip_BMC: Tensor) -> Tensor:
        return self.proj(clip_BMC)


class WanAvatarDiT(nn.Module):
    """Velocity model ``v(x_t, t | known frames, text, image, audio)`` of InfiniteTalk / FlashTalk."""

    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.patch_embedding = nn.Conv3d(cfg.in_dim, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d)
        )
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList([WanAvatarBlock(cfg) for _ in range(cfg.num_layers)])
        self.head = WanHead(cfg)
        self.img_emb = ImageProjection(cfg)
        self.audio_proj = AudioProjection(cfg)

    def embed_context(self, text_BND: Tensor, clip_BMC: Tensor) -> tuple[Tensor, Tensor]:
        """umT5 states (zero-padded here to ``text_len``, as Wan does) and CLIP penultimate-layer tokens →
        the blocks' cross-attention context. Once per job (per CFG branch)."""
        n = text_BND.shape[1]
        if n > self.cfg.text_len:
            raise ValueError(
                f"text context has {n} tokens; at most text_len={self.cfg.text_len} (truncate the prompt)"
            )
        dtype = self.patch_embedding.weight.dtype
        text_BND = F.pad(text_BND.to(dtype), (0, 0, 0, self.cfg.text_len - n))
        return self.text_embedding(text_BND), self.img_emb(clip_BMC.to(dtype))

    def audio_tokens(self, audio_BFWLC: Tensor) -> Tensor:
        """Audio windows per video frame → ``[B, T, audio_context_tokens, audio_output_dim]``."""
        return self.audio_proj(audio_BFWLC.to(self.patch_embedding.weight.dtype))

    def forward(
        self,
        latents_BCTHW: Tensor,
        cond_BCTHW: Tensor,
        timestep_B: Tensor,
        context: tuple[Tensor, Tensor],
        audio_BTMC: Tensor | None,
        windows: tuple[int, ...] | None = None,
    ) -> Tensor:
        """One velocity evaluation.

        ``latents_BCTHW``: the noisy latents (``out_dim`` channels); ``cond_BCTHW``: the I2V condition
        (4 mask channels + the VAE latents of known frames); ``context``: from :meth:`embed_context`;
        ``audio_BTMC``: from :meth:`audio_tokens`, or ``None`` to run without the audio branch (the
        plain Wan2.1-I2V model). Returns float32 velocity shaped like ``latents_BCTHW``.

        ``windows``: latent frame counts of several windows packed along T (the batched steps of
        ``pipeline.stage.BatchedStage``): each window's rotary frame positions start at 0 and its
        tokens attend only to its own in self-attention; every other layer is per token (the
        cross-attentions: the same text/image context, the audio per latent frame), so each window's
        velocity is the one it gets alone.
        """
        cfg = self.cfg
        x = torch.cat([latents_BCTHW, cond_BCTHW], dim=1)
        if x.shape[1] != cfg.in_dim:
            raise ValueError(
                f"latents ({latents_BCTHW.shape[1]} ch) + cond ({cond_BCTHW.shape[1]} ch) = {x.shape[1]} channels; "
                f"the DiT expects in_dim={cfg.in_dim} (16 noise + 4 mask + 16 known-frame latents)"
            )
        b, _, t, h, w = x.shape
        pt, ph, pw = cfg.patch_size
        grid = (t // pt, h // ph, w // pw)
        if audio_BTMC is not None and audio_BTMC.shape[1] != grid[0]:
            raise ValueError(
                f"audio tokens cover {audio_BTMC.shape[1]} latent frames; the latents have {grid[0]}"
            )
        segments: tuple[int, ...] | None = None
        if windows is None:
            rope = rope_cos_sin(cfg.head_dim, grid, x.device)
        else:
            if sum(windows) != t or any(n % pt for n in windows):
                raise ValueError(f"windows {windows} must split the {t} latent frames (multiples of {pt})")
            parts = [rope_cos_sin(cfg.head_dim, (n // pt, grid[1], grid[2]), x.device) for n in windows]
            rope = (torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]))
            segments = tuple(n // pt * grid[1] * grid[2] for n in windows)
        param_dtype = self.patch_embedding.weight.dtype
        x_BLD = self.patch_embedding(x.to(param_dtype)).flatten(2).transpose(1, 2)

        half = cfg.freq_dim // 2
        freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=x.device) / half)
        sinus = torch.outer(timestep_B.to(torch.float64), freqs)
        t_emb = torch.cat([sinus.cos(), sinus.sin()], dim=1).float()
        # Wan runs the time MLP, the modulation and the head under float32 autocast: so do we.
        e_BD = _linear32(F.silu(_linear32(t_emb, self.time_embedding[0])), self.time_embedding[2])
        e_B6D = _linear32(F.silu(e_BD), self.time_projection[1]).unflatten(1, (6, cfg.dim))

        text_BND, image_BMD = context
        for block in self.blocks:
            x_BLD = block(x_BLD, e_B6D, rope, text_BND.to(param_dtype), image_BMD.to(param_dtype), audio_BTMC,
                          segments)

        out = self.head(x_BLD, e_BD)
        out = out.reshape(b, *grid, pt, ph, pw, cfg.out_dim)
        return torch.einsum("bfhwpqrc->bcfphqwr", out).reshape(b, cfg.out_dim, t, h, w)


def _linear32(x: Tensor, layer: nn.Module) -> Tensor:
    assert isinstance(layer, nn.Linear)
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.weight.float(), bias)
