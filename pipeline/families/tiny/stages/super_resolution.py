"""SRStage: one-step identity-aware super-resolution of an emission's low-res latents."""

from __future__ import annotations

import torch

from pipeline.families.tiny import ports as P
from pipeline.module import Module
from pipeline.stage import Phase, Stage, Values
from pipeline.stage_common import Timings


class SRStage(Stage):
    name = "sr"
    phase = Phase.EMISSION
    inputs = (P.EMISSION_LATENTS, P.REF_LATENT)
    outputs = (P.SR_REF_TOKENS, P.EMISSION_HR)

    def __init__(self, sr: Module, *, timings: Timings, frames_per_call: int = 32) -> None:
        self.sr = sr
        self.timings = timings
        # SR is per-frame: splitting long inputs bounds activation memory in batch mode without
        # changing any output.
        self.frames_per_call = frames_per_call

    def modules(self) -> list[object]:
        return [self.sr]

    @torch.no_grad()
    def setup(self, values: Values) -> None:
        with self.timings.model("sr"):
            values.put(P.SR_REF_TOKENS, self.sr.get().embed_reference(values.get(P.REF_LATENT)))  # type: ignore[operator]

    @torch.no_grad()
    def run(self, values: Values) -> None:
        lr = values.get(P.EMISSION_LATENTS)
        ref = values.get(P.REF_LATENT)
        tokens = values.get(P.SR_REF_TOKENS)
        model = self.sr.get()
        with self.timings.model("sr"):
            parts = [model(lr[:, :, i : i + self.frames_per_call], ref, ref_tokens=tokens)
                     for i in range(0, lr.shape[2], self.frames_per_call)]
        values.put(P.EMISSION_HR, torch.cat(parts, dim=2))
