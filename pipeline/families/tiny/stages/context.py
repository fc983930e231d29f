"""ContextStage: the reference encoded once per request, then per step the audio features of the
step's window (and, when the request's audio guidance is not 1, the features of silence over the
same window) and the step's initial noise."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.families.tiny import ports as P
from pipeline.families.tiny.ports import AudioReader
from pipeline.module import Module
from pipeline.stage import Phase, Stage, Values
from pipeline.stage_common import Timings, step_generator


class ContextStage(Stage):
    name = "context"
    phase = Phase.STEP
    inputs = (P.REFERENCE_RGB, P.AUDIO, P.TEXT, P.SEED, P.OPTIONS, P.STEP)
    outputs = (P.REF_LATENT, P.REF_LOWRES, P.DECODER_REFERENCE, P.TEXT_TOKENS, P.TEXT_MASK, P.AUDIO_GAIN, P.AUDIO_FEATS,
               P.AUDIO_FEATS_SILENT, P.NOISE)

    def __init__(self, vae: Module, audio: Module, text: Module | None, *, fps: int, sample_rate: int,
                 latent_channels: int, lr_latent_hw: tuple[int, int], timings: Timings) -> None:
        self.vae, self.audio, self.text = vae, audio, text
        self.fps, self.sample_rate = fps, sample_rate
        self.latent_channels, self.lr_latent_hw = latent_channels, lr_latent_hw
        self.timings = timings

    def modules(self) -> list[object]:
        return [m for m in (self.vae, self.audio, self.text) if m is not None]

    @torch.no_grad()
    def setup(self, values: Values) -> None:
        rgb = values.get(P.REFERENCE_RGB)
        vae = self.vae.get()
        rgb_HWC = torch.from_numpy(rgb).to(self.vae.device)
        ref_BCTHW = rgb_HWC.permute(2, 0, 1)[None, :, None].float().div(127.5).sub(1.0)
        with self.timings.model("vae.encode"):
            ref_BCThw = vae.encode(ref_BCTHW)  # type: ignore[operator]
            # what a decoder that reads the reference reads of it, once per job (None for one that does not)
            values.put(P.DECODER_REFERENCE, vae.reference_features(ref_BCTHW[:, :, 0], ref_BCThw))  # type: ignore[operator]
        values.put(P.REF_LATENT, ref_BCThw[:, :, 0].contiguous())
        values.put(P.REF_LOWRES, vae.to_lowres(ref_BCThw).contiguous())  # type: ignore[operator]
        text = values.get_optional(P.TEXT)
        tokens = mask = None
        if text and self.text is not None:
            with self.timings.model("text"):
                tokens, mask = self.text.get()([text])
        values.put(P.TEXT_TOKENS, tokens)
        values.put(P.TEXT_MASK, mask)
        values.put(P.AUDIO_GAIN, loudness_gain(values.get(P.AUDIO), self.sample_rate))

    @torch.no_grad()
    def run(self, values: Values) -> None:
        step = values.get(P.STEP)
        encoder = self.audio.get()
        pad = int(getattr(encoder, "context_frames", 0))
        # Every frame's audio window is fixed by its timeline position: the sample range is a pure
        # function of the frame indices, so chunking never changes a frame's features.
        spf = self.sample_rate // self.fps
        s0, s1 = (step.window.start - pad) * spf, (step.window.stop + pad) * spf
        wave = values.get(P.AUDIO).read(s0, s1, self.sample_rate) * values.get(P.AUDIO_GAIN)
        wave_BS = torch.from_numpy(np.clip(wave, -1.0, 1.0).astype(np.float32))[None].to(self.audio.device)
        # the A2V stage guides the audio (the request's options.audio_guidance != 1): silence is its
        # unconditional input; with guidance 1 it runs one forward and needs none
        guided = float(values.get(P.OPTIONS)["audio_guidance"]) != 1.0
        with self.timings.model("audio"):
            feats = encoder(wave_BS, len(step.window))
            silent = encoder(torch.zeros_like(wave_BS), len(step.window)) if guided else None
        values.put(P.AUDIO_FEATS, feats)
        values.put(P.AUDIO_FEATS_SILENT, silent)
        h, w = self.lr_latent_hw
        # drawn on the CPU (the same numbers on every device), then moved to the latents' device
        gen = step_generator(values.get(P.SEED), step)
        noise = torch.randn((1, self.latent_channels, len(step.window), h, w), generator=gen)
        values.put(P.NOISE, noise.to(values.get(P.REF_LATENT).device))


TARGET_RMS_DBFS = -20.0  # the level the models were trained at (models.avatars.speech.normalize_loudness)
_HOP_S = 0.02
_BLOCK_HOPS = 8192


def loudness_gain(audio: AudioReader, rate: int, target_dbfs: float = TARGET_RMS_DBFS) -> float:
    """Gain that brings the voiced parts of ``audio`` (20 ms frames within 50 dB of the loudest) to
    ``target_dbfs`` RMS — the normalisation the models were trained with — computed in two streaming
    passes over blocks, so an hour of audio costs no memory. Silence gets gain 1."""
    hop = int(rate * _HOP_S)
    n_hops = audio.num_samples(rate) // hop

    def hop_rms() -> list[np.ndarray]:
        out = []
        for h0 in range(0, n_hops, _BLOCK_HOPS):
            h1 = min(n_hops, h0 + _BLOCK_HOPS)
            x = audio.read(h0 * hop, h1 * hop, rate).astype(np.float64).reshape(h1 - h0, hop)
            out.append(np.sqrt(np.mean(x**2, axis=1)))
        return out

    if n_hops == 0:
        return 1.0
    blocks = hop_rms()
    peak = max(float(b.max()) for b in blocks)
    if peak <= 1e-8:
        return 1.0
    floor = peak * 10 ** (-50 / 20)
    voiced = np.concatenate([b[b > floor] for b in blocks])
    level = float(np.sqrt(np.mean(voiced**2)))
    return float(10 ** (target_dbfs / 20) / level)
