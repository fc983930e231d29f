"""DecodeStage: causal VAE decode of an emission, frames handed to the publisher.

The decoder's per-layer cache lives in the rolling state, so decoding emission by emission equals
decoding the whole sequence. The frames go to the job's :class:`~pipeline.publish.Publisher`
(encoder + sinks) and are not kept.
"""

from __future__ import annotations

import torch

from pipeline.families.tiny import ports as P
from pipeline.module import Module
from pipeline.stage import Phase, Stage, Values
from pipeline.stage_common import Timings


class DecodeStage(Stage):
    name = "decode"
    phase = Phase.EMISSION
    inputs = (P.EMISSION_HR, P.ROLLING)
    outputs = (P.FRAMES,)

    def __init__(self, vae: Module, *, timings: Timings) -> None:
        self.vae = vae
        self.timings = timings

    def modules(self) -> list[object]:
        return [self.vae]

    @torch.no_grad()
    def run(self, values: Values) -> None:
        z = values.get(P.EMISSION_HR)
        state = values.get(P.ROLLING)
        with self.timings.model("vae.decode"):
            rgb_BCTHW, cache = self.vae.get().decode(z, state.decoder_cache or None)  # type: ignore[operator]
        state.decoder_cache = list(cache)
        frames = rgb_BCTHW[0].permute(1, 2, 3, 0).add(1.0).mul(127.5).round().clamp(0, 255)
        values.put(P.FRAMES, frames.to(torch.uint8).cpu().numpy())
