"""WanDecodeStage: the streaming Wan VAE decode of an emission; its causal cache lives in the rolling state.

``RollingState.decoder_cache`` is a list of tensors (what snapshots store); :func:`cache_to_tensors`
/ :func:`cache_from_tensors` carry the VAE's per-conv cache (tensors, diffusers' ``"Rep"`` marker or
``None`` per causal conv, and the frames seen) through it, so decoding emission by emission — also
after a resume — equals decoding the whole latent sequence. Emission ``j`` decodes to the video frames
``ChunkPlan.video_frames``: ``1 + 4(L - 1)`` for the first, ``4L`` after (the causal first frame).
The frames go to the publisher and are not kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.wan.vae import WanStreamingVAE, WanVAECache
from pipeline.families.wan import ports as P
from pipeline.module import Module
from pipeline.stage import Phase, Stage, Values
from pipeline.stage_common import Timings

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


class WanDecodeStage(Stage):
    name = "decode"
    phase = Phase.EMISSION
    inputs = (P.EMISSION_LATENTS, P.ROLLING)
    outputs = (P.FRAMES,)

    def __init__(self, vae: Module, *, timings: Timings) -> None:
        self.vae = vae
        self.timings = timings

    def modules(self) -> list[object]:
        return [self.vae]

    @torch.no_grad()
    def run(self, values: Values) -> None:
        z = values.get(P.EMISSION_LATENTS)
        state = values.get(P.ROLLING)
        vae = self.vae.get()
        assert isinstance(vae, WanStreamingVAE)
        cache = cache_from_tensors(state.decoder_cache, vae)
        with self.timings.model("vae.decode"):
            rgb_BCTHW = vae.decode_chunk(z, cache)
        state.decoder_cache = cache_to_tensors(cache)
        frames = rgb_BCTHW[0].permute(1, 2, 3, 0).float().add(1.0).mul(127.5).round().clamp(0, 255)
        values.put(P.FRAMES, frames.to(torch.uint8).cpu().numpy())
