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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from torch import Tensor, nn

from models.wan.checkpoint import fill_module, read_pth, state_dict_entries

VAE_FILE = "Wan2.1_VAE.pth"


@dataclass
class WanVAECache:
    """Causal state of one decode (or encode) stream: diffusers' per-conv feature list + frames seen."""

    feat_map: list[Tensor | str | None]
    num_frames_in: int = 0
    device: torch.device | None = field(default=None)


class WanStreamingVAE(nn.Module):
    """Wraps one ``AutoencoderKLWan`` (Wan2.1 config); adds no parameters of its own."""

    def __init__(self, vae: AutoencoderKLWan) -> None:
        super().__init__()
        if vae.config.patch_size is not None:
            raise ValueError(
                "WanStreamingVAE drives the Wan2.1 VAE (patch_size=None); got a Wan2.2-style VAE"
            )
        self.vae = vae

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
        x = self.vae.post_quant_conv(self.denormalize(latents_BCTHW).to(dtype))
        outs = []
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
