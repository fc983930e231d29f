"""WanA2VStage: flow-matching sampling of one step's latents with the Wan avatar DiT.

The window's known frames (reference / context / anchors, ``pipeline.families.wan.conditioning``) go
into the I2V condition channels and are held clean by the sampler. Guidance as InfiniteTalk's
``generate``: with text guidance ``g_t`` and audio guidance ``g_a`` (both != 1) three branches in one
batched forward — cond (prompt, audio), drop-text (negative prompt, audio), uncond (negative prompt,
zero audio features) — ``v = v_u + g_t (v_c - v_dt) + g_a (v_dt - v_u)``; with ``g_t = 1`` only
``v = v_da + g_a (v_c - v_da)`` (drop-audio: prompt, zero audio); with both 1 (FlashTalk) one branch.
The schedule is upstream's: ``linspace(1000, 1, steps)`` then 0, shifted ``s t / (1 + (s - 1) t)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from models.sampler import FlowMatchEulerSampler
from pipeline.families.wan import ports as P
from pipeline.families.wan.conditioning import condition, known_latents
from pipeline.module import Module
from pipeline.stage import Phase, Stage, Values
from pipeline.stage_common import Timings

NUM_TIMESTEPS = 1000


class WanEulerSampler(FlowMatchEulerSampler):
    """Euler on upstream's grid (``linspace(1000, 1, n)`` and 0, shifted), in units of ``t / 1000``."""

    def timesteps(self) -> Tensor:
        t = torch.cat([torch.linspace(1.0, 1.0 / NUM_TIMESTEPS, self.num_steps, dtype=torch.float64),
                       torch.zeros(1, dtype=torch.float64)])
        return (self.shift * t / (1.0 + (self.shift - 1.0) * t)).float()


class WanA2VStage(Stage):
    name = "a2v"
    phase = Phase.STEP
    inputs = (P.STEP, P.ROLLING, P.OPTIONS, P.REF_LATENT, P.PAD_LATENT, P.CLIP_TOKENS, P.TEXT_STATES,
              P.AUDIO_WINDOWS, P.NOISE)
    outputs = (P.DIT_CONTEXT, P.STEP_LATENTS)

    def __init__(self, dit: Module, vae: Module, *, timings: Timings) -> None:
        self.dit = dit
        self.vae = vae  # re-encode mode only
        self.timings = timings

    def modules(self) -> list[object]:
        return [self.dit]

    @torch.no_grad()
    def setup(self, values: Values) -> None:
        prompt, negative = values.get(P.TEXT_STATES)
        n = max(prompt.shape[0], negative.shape[0])
        text_BND = torch.stack([F.pad(s, (0, 0, 0, n - s.shape[0])) for s in (prompt, negative)])
        with self.timings.model("a2v"):
            context = self.dit.get().embed_context(text_BND, values.get(P.CLIP_TOKENS))  # type: ignore[operator]
        values.put(P.DIT_CONTEXT, tuple(context))

    @torch.no_grad()
    def run(self, values: Values) -> None:
        step = values.get(P.STEP)
        options = values.get(P.OPTIONS)
        state = values.get(P.ROLLING)
        noise = values.get(P.NOISE)
        known = known_latents(step, str(options["conditioning"]), values.get(P.REF_LATENT), state.last_n,
                              state.prev_last, self.reencode)
        cond, clean, known_BT = condition(step, known, values.get(P.PAD_LATENT))
        dit = self.dit.get()
        windows = values.get(P.AUDIO_WINDOWS)
        g_text, g_audio = float(options["text_guidance"]), float(options["audio_guidance"])
        with self.timings.model("a2v"):
            audio = dit.audio_tokens(windows)  # type: ignore[operator]
            silent = dit.audio_tokens(torch.zeros_like(windows)) if g_audio != 1.0 else None  # type: ignore[operator]
            velocity = guided_velocity(dit, cond, values.get(P.DIT_CONTEXT), audio, silent, g_text, g_audio)
            sampler = WanEulerSampler(int(options["steps"]), float(options["shift"]))
            x0 = sampler.sample(velocity, noise, clean.to(noise.dtype), known_BT)
        g0 = step.generate.start - step.window.start
        values.put(P.STEP_LATENTS, x0[:, :, g0 : g0 + len(step.generate)].contiguous())

    def reencode(self, latents: Tensor, n: int) -> Tensor:
        """Upstream's motion frames: decode ``latents`` on their own, encode the last ``1 + 4(n - 1)``
        video frames again as a clip → ``n`` latents."""
        vae = self.vae.get()
        with self.timings.model("vae.reencode"):
            frames = vae.decode_chunk(latents, vae.new_cache())  # type: ignore[operator]
            out: Tensor = vae.encode(frames[:, :, -(1 + 4 * (n - 1)):])  # type: ignore[operator]
        return out.to(latents.dtype)


def guided_velocity(dit: object, cond: Tensor, context: tuple[Tensor, Tensor], audio: Tensor,
                    silent: Tensor | None, g_text: float, g_audio: float) -> Callable[[Tensor, Tensor], Tensor]:
    """The sampler's ``velocity(x, t)``: every guidance branch in one batched DiT forward."""
    text_ctx, image_ctx = context
    if g_text != 1.0 and silent is not None:
        branches = [(0, audio), (1, audio), (1, silent)]  # cond, drop-text, uncond
    elif silent is not None:
        branches = [(0, audio), (0, silent)]  # cond, drop-audio
    elif g_text != 1.0:
        branches = [(0, audio), (1, audio)]  # cond, drop-text
    else:
        branches = [(0, audio)]
    nb = len(branches)
    text_nb = text_ctx[[i for i, _ in branches]]
    ctx_nb = (text_nb, image_ctx.expand(nb, *image_ctx.shape[1:]))
    audio_nb = torch.cat([a for _, a in branches])
    cond_nb = cond.expand(nb, *cond.shape[1:])

    def velocity(x_BCThw: Tensor, t: Tensor) -> Tensor:
        t_B = (t.reshape(-1)[:1] * NUM_TIMESTEPS).expand(nb)
        v = dit(x_BCThw.expand(nb, *x_BCThw.shape[1:]), cond_nb, t_B, ctx_nb, audio_nb)  # type: ignore[operator]
        v = v.to(x_BCThw.dtype)
        if nb == 1:
            return v  # type: ignore[no-any-return]
        if nb == 3:
            v_c, v_dt, v_u = v.chunk(3)
            return v_u + g_text * (v_c - v_dt) + g_audio * (v_dt - v_u)  # type: ignore[no-any-return]
        v_c, v_drop = v.chunk(2)
        g = g_audio if silent is not None else g_text
        return v_drop + g * (v_c - v_drop)  # type: ignore[no-any-return]

    return velocity
