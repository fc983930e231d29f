"""The Wan2.1 VAE — diffusers' ``AutoencoderKLWan`` — driven chunk by chunk with a caller-held cache.

diffusers' ``decode()`` / ``encode()`` clear the causal feature cache on every call, so a video decoded
in chunks would restart its causal convolutions at each chunk boundary. Here the same per-conv cache list
the diffusers decoder already takes (``feat_cache`` / ``feat_idx``) lives in a :class:`WanVAECache` that
the caller keeps in its rolling state: decoding latents chunk by chunk equals decoding them whole
(tested), and the causal first-frame rule holds across chunks: T latent frames → 1 + 4(T − 1) frames.

Who calls what: a family's decode stage calls :meth:`WanStreamingVAE.new_cache` once per job and
:meth:`WanStreamingVAE.decode_chunk` once per chunk, carrying the cache; its setup stage calls
:meth:`WanStreamingVAE.encode` for the reference (and, in the re-encode mode, boundary frames).
Latents here are in the *DiT's* normalised space: ``(z − latents_mean) / latents_std``, as Wan uses.
The cache holds at most 2 frames per causal conv (a few MB at 480p); drop it when the job ends.

Memory on CPU: torch's CPU ``Conv3d`` for small channel counts (its ``Slow3d`` backend; diffusers'
``WanCausalConv3d`` is an ``nn.Conv3d``) unfolds its input into a column buffer of
``C_in × kT·kH·kW × output size`` floats — 54 MiB for a 2 MiB output at 128×128 — and that transient,
not the activations, set the decode's high-water mark. So inside :meth:`WanStreamingVAE.decode_chunk`
and :meth:`WanStreamingVAE.encode` every ``nn.Conv3d`` of the wrapped VAE whose column buffer would
exceed :data:`CONV_COLUMN_BUDGET_BYTES` computes its output in strips of rows instead
(:func:`strip_conv3d`): the same values (tested to 1e-5; bit-equal with this torch's MKL), one call's
transient under the budget whatever the frame size. The wrapped ``AutoencoderKLWan`` used directly
(diffusers' own ``decode``, as ``bench.peer``'s diffusers side does) is unchanged: the budget holds
only while the wrapper's methods run (a context variable).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from torch import Tensor, nn

from models.wan.checkpoint import fill_module, read_pth, state_dict_entries

VAE_FILE = "Wan2.1_VAE.pth"

CONV_COLUMN_BUDGET_BYTES = 2 << 20
"""Largest column buffer (bytes) one CPU ``Conv3d`` call of the wrapped VAE may unfold; a larger call is
split (:func:`strip_conv3d`). The default of :class:`WanStreamingVAE`'s ``conv_budget_bytes``. Measured
on one tiny-128 emission (4 latent frames, default glibc malloc, heap trimmed before the call): the
call's VmHWM above its starting RSS is ~55 MiB at 1-2 MiB, ~75 at 4, 70-140 at 8 (glibc keeps more of
the larger strips' heap), 130-240 unsplit; every budget from 0.5 to 8 MiB decodes in ~0.5-0.7x the
unsplit time (smaller buffers, fewer fresh pages)."""

_UNFOLDING_BACKENDS = frozenset({"Slow3d", "SlowDilated3d"})  # torch's CPU conv3d paths that unfold
_conv_budget: ContextVar[int | None] = ContextVar("wan_vae_conv_budget", default=None)


@contextmanager
def conv_column_budget(budget_bytes: int | None) -> Iterator[None]:
    """While inside (this thread / task): convs set up by :func:`install_strip_conv3d` keep their CPU
    column buffer under ``budget_bytes``; ``None`` = plain convs. Outside any such block they are plain."""
    token = _conv_budget.set(budget_bytes)
    try:
        yield
    finally:
        _conv_budget.reset(token)


def strip_tiles(unit_bytes: int, out_thw: tuple[int, int, int], budget_bytes: int) -> tuple[int, int, int]:
    """Output tile ``(t, h, w)`` whose column buffer (``unit_bytes`` per output position) fits
    ``budget_bytes``: whole frames in strips of rows; if one row of every frame is over, rows of fewer
    frames; then pieces of one row. The floor is one output position (``unit_bytes``: C_in · kernel).
    Sizes are balanced (7 rows in strips of 4 + 3, not 6 + 1): no sliver of a strip at the end."""
    t, h, w = out_thw
    if (rows := budget_bytes // (unit_bytes * t * w)) >= 1:
        tile = (t, min(h, rows), w)
    elif (frames := budget_bytes // (unit_bytes * w)) >= 1:
        tile = (min(t, frames), 1, w)
    else:
        tile = (1, 1, max(1, min(w, budget_bytes // unit_bytes)))
    return tuple(-(-o // -(-o // k)) for o, k in zip(out_thw, tile, strict=True))  # type: ignore[return-value]


def _padding(conv: nn.Conv3d) -> list[int]:
    """The padding ``nn.Conv3d._conv_forward`` applies, as ``F.pad`` takes it. torch reads
    ``_reversed_padding_repeated_twice`` (set at init) only for a non-``zeros`` mode: ``WanCausalConv3d``
    zeroes ``padding`` after init (it pads itself) and leaves that one stale, so ``zeros`` reads ``padding``."""
    if conv.padding_mode != "zeros" or conv.padding == "same":
        return list(conv._reversed_padding_repeated_twice)
    if isinstance(conv.padding, str):  # "valid"
        return [0] * 6
    t, h, w = conv.padding
    return [w, w, h, h, t, t]


def _unfolds(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, ...], dilation: tuple[int, ...],
             groups: int) -> bool:
    """Whether torch would compute this (already padded) conv by unfolding its input. Asks torch's
    backend choice (a private function); a torch without it is assumed to unfold (strips are exact)."""
    try:
        backend = torch._C._select_conv_backend(x, weight, bias, stride, (0, 0, 0), dilation, False, (0, 0, 0),
                                                groups, None)
    except (AttributeError, RuntimeError, TypeError):
        return True
    return backend.name in _UNFOLDING_BACKENDS


def strip_conv3d(conv: nn.Conv3d, x: Tensor, weight: Tensor, bias: Tensor | None, budget_bytes: int) -> Tensor:
    """``conv``'s convolution of ``x`` (what ``nn.Conv3d._conv_forward`` computes) with each call's
    column buffer under ``budget_bytes`` where torch would unfold (CPU ``Slow3d`` / ``SlowDilated3d``).

    The input is padded first (``conv``'s own padding and ``padding_mode``; ``WanCausalConv3d`` pads
    itself and has none), then each output tile ``[t0:t1, h0:h1, w0:w1]`` (:func:`strip_tiles`; rows
    first) is convolved from the input it needs — rows ``h0·s .. (h1 − 1)·s + (k − 1)·d`` — into a
    preallocated output. A call under the budget, or one torch computes without unfolding (oneDNN,
    CUDA, a 1×1×1 kernel at stride 1), is the plain conv."""
    if x.dim() != 5 or x.device.type != "cpu":  # unbatched input / CUDA (cuDNN does not unfold)
        return nn.Conv3d._conv_forward(conv, x, weight, bias)
    n, c_in, *size = x.shape
    pad = _padding(conv)  # (w_lo, w_hi, h_lo, h_hi, t_lo, t_hi)
    padded = [size[i] + pad[4 - 2 * i] + pad[5 - 2 * i] for i in range(3)]
    kernel, stride, dilation = conv.kernel_size, conv.stride, conv.dilation
    out_thw = tuple((padded[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(3))
    unit = n * (c_in // conv.groups) * math.prod(kernel) * x.element_size()  # column bytes per output position
    pointwise = not any(pad) and math.prod(kernel) == math.prod(stride) == 1  # torch multiplies x itself
    if pointwise or min(out_thw) <= 0 or unit * math.prod(out_thw) <= budget_bytes:
        return nn.Conv3d._conv_forward(conv, x, weight, bias)
    if any(pad):
        x = F.pad(x, pad, mode="constant" if conv.padding_mode == "zeros" else conv.padding_mode)
    args = (stride, (0, 0, 0), dilation, conv.groups)
    if not _unfolds(x, weight, bias, stride, dilation, conv.groups):
        return F.conv3d(x, weight, bias, *args)
    tile = strip_tiles(unit, out_thw, budget_bytes)  # type: ignore[arg-type]
    out = x.new_empty((n, weight.shape[0], *out_thw))
    for lo in itertools.product(*(range(0, out_thw[i], tile[i]) for i in range(3))):
        hi = [min(lo[i] + tile[i], out_thw[i]) for i in range(3)]
        reach = [(hi[i] - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1 for i in range(3)]  # the halo
        src = [slice(lo[i] * stride[i], reach[i]) for i in range(3)]
        out[:, :, *map(slice, lo, hi)] = F.conv3d(x[:, :, *src], weight, bias, *args)
    return out


class _StripConvForward:
    """``conv._conv_forward`` as an instance attribute (``nn.Conv3d.forward`` calls it; diffusers'
    ``WanCausalConv3d.forward`` pads, then calls ``nn.Conv3d.forward``): :func:`strip_conv3d` under the
    budget of :func:`conv_column_budget`, the plain conv outside it."""

    def __init__(self, conv: nn.Conv3d) -> None:
        self.conv = conv

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        budget = _conv_budget.get()
        if budget is None:
            return nn.Conv3d._conv_forward(self.conv, x, weight, bias)
        return strip_conv3d(self.conv, x, weight, bias, budget)


def install_strip_conv3d(module: nn.Module) -> int:
    """Route every ``nn.Conv3d`` under ``module`` through :class:`_StripConvForward` (idempotent);
    returns how many. Refuses a conv class that overrides ``_conv_forward`` (its arithmetic is unknown)."""
    count = 0
    for m in module.modules():
        if not isinstance(m, nn.Conv3d):
            continue
        if not isinstance(m.__dict__.get("_conv_forward"), _StripConvForward):
            if type(m)._conv_forward is not nn.Conv3d._conv_forward:
                raise TypeError(f"{type(m).__name__} overrides _conv_forward; strip_conv3d cannot stand in for it")
            m._conv_forward = _StripConvForward(m)  # type: ignore[assignment]
        count += 1
    return count


@dataclass
class WanVAECache:
    """Causal state of one decode (or encode) stream: diffusers' per-conv feature list + frames seen."""

    feat_map: list[Tensor | str | None]
    num_frames_in: int = 0
    device: torch.device | None = field(default=None)


class WanStreamingVAE(nn.Module):
    """Wraps one ``AutoencoderKLWan`` (Wan2.1 config); adds no parameters of its own.

    ``conv_budget_bytes``: the largest column buffer one CPU ``Conv3d`` call may unfold during
    :meth:`decode_chunk` / :meth:`encode` (:func:`strip_conv3d`); ``None`` = torch's plain convs."""

    def __init__(self, vae: AutoencoderKLWan, conv_budget_bytes: int | None = CONV_COLUMN_BUDGET_BYTES) -> None:
        super().__init__()
        if vae.config.patch_size is not None:
            raise ValueError(
                "WanStreamingVAE drives the Wan2.1 VAE (patch_size=None); got a Wan2.2-style VAE"
            )
        self.vae = vae
        self.conv_budget_bytes = conv_budget_bytes
        install_strip_conv3d(vae)  # plain unless a budget is set (the methods below set this one)

    # -- latent normalisation (the DiT works on normalised latents) --------------------------------
    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        mean = torch.tensor(self.vae.config.latents_mean, dtype=torch.float32, device=like.device)
        std = torch.tensor(self.vae.config.latents_std, dtype=torch.float32, device=like.device)
        return mean.view(1, -1, 1, 1, 1), std.view(1, -1, 1, 1, 1)

    def normalize(self, z_BCTHW: Tensor) -> Tensor:
        mean, std = self._stats(z_BCTHW)
        return ((z_BCTHW.float() - mean) / std).to(z_BCTHW.dtype)

    def denormalize(self, latents_BCTHW: Tensor) -> Tensor:
        mean, std = self._stats(latents_BCTHW)
        return (latents_BCTHW.float() * std + mean).to(latents_BCTHW.dtype)

    # -- decode ---------------------------------------------------------------------------------------
    def new_cache(self, encoder: bool = False) -> WanVAECache:
        counts = self.vae._cached_conv_counts  # diffusers counts the causal convs once at init
        return WanVAECache(feat_map=[None] * counts["encoder" if encoder else "decoder"])

    @torch.no_grad()
    def decode_chunk(self, latents_BCTHW: Tensor, cache: WanVAECache) -> Tensor:
        """Decode the next ``T`` latent frames of a stream → video frames in [-1, 1], ``[B, 3, F, H, W]``.

        ``F = 1 + 4(T − 1)`` for the stream's first chunk and ``4T`` after (the causal first frame).
        ``cache`` is updated in place; pass the same one for the next chunk.
        """
        dtype = self.vae.post_quant_conv.weight.dtype
        outs = []
        with conv_column_budget(self.conv_budget_bytes):
            x = self.vae.post_quant_conv(self.denormalize(latents_BCTHW).to(dtype))
            for i in range(x.shape[2]):
                outs.append(
                    self.vae.decoder(
                        x[:, :, i : i + 1],
                        feat_cache=cache.feat_map,
                        feat_idx=[0],
                        first_chunk=cache.num_frames_in == 0,
                    )
                )
                cache.num_frames_in += 1
        return torch.cat(outs, dim=2).clamp(-1.0, 1.0)

    # -- encode ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, frames_BCTHW: Tensor, cache: WanVAECache | None = None) -> Tensor:
        """Video frames in [-1, 1] → normalised latents (the posterior mean, as Wan uses).

        Without ``cache`` the frames are one clip: ``1 + 4k`` frames → ``1 + k`` latents (the first frame
        alone). With a cache from ``new_cache(encoder=True)`` a stream may be encoded in pieces of
        ``1 + 4k`` frames first, then multiples of 4.
        """
        cache = cache if cache is not None else self.new_cache(encoder=True)
        f = frames_BCTHW.shape[2]
        first = cache.num_frames_in == 0
        if (first and (f - 1) % 4) or (not first and f % 4):
            need = "1 + 4k" if first else "a multiple of 4"
            raise ValueError(f"encode got {f} frames; the {'first' if first else 'next'} piece needs {need}")
        x = frames_BCTHW.to(self.vae.quant_conv.weight.dtype)
        starts = ([0] + list(range(1, f, 4))) if first else list(range(0, f, 4))
        outs = []
        with conv_column_budget(self.conv_budget_bytes):
            for s in starts:
                n = 1 if (first and s == 0) else 4
                outs.append(self.vae.encoder(x[:, :, s : s + n], feat_cache=cache.feat_map, feat_idx=[0]))
            cache.num_frames_in += f
            mu = self.vae.quant_conv(torch.cat(outs, dim=2))[:, : self.vae.config.z_dim]
        return self.normalize(mu)


def build_vae(**config: object) -> AutoencoderKLWan:
    """``AutoencoderKLWan`` on the meta device; no arguments = the Wan2.1 VAE config."""
    with torch.device("meta"):
        return AutoencoderKLWan(**config)  # type: ignore[arg-type]


def load_wan_vae(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    config: dict[str, object] | None = None,
) -> WanStreamingVAE:
    """Load ``Wan2.1_VAE.pth`` (original Wan key names, a plain state dict) through diffusers' own
    converter into ``AutoencoderKLWan``; strict. ``config`` overrides the Wan2.1 shape (tests)."""
    path, state = read_pth(path, VAE_FILE)
    entries = state_dict_entries(convert_wan_vae_to_diffusers(dict(state)), path)
    vae = build_vae(**(config or {}))
    fill_module(vae, entries, dtype=dtype, device=device, what="Wan2.1 VAE (Wan2.1_VAE.pth)")
    return WanStreamingVAE(vae.eval().requires_grad_(False))
