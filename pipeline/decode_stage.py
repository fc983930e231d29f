"""CausalDecodeStage: the last emission stage of a family whose video VAE decodes causally.

Each family's decoder keeps a per-layer cache between emissions; it lives in
``RollingState.decoder_cache`` as a list of tensors (what resume snapshots store), so decoding
emission by emission — also after a resume — equals decoding the whole latent sequence. This base
owns that bookkeeping and the hand-over of the frames (:data:`pipeline.ports.FRAMES`, THWC uint8 on
the host) to the publisher; a family says which latents it decodes (``latents``) and how
(:meth:`CausalDecodeStage.decode`). The frames are not kept.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from pipeline.module import Module
from pipeline.ports import FRAMES, ROLLING
from pipeline.stage import Phase, Port, Stage, Values
from pipeline.stage_common import Timings


def to_uint8_frames(rgb_BCTHW: Tensor) -> np.ndarray:
    """Decoder output in [-1, 1] (batch of one) as THWC uint8 frames on the host."""
    frames = rgb_BCTHW[0].permute(1, 2, 3, 0).float().add(1.0).mul(127.5).round().clamp(0, 255)
    return frames.to(torch.uint8).cpu().numpy()


class CausalDecodeStage(Stage):
    name = "decode"
    phase = Phase.EMISSION
    outputs = (FRAMES,)
    latents: ClassVar[Port[Tensor]]  # the emission's latents this family decodes
    reads: ClassVar[tuple[Port[Any], ...]] = ()  # job values the family's decode also reads (``decode``'s values)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.inputs = (cls.latents, ROLLING, *cls.reads)

    def __init__(self, vae: Module, *, timings: Timings) -> None:
        self.vae = vae
        self.timings = timings

    def modules(self) -> list[object]:
        return [self.vae]

    @abstractmethod
    def decode(self, vae: torch.nn.Module, z: Tensor, cache: list[Tensor], values: Values
               ) -> tuple[Tensor, list[Tensor]]:
        """RGB in [-1, 1] (``BCTHW``) of the emission's latents ``z`` and the decoder's cache after
        them; ``cache`` is the one the previous emission left (empty before the first); ``values``:
        where the ports in ``reads`` are."""

    @torch.no_grad()
    def run(self, values: Values) -> None:
        state = values.get(ROLLING)
        with self.timings.model("vae.decode"):
            rgb_BCTHW, state.decoder_cache = self.decode(self.vae.get(), values.get(self.latents), state.decoder_cache,
                                                         values)
        values.put(FRAMES, to_uint8_frames(rgb_BCTHW))
