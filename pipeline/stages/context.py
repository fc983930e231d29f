"""ContextStage: the reference encoded once per request, then per step the audio features of the
step's window and the step's initial noise."""

from __future__ import annotations

import numpy as np
import torch

from pipeline import ports as P
from pipeline.module import Module
from pipeline.stage import Phase, Stage, Values
from pipeline.stages.common import Timings, step_generator


class ContextStage(Stage):
    name = "context"
    phase = Phase.STEP
    inputs = (P.REFERENCE_RGB, P.AUDIO, P.TEXT, P.SEED, P.STEP)
    outputs = (P.REF_LATENT, P.TEXT_TOKENS, P.TEXT_MASK, P.AUDIO_FEATS, P.NOISE)

    def __init__(self, vae: Module, audio: Module, text: Module | None, *, fps: int, sample_rate: int,
                 latent_channels: int, lr_latent_hw: tuple[int, int], timings: Timings) -> None:
        self.vae, self.audio, self.text = vae, audio, text
        self.fps, self.sample_rate = fps, sample_rate
        self.latent_channels, self.lr_latent_hw = latent_channels, lr_latent_hw
        self.timings = timings

    def modules(self) -> list[object]:
        return [m for m in (self.vae, self.audio, self.text) if m is not None]

    @torch.inference_mode()
    def setup(self, values: Values) -> None:
        rgb = values.get(P.REFERENCE_RGB)
        ref_BCTHW = torch.from_numpy(rgb).permute(2, 0, 1)[None, :, None].float().div(127.5).sub(1.0)
        with self.timings.model("vae.encode"):
            ref_BCThw = self.vae.get().encode(ref_BCTHW)  # type: ignore[operator]
        values.put(P.REF_LATENT, ref_BCThw[:, :, 0].contiguous())
        text = values.get_optional(P.TEXT)
        tokens = mask = None
        if text and self.text is not None:
            with self.timings.model("text"):
                tokens, mask = self.text.get()([text])
        values.put(P.TEXT_TOKENS, tokens)
        values.put(P.TEXT_MASK, mask)

    @torch.inference_mode()
    def run(self, values: Values) -> None:
        step = values.get(P.STEP)
        encoder = self.audio.get()
        pad = int(getattr(encoder, "context_frames", 0))
        # Every frame's audio window is fixed by its timeline position: the sample range is a pure
        # function of the frame indices, so chunking never changes a frame's features.
        spf = self.sample_rate // self.fps
        s0, s1 = (step.window.start - pad) * spf, (step.window.stop + pad) * spf
        wave = values.get(P.AUDIO).read(s0, s1, self.sample_rate)
        wave_BS = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))[None]
        with self.timings.model("audio"):
            feats = encoder(wave_BS, len(step.window))
        values.put(P.AUDIO_FEATS, feats)
        h, w = self.lr_latent_hw
        gen = step_generator(values.get(P.SEED), step)
        values.put(P.NOISE, torch.randn((1, self.latent_channels, len(step.window), h, w), generator=gen))
