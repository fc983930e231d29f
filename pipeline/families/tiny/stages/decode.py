"""DecodeStage: the tiny family's causal VAE decode of an emission (the super-resolved latents).

The cache bookkeeping and the hand-over of the frames are the framework's
(:class:`~pipeline.decode_stage.CausalDecodeStage`); the tiny VAE's cache is already a list of tensors.
A decoder that reads the reference (``VAEConfig.ref_window_radius``) gets the features the context
stage computed once per job (``P.DECODER_REFERENCE``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.decode_stage import CausalDecodeStage
from pipeline.families.tiny import ports as P
from pipeline.stage import Values


class DecodeStage(CausalDecodeStage):
    latents = P.EMISSION_HR
    reads = (P.DECODER_REFERENCE,)

    def decode(self, vae: torch.nn.Module, z: Tensor, cache: list[Tensor], values: Values
               ) -> tuple[Tensor, list[Tensor]]:
        reference = values.get_optional(P.DECODER_REFERENCE)  # a decoder that reads the reference needs it
        rgb_BCTHW, new_cache = vae.decode(z, cache or None, reference=reference)  # type: ignore[operator]
        return rgb_BCTHW, list(new_cache)
