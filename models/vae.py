"""Causal video VAE with a streaming decoder (no temporal compression: one latent frame per video frame).

Who calls what:
* the pipeline encodes the reference image once per job (``encode`` on a one-frame video) and decodes
  every emitted chunk with ``decode(z, cache)``, keeping only the returned cache between chunks;
* training code uses ``encode_moments`` (mean, log-variance) and ``decode``.

Why it streams exactly: the encoder and every decoder layer outside the latent resolution work frame by
frame (group norms are taken per frame); the only temporal mixing is in causal convolutions at the
latent resolution, and each of them keeps its last ``kernel - 1`` input frames as its cache. Decoding a
sequence in any chunk split, feeding each chunk the cache of the previous one, therefore gives the same
frames as decoding it whole. The cache is a list of plain tensors, a few latent-sized frames per causal
layer, so it can be snapshotted for resume. Callers must not keep references to the input ``z`` through
the cache: the cache tensors are copies.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.layers import ReferenceWindowAttention, WindowKeys
from models.presets import VAEConfig


def pool_frames(x_BCThw: Tensor, factor: int) -> Tensor:
    """Average pool each frame of ``(B, C, T, H, W)`` by ``factor`` (sides divisible by it): the
    low-res latent of :meth:`CausalVAE.to_lowres`, and the pooled frames and weights the VAE's
    scale-equivariance loss compares (``models.training.train_vae.vae_loss``)."""
    B, C, T, H, W = x_BCThw.shape
    frames = F.avg_pool2d(x_BCThw.transpose(1, 2).reshape(B * T, C, H, W), factor)
    return frames.reshape(B, T, C, H // factor, W // factor).transpose(1, 2)


def _groups(c: int) -> int:
    for g in (8, 4, 2, 1):
        if c % g == 0:
            return g
    return 1


def _channels_last(m: nn.ModuleList) -> nn.ModuleList:
    """Store 4D conv weights channels-last (``load_state_dict`` copies into them and keeps the layout)."""
    for p in m.parameters():
        if p.dim() == 4:
            p.data = p.data.contiguous(memory_format=torch.channels_last)
    return m


class ResBlock2d(nn.Module):
    """Per-frame residual block on ``(N, C, H, W)`` (N = batch x frames)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(_groups(cin), cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(_groups(cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x), inplace=True))
        h = self.conv2(F.silu(self.norm2(h), inplace=True))
        return self.skip(x) + h


class CausalConv3d(nn.Module):
    """A 3D convolution that only looks at the current and the ``kt - 1`` previous frames.

    Stored as a 2D convolution over the channel-stacked ``kt`` frames (the same function as a causal
    ``Conv3d``, faster on CPU). Input and output are ``(B, T, C, H, W)``; the cache holds the last
    ``kt - 1`` input frames ``(B, kt - 1, C, H, W)``; with no cache the past is zeros.
    """

    def __init__(self, cin: int, cout: int, kt: int, k: int) -> None:
        super().__init__()
        self.kt = kt
        self.cin = cin
        self.conv = nn.Conv2d(cin * kt, cout, k, padding=k // 2)

    def forward(self, x_BTCHW: Tensor, cache: Tensor | None) -> tuple[Tensor, Tensor]:
        B, T, C, H, W = x_BTCHW.shape
        if cache is None:
            cache = x_BTCHW.new_zeros(B, self.kt - 1, C, H, W)
        elif cache.shape != (B, self.kt - 1, C, H, W):
            raise ValueError(
                f"decoder cache entry has shape {tuple(cache.shape)}, expected {(B, self.kt - 1, C, H, W)}: "
                "pass the cache returned by the previous decode() of the same stream (or None to start)"
            )
        xp = torch.cat([cache, x_BTCHW], dim=1)
        stacked = torch.cat([xp[:, i : i + T] for i in range(self.kt)], dim=2)  # (B, T, C*kt, H, W)
        out = self.conv(stacked.reshape(B * T, C * self.kt, H, W))
        new_cache = xp[:, T:].clone()  # the last kt-1 frames; clone so the chunk is not kept alive
        return out.reshape(B, T, -1, H, W), new_cache


class CausalResBlock(nn.Module):
    """Residual block at the latent resolution: per-frame 3x3 conv, then a causal temporal conv."""

    num_cache = 1

    def __init__(self, c: int, kt: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(_groups(c), c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.norm2 = nn.GroupNorm(_groups(c), c)
        self.tconv = CausalConv3d(c, c, kt, 1)

    def forward(self, x_BTCHW: Tensor, cache: list[Tensor | None]) -> tuple[Tensor, list[Tensor]]:
        B, T, C, H, W = x_BTCHW.shape
        h = self.conv1(F.silu(self.norm1(x_BTCHW.reshape(B * T, C, H, W))))
        h = F.silu(self.norm2(h), inplace=True).reshape(B, T, C, H, W)
        h, c0 = self.tconv(h, cache[0])
        return x_BTCHW + h, [c0]


class Encoder(nn.Module):
    """Per-frame encoder: RGB ``(N, 3, H, W)`` -> moments ``(N, 2*latent, H/f, W/f)``."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        ch = cfg.enc_channels
        blocks: list[nn.Module] = [
            nn.PixelUnshuffle(2),
            nn.Conv2d(cfg.image_channels * 4, ch[0], 3, padding=1),
        ]
        for i in range(1, len(ch)):
            blocks.append(nn.Conv2d(ch[i - 1], ch[i], 3, stride=2, padding=1))
            blocks.append(ResBlock2d(ch[i], ch[i]))
        blocks.append(ResBlock2d(ch[-1], ch[-1]))
        blocks.append(
            nn.Sequential(
                nn.GroupNorm(_groups(ch[-1]), ch[-1]),
                nn.SiLU(),
                nn.Conv2d(ch[-1], 2 * cfg.latent_channels, 3, padding=1),
            )
        )
        self.blocks = _channels_last(nn.ModuleList(blocks))

    def forward(self, x: Tensor) -> Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        for b in self.blocks:
            x = b(x)
        return x


class Upsample(nn.Module):
    """x2 up: a 2x2 stride-2 transposed conv (the function of a 1x1 conv + pixel shuffle, one fast
    kernel on CPU), then a 3x3 conv at the new resolution."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.expand = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.silu(self.expand(x), inplace=True))


class DecoderReference(NamedTuple):
    """What a decoder that reads the reference reads of it (``CausalVAE.reference_features``), one row
    per stream: its window's source, the reference's features and pixels at the window's level (the map,
    or the window's keys gathered from it), and the pixels its warp copies."""

    source: Tensor | WindowKeys
    rgb: Tensor  # (B, 3, H, W) in [-1, 1]


class Decoder(nn.Module):
    """Streaming decoder. ``blocks[0]`` is the causal input conv, then the causal latent blocks, then the
    per-frame up-sampling path; ``num_cache`` causal layers each keep one cache tensor."""

    # frames per pass of the per-frame path: 4 runs tiny's decoder faster than a whole 16-frame
    # emission at once on 2 CPU threads (plain 1.27x, reading the reference 1.16x; 8 is as fast, 1 and 2
    # slower) and cuts its temporaries 4x
    FRAMES_PER_PASS = 4

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        ch = cfg.dec_channels
        kt = cfg.temporal_kernel
        self.conv_in = CausalConv3d(cfg.latent_channels, ch[-1], kt, 3)
        self.causal = nn.ModuleList([CausalResBlock(ch[-1], kt) for _ in range(cfg.latent_res_blocks)])
        up: list[nn.Module] = []
        for i in range(len(ch) - 1, 0, -1):
            up.append(Upsample(ch[i], ch[i - 1]))
            for _ in range(cfg.dec_blocks[i - 1]):
                up.append(ResBlock2d(ch[i - 1], ch[i - 1]))
        up.append(
            nn.Sequential(
                nn.GroupNorm(_groups(ch[0]), ch[0]),
                nn.SiLU(),
                nn.ConvTranspose2d(ch[0], cfg.image_channels, 2, stride=2),
            )
        )
        # channels-last: oneDNN convolutions at 64..256 px run 2-4x faster without layout reorders
        self.up = _channels_last(nn.ModuleList(up))
        self.num_cache = 1 + len(self.causal)
        # the reference window sits after the first up-sampling level's blocks (twice the latent resolution)
        self.ref_at = 1 + (cfg.dec_blocks[-1] if cfg.dec_blocks else 0)
        self.ref_unshuffle = cfg.factor // 2
        self.image_channels = cfg.image_channels
        self.ref_window: ReferenceWindowAttention | None = None
        if cfg.ref_window_radius > 0:
            if len(ch) < 2:
                raise ValueError(f"VAEConfig.ref_window_radius={cfg.ref_window_radius}: the reference window runs at "
                                 f"twice the latent resolution, which factor {cfg.factor} does not have: use factor >= 4 "
                                 "or ref_window_radius=0")
            self.ref_window = ReferenceWindowAttention(
                ch[-2], cfg.ref_window_dim, cfg.ref_window_hidden, cfg.ref_window_radius,
                ref_channels=ch[-2] + cfg.image_channels * self.ref_unshuffle**2)
        self.ref_gate: nn.Conv2d | None = None
        if cfg.ref_warp:
            if self.ref_window is None:
                raise ValueError("VAEConfig.ref_warp: the warp follows where the reference window read: set "
                                 "ref_window_radius >= 1 too")
            self.ref_gate = nn.Conv2d(ch[-2], 1, 3, padding=1)  # starts at zero: the plain decoder's output
            for t in self.ref_gate.parameters():
                nn.init.zeros_(t)
        self.rigid = cfg.ref_warp and cfg.ref_warp_rigid  # how the warp reads: nothing to say without it

    @property
    def blocks(self) -> list[nn.Module]:
        return [self.conv_in, *self.causal, *self.up]

    def _latent_level(self, z_BTCHW: Tensor, old: list[Tensor | None]) -> tuple[Tensor, list[Tensor]]:
        x, c0 = self.conv_in(z_BTCHW, old[0])
        new = [c0]
        for i, blk in enumerate(self.causal):
            x, c = blk(x, [old[1 + i]])
            new.extend(c)
        B, T, C, H, W = x.shape
        return x.reshape(B * T, C, H, W).contiguous(memory_format=torch.channels_last), new

    def reference_features(self, z_B1CHW: Tensor, rgb_B3HW: Tensor) -> DecoderReference:
        """What the reference window reads: the reference latent decoded (as the first frame of a stream)
        up to the window's level, beside the reference's pixels folded to that resolution; and the pixels
        the warp copies. Without gradients (a render: many frames of one reference) the window's keys
        gathered from that map once; with them (training: one frame per reference) the map itself
        (``ReferenceWindowAttention.forward`` says why)."""
        assert self.ref_window is not None
        y = self._latent_level(z_B1CHW, [None] * self.num_cache)[0]
        for blk in self.up[: self.ref_at]:
            y = blk(y)
        rgb = rgb_B3HW.to(y.dtype)
        features = torch.cat([y, F.pixel_unshuffle(rgb, self.ref_unshuffle)], dim=1)
        return DecoderReference(features if torch.is_grad_enabled() else self.ref_window.read(features), rgb)

    def forward(self, z_BTCHW: Tensor, cache: list[Tensor] | None,
                reference: DecoderReference | None = None, offsets: list[Tensor] | None = None,
                ) -> tuple[Tensor, list[Tensor]]:
        if cache is not None and len(cache) != self.num_cache:
            raise ValueError(
                f"decoder cache has {len(cache)} entries, expected {self.num_cache}: pass the cache "
                "returned by the previous decode() of the same stream (or None to start)"
            )
        if self.ref_window is not None and reference is None:
            raise ValueError(
                f"this decoder reads the reference (VAEConfig.ref_window_radius={self.ref_window.radius}): pass "
                "reference=vae.reference_features(reference RGB), computed once per stream"
            )
        old: list[Tensor | None] = list(cache) if cache is not None else [None] * self.num_cache
        B, T = z_BTCHW.shape[:2]
        y, new = self._latent_level(z_BTCHW, old)
        # the up-sampling path is per frame: run it a few frames at a time, so its temporaries (16
        # channels at full resolution, the window's attention) follow FRAMES_PER_PASS, not the emission
        y_BTCHW, g = y.view(B, T, *y.shape[1:]), self.FRAMES_PER_PASS
        read: list[Tensor] | None = [] if offsets is not None else None  # each pass's, when asked
        parts = [self._up(y_BTCHW[:, t:t + g].reshape(-1, *y.shape[1:]).contiguous(memory_format=torch.channels_last),
                          reference, min(g, T - t), read) for t in range(0, T, g)]
        if offsets is not None and read:  # only a decoder whose warp copies the reference reads
            offsets.append(torch.cat([o.view(B, -1, *o.shape[1:]) for o in read], dim=1))
        return torch.cat([part.view(B, -1, *part.shape[1:]) for part in parts], dim=1), new

    def _up(self, y: Tensor, reference: DecoderReference | None, T: int, offsets: list[Tensor] | None = None) -> Tensor:
        """The per-frame path, from the latent level's features ``(B*T, C, h, w)`` to RGB; ``offsets``
        gets where the warp read (``(B*T, 2, h', w')``, cells of the window's level; with
        ``VAEConfig.ref_warp_rigid`` the fitted read the warp copies from)."""
        blend: tuple[Tensor, Tensor] | None = None  # the warp's gate and the warped reference
        for i, blk in enumerate(self.up):
            if i == self.ref_at and reference is not None and self.ref_window is not None:
                if self.ref_gate is None:
                    y = self.ref_window(y, reference.source)
                else:
                    y, offset, spread = self.ref_window.forward_with_offset(y, reference.source)
                    if self.rigid:
                        offset = rigid_read(offset, spread)
                    blend = self.ref_gate(y), self._warp(reference.rgb, offset, T)
                    if offsets is not None:
                        offsets.append(offset)
            y = blk(y)
        if blend is not None:
            gate, warped = blend
            y = y + F.interpolate(gate, size=y.shape[-2:], mode="bilinear").clamp(0.0, 1.0) * (warped - y)
        return y

    def _warp(self, rgb_B3HW: Tensor, offset_N2hw: Tensor, T: int) -> Tensor:
        """The reference's pixels warped to each frame: output pixel p takes the reference at p + the
        window's offset there (in cells of the window's level, bilinear between cells and between pixels)."""
        p = self.ref_unshuffle
        rgb = rgb_B3HW.repeat_interleave(T, dim=0)
        N, _, H, W = rgb.shape
        shift = F.interpolate(offset_N2hw * p, size=(H, W), mode="bilinear")  # (N, 2, H, W): dy, dx in pixels
        ys = torch.arange(H, dtype=rgb.dtype, device=rgb.device)[:, None] + 0.5 + shift[:, 0]
        xs = torch.arange(W, dtype=rgb.dtype, device=rgb.device)[None, :] + 0.5 + shift[:, 1]
        grid = torch.stack([xs / W * 2 - 1, ys / H * 2 - 1], dim=-1)  # (N, H, W, 2): x, y in [-1, 1]
        return F.grid_sample(rgb, grid, mode="bilinear", padding_mode="border", align_corners=False)


RIGID_SPREAD_FLOOR = 0.1  # cells²: a cell counts 1 / (its attention's spread + this) in the fit and the vote
RIGID_ROBUST_CELLS = 0.5  # cells: a cell this far off the head's map counts half in its next fit (Cauchy)
RIGID_MARGIN = 0.25  # cells²: how much better the head's map must explain a neighbourhood than standing still
RIGID_ITERATIONS = 4  # fit-and-assign rounds
RIGID_HEAD_SHARE = 0.1  # a head holds at least this share of the frame's cells (tiny's: about a third)


def rigid_read(offset_N2hw: Tensor, spread_N1hw: Tensor) -> Tensor:
    """A warp's read made rigid, per frame: two layers, the head, moved by a similarity map (dy, dx,
    rotation, scale about the map's centre; 4 parameters), and what stands still (offset 0). Each round
    fits the head's map by weighted least squares to the reads of the cells it holds (each cell weighted
    by how sure its attention is, ``spread``: its variance in cells², ``forward_with_offset``, and less
    the farther it lies off the map: the mouth and eyes move on their own), then gives each cell to the
    head where, over its 3x3 neighbourhood, the map explains the reads better than standing still by
    :data:`RIGID_MARGIN` (so a flat cell whose read jitters goes with its neighbours, and a head that did
    not move stays in place rather than the map chasing the jitter), and only when those cells are at
    least :data:`RIGID_HEAD_SHARE` of the frame (a mouth moving alone under a still head is not one).
    The first fit takes every cell; each cell then reads by its layer. Why: the per-cell read jitters
    by a pixel or two where the attention spreads (flat skin) and beside what moves (the nostrils over an
    opening mouth), and a small feature copied across that jitter comes out bent (docs/quality.md).
    Differentiable in the reads."""
    dtype = offset_N2hw.dtype
    o, spread = offset_N2hw.float(), spread_N1hw.float()
    N, _, h, w = o.shape
    ys = torch.arange(h, dtype=o.dtype, device=o.device) - (h - 1) / 2
    xs = torch.arange(w, dtype=o.dtype, device=o.device) - (w - 1) / 2
    y, x = ys.view(1, h, 1), xs.view(1, 1, w)
    sy, sx = y + o[:, 0], x + o[:, 1]  # (N, h, w): where each cell read
    sure = 1.0 / (spread[:, 0] + RIGID_SPREAD_FLOOR)
    still = o.pow(2).sum(dim=1)  # each cell's squared distance from reading in place
    weight = sure

    def total(t: Tensor) -> Tensor:
        return t.sum(dim=(1, 2))

    for _ in range(RIGID_ITERATIONS):
        # the map sy = a y + b x + ty, sx = a x - b y + tx by weighted least squares: its normal equations
        # written out (the similarity's are sparse), solved per frame
        sw, swy, swx = total(weight), total(weight * y), total(weight * x)
        swr = total(weight * (y * y + x * x))
        z0 = torch.zeros_like(sw)
        lhs = torch.stack([torch.stack([swr, z0, swy, swx], -1), torch.stack([z0, swr, swx, -swy], -1),
                           torch.stack([swy, swx, sw, z0], -1), torch.stack([swx, -swy, z0, sw], -1)], dim=1)
        rhs = torch.stack([total(weight * (y * sy + x * sx)), total(weight * (x * sy - y * sx)),
                           total(weight * sy), total(weight * sx)], dim=-1)
        a, b, ty, tx = torch.linalg.solve(lhs + 1e-6 * torch.eye(4, dtype=o.dtype, device=o.device),
                                          rhs).unbind(dim=-1)
        fy = a.view(N, 1, 1) * y + b.view(N, 1, 1) * x + ty.view(N, 1, 1)
        fx = a.view(N, 1, 1) * x - b.view(N, 1, 1) * y + tx.view(N, 1, 1)
        miss = (fy - sy).pow(2) + (fx - sx).pow(2)  # squared distance from the head's map
        # the neighbourhood's sureness-weighted gain of the map over standing still, against its sureness
        votes = _box3(torch.stack([sure * (still - miss), sure], dim=1))
        head = votes[:, 0] > RIGID_MARGIN * votes[:, 1]  # (N, h, w): the cells the head holds
        held = head.flatten(1).float().mean(dim=1)
        head = head & (held >= RIGID_HEAD_SHARE).view(N, 1, 1)  # a few cells moving alone: a mouth, not a head
        if not bool(head.any()):  # no frame's head moved: every cell reads in place (later rounds would agree)
            return torch.zeros_like(offset_N2hw)
        weight = sure / (1.0 + miss / RIGID_ROBUST_CELLS**2) * head
    rigid = torch.stack([fy - y, fx - x], dim=1)
    return torch.where(head[:, None], rigid, torch.zeros_like(rigid)).to(dtype)


def _box3(t: Tensor) -> Tensor:
    """Each cell's sum over its 3x3 neighbourhood (zero beyond the map) of ``(..., h, w)``, separably:
    ``avg_pool2d`` took 1.4 ms a (4, 2, 64, 64) map against this one's 0.5 (one thread, loaded machine)."""
    p = F.pad(t, (1, 1, 1, 1))
    rows = p[..., :-2, :] + p[..., 1:-1, :] + p[..., 2:, :]
    return rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:]


class CausalVAE(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        if cfg.factor < 2 or 2 ** int(math.log2(cfg.factor)) != cfg.factor:
            raise ValueError(f"VAEConfig.factor={cfg.factor}: must be a power of two >= 2")
        levels = int(math.log2(cfg.factor))
        if (
            len(cfg.enc_channels) != levels
            or len(cfg.dec_channels) != levels
            or len(cfg.dec_blocks) != levels - 1
        ):
            raise ValueError(
                f"VAEConfig: factor {cfg.factor} needs {levels} enc_channels / dec_channels and {levels - 1} "
                f"dec_blocks, got {len(cfg.enc_channels)} / {len(cfg.dec_channels)} / {len(cfg.dec_blocks)}"
            )
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    @property
    def encoder_blocks(self) -> nn.ModuleList:
        return self.encoder.blocks

    @property
    def decoder_blocks(self) -> list[nn.Module]:
        return self.decoder.blocks

    def encode_moments(self, rgb_BCTHW: Tensor) -> tuple[Tensor, Tensor]:
        """Training entry: (mean, logvar), each ``(B, latent, T, H/f, W/f)``, already scaled."""
        B, C, T, H, W = rgb_BCTHW.shape
        f = self.cfg.factor
        if H % f or W % f:
            raise ValueError(f"encode: frame size {H}x{W} must be divisible by the VAE factor {f}")
        frames = rgb_BCTHW.transpose(1, 2).reshape(B * T, C, H, W)
        m = self.encoder(frames).reshape(B, T, 2 * self.cfg.latent_channels, H // f, W // f).transpose(1, 2)
        mean, logvar = m.chunk(2, dim=1)
        return mean * self.cfg.scaling, logvar.clamp(-30.0, 20.0)

    def encode(self, rgb_BCTHW: Tensor) -> Tensor:
        """RGB in [-1, 1] ``(B, 3, T, H, W)`` -> hr latents ``(B, latent, T, H/f, W/f)`` (the mean)."""
        return self.encode_moments(rgb_BCTHW)[0]

    def reference_features(self, rgb_B3HW: Tensor, z_BC1hw: Tensor | None = None) -> DecoderReference | None:
        """What a decoder that reads the reference (``cfg.ref_window_radius`` > 0) reads of it, from RGB
        in [-1, 1] ``(B, 3, H, W)``, to pass as ``decode(..., reference=)``; it depends on the reference
        alone, so compute it once per stream (its window keys are the costly part). ``z_BC1hw``: the reference's
        latent when the caller has it (``encode(rgb[:, :, None])``). None for a decoder without."""
        if self.decoder.ref_window is None:
            return None
        z = self.encode(rgb_B3HW[:, :, None]) if z_BC1hw is None else z_BC1hw
        return self.decoder.reference_features((z / self.cfg.scaling).transpose(1, 2), rgb_B3HW)

    def decode(
        self, z_BCThw: Tensor, cache: list[Tensor] | None = None, *, clamp: bool = True,
        reference: DecoderReference | None = None, offsets: list[Tensor] | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """Latents ``(B, latent, T, h, w)`` -> (RGB ``(B, 3, T, h*f, w*f)`` in [-1, 1], new cache).

        Pass ``cache=None`` for the first chunk of a stream and the returned cache for the next one.
        ``clamp=False`` keeps the raw output (for training losses). ``reference``:
        :meth:`reference_features` of the stream's reference (one per batch row), required by a decoder
        that reads it, ignored by one that does not. ``offsets``: a decoder whose warp copies the
        reference appends where it read it, ``(B, T, 2, h', w')`` (dy, dx) in cells of its window's level
        (``VAEConfig.factor // 2`` pixels), for a loss on them or a measurement (``bench.warp_error``).
        """
        z_BTChw = (z_BCThw / self.cfg.scaling).transpose(1, 2)
        rgb_BTCHW, new_cache = self.decoder(z_BTChw, cache, reference, offsets)
        rgb = rgb_BTCHW.transpose(1, 2)
        return (rgb.clamp(-1.0, 1.0) if clamp else rgb), new_cache

    def to_lowres(self, z_BCThw: Tensor, factor: int | None = None) -> Tensor:
        """hr latent -> low-res latent for the A2V DiT: per-frame average pool by ``factor``
        (default ``cfg.lowres_factor``)."""
        factor = factor or self.cfg.lowres_factor
        h, w = z_BCThw.shape[-2:]
        if h % factor or w % factor:
            raise ValueError(f"to_lowres: latent size {h}x{w} not divisible by lowres_factor={factor}")
        return pool_frames(z_BCThw, factor)
