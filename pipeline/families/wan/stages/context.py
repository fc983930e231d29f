"""WanContextStage: per job the reference's latent, the gray padding latent, CLIP tokens of the
reference and umT5 states of the prompt and negative prompt (then the two encoders are parked); per
step the wav2vec2 windows of the step's video frames and the step's noise.

Audio alignment: timeline (latent) frame ``t`` is video frames ``FrameGrid.video_frames``; video frame
``v`` is audio samples ``[640 v, 640 (v + 1))`` at 16 kHz / 25 fps. The DiT takes, for a window of
``T`` latents, ``1 + 4(T - 1)`` video frames ending with the window's last one (the window's first
latent counts as a single frame, as the DiT's audio projection expects); wav2vec2 runs on those frames
plus ``audio_context`` frames each side — never on the whole audio.
"""

from __future__ import annotations

import numpy as np
import torch

from models.wan.audio import frame_windows, num_video_frames
from pipeline.families.wan import ports as P
from pipeline.families.wan.presets import AUDIO_WINDOW
from pipeline.module import Module
from pipeline.ports import AudioReader
from pipeline.stage import Phase, Stage, Values
from pipeline.stage_common import Timings, step_generator

SAMPLE_RATE = 16000
_BLOCK = 1 << 20


class WanContextStage(Stage):
    name = "context"
    phase = Phase.STEP
    inputs = (P.REFERENCE_RGB, P.AUDIO, P.TEXT, P.SEED, P.OPTIONS, P.PLAN, P.STEP)
    outputs = (P.REF_LATENT, P.PAD_LATENT, P.CLIP_TOKENS, P.TEXT_STATES, P.AUDIO_STATS, P.AUDIO_WINDOWS, P.NOISE)

    def __init__(self, vae: Module, audio: Module, text: Module, image: Module, *, audio_context: int,
                 timings: Timings) -> None:
        self.vae, self.audio, self.text, self.image = vae, audio, text, image
        self.audio_context = audio_context
        self.timings = timings

    def modules(self) -> list[object]:
        return [self.vae, self.audio, self.text, self.image]

    @torch.no_grad()
    def setup(self, values: Values) -> None:
        rgb = values.get(P.REFERENCE_RGB)
        vae = self.vae.get()
        ref_B3HW = torch.from_numpy(rgb).to(self.vae.device).permute(2, 0, 1)[None].float().div(127.5).sub(1.0)
        with self.timings.model("vae.encode"):
            ref_latent = vae.encode(ref_B3HW[:, :, None])  # type: ignore[operator]
            # upstream pads the condition clip with zero (gray) frames after the reference
            gray = torch.cat([ref_B3HW[:, :, None], torch.zeros_like(ref_B3HW)[:, :, None].expand(-1, -1, 8, -1, -1)], 2)
            pad_latent = vae.encode(gray)[:, :, -1:]  # type: ignore[operator]
        values.put(P.REF_LATENT, ref_latent.contiguous())
        values.put(P.PAD_LATENT, pad_latent.contiguous())
        with self.timings.model("clip"):
            values.put(P.CLIP_TOKENS, self.image.get().encode(ref_B3HW).float())  # type: ignore[operator]
        self.image.park()
        options = values.get(P.OPTIONS)
        with self.timings.model("text"):
            states = self.text.get()([values.get_optional(P.TEXT) or "", str(options["negative_prompt"])])
        values.put(P.TEXT_STATES, tuple(s.float() for s in states))
        self.text.park()
        values.put(P.AUDIO_STATS, waveform_stats(values.get(P.AUDIO)))

    @torch.no_grad()
    def run(self, values: Values) -> None:
        step = values.get(P.STEP)
        plan = values.get(P.PLAN)
        audio = values.get(P.AUDIO)
        num_samples = audio.num_samples(SAMPLE_RATE)
        video = plan.grid.video_frames(step.window)
        t = len(step.window)
        a, b = video.stop - (1 + plan.grid.stride * (t - 1)), video.stop
        encoder = self.audio.get()
        total = num_video_frames(num_samples)
        if total < 1:
            raise RuntimeError(f"the audio has {num_samples} samples, less than one video frame")
        half = AUDIO_WINDOW // 2
        c0 = min(max(a - half, 0), total - 1)
        c1 = min(max(b - 1 + half, 0), total - 1) + 1

        def read(s0: int, s1: int) -> torch.Tensor:
            wave = np.ascontiguousarray(audio.read(s0, s1, SAMPLE_RATE), dtype=np.float32)
            return torch.from_numpy(wave).to(self.audio.device)

        with self.timings.model("audio"):
            feats = encoder.features(read, num_samples, c0, c1, context=self.audio_context,  # type: ignore[operator]
                                     stats=values.get(P.AUDIO_STATS))
        values.put(P.AUDIO_WINDOWS, frame_windows(feats, c0, a, b, total, window=AUDIO_WINDOW)[None].contiguous())
        ref = values.get(P.REF_LATENT)
        # drawn on the CPU (the same numbers on every device), then moved to the latents' device
        gen = step_generator(values.get(P.SEED), step)
        values.put(P.NOISE, torch.randn((1, ref.shape[1], t, *ref.shape[3:]), generator=gen).to(ref.device))


def waveform_stats(audio: AudioReader) -> tuple[float, float]:
    """Mean and standard deviation of the whole 16 kHz waveform in one streaming pass (what the
    wav2vec2 feature extractor normalises with upstream, over the whole clip)."""
    n = audio.num_samples(SAMPLE_RATE)
    total = total_sq = 0.0
    for s0 in range(0, n, _BLOCK):
        x = audio.read(s0, min(n, s0 + _BLOCK), SAMPLE_RATE).astype(np.float64)
        total += float(x.sum())
        total_sq += float((x * x).sum())
    mean = total / max(1, n)
    return mean, max(0.0, total_sq / max(1, n) - mean * mean) ** 0.5
