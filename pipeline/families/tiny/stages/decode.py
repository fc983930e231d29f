"""DecodeStage: the tiny family's causal VAE decode of an emission (the super-resolved latents).

The cache bookkeeping and the hand-over of the frames are the framework's
(:class:`~pipeline.decode_stage.CausalDecodeStage`); the tiny VAE's cache is already a list of tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.decode_stage import CausalDecodeStage
from pipeline.families.tiny import ports as P


class DecodeStage(CausalDecodeStage):
    latents = P.EMISSION_HR

    def decode(self, vae: torch.nn.Module, z: Tensor, cache: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        rgb_BCTHW, new_cache = vae.decode(z, cache or None)  # type: ignore[operator]
        return rgb_BCTHW, list(new_cache)
