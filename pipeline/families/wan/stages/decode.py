"""WanDecodeStage: the streaming Wan VAE decode of an emission; its causal cache lives in the rolling state.

``RollingState.decoder_cache`` is a list of tensors (what snapshots store); :func:`cache_to_tensors`
/ :func:`cache_from_tensors` carry the VAE's per-conv cache (tensors, diffusers' ``"Rep"`` marker or
``None`` per causal conv, and the frames seen) through it, so decoding emission by emission — also
after a resume — equals decoding the whole latent sequence. Emission ``j`` decodes to the video frames
``ChunkPlan.video_frames``: ``1 + 4(L - 1)`` for the first, ``4L`` after (the causal first frame).
The cache bookkeeping and the hand-over of the frames are the framework's
(:class:`~pipeline.decode_stage.CausalDecodeStage`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.wan.vae import WanStreamingVAE, WanVAECache
from pipeline.decode_stage import CausalDecodeStage
from pipeline.families.wan import ports as P
from pipeline.stage import Values

_NONE, _REP, _TENSOR = 0, 1, 2


def cache_to_tensors(cache: WanVAECache) -> list[Tensor]:
    """``[header_int64, *tensors]``: header = ``[frames seen, code per conv]``."""
    codes = [_NONE if x is None else _REP if isinstance(x, str) else _TENSOR for x in cache.feat_map]
    return [torch.tensor([cache.num_frames_in, *codes], dtype=torch.int64),
            *[x for x in cache.feat_map if isinstance(x, Tensor)]]


def cache_from_tensors(tensors: list[Tensor], vae: WanStreamingVAE) -> WanVAECache:
    if not tensors:
        return vae.new_cache()
    header, rest = tensors[0].tolist(), iter(tensors[1:])
    feat: list[Tensor | str | None] = [None if c == _NONE else "Rep" if c == _REP else next(rest) for c in header[1:]]
    return WanVAECache(feat_map=feat, num_frames_in=int(header[0]))


class WanDecodeStage(CausalDecodeStage):
    latents = P.EMISSION_LATENTS

    def decode(self, vae: torch.nn.Module, z: Tensor, cache: list[Tensor], values: Values
               ) -> tuple[Tensor, list[Tensor]]:
        assert isinstance(vae, WanStreamingVAE)
        state = cache_from_tensors(cache, vae)
        rgb_BCTHW = vae.decode_chunk(z, state)
        return rgb_BCTHW, cache_to_tensors(state)
