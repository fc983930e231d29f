"""WanA2VStage: flow-matching sampling of one step's latents with the Wan avatar DiT.

The window's known frames (reference / context / anchors, ``pipeline.families.wan.conditioning``) go
into the I2V condition channels and are held clean by the sampler. Guidance as InfiniteTalk's
``generate``: with text guidance ``g_t`` and audio guidance ``g_a`` (both != 1) three branches in one
batched forward — cond (prompt, audio), drop-text (negative prompt, audio), uncond (negative prompt,
zero audio features) — ``v = v_u + g_t (v_c - v_dt) + g_a (v_dt - v_u)``; with ``g_t = 1`` only
``v = v_da + g_a (v_c - v_da)`` (drop-audio: prompt, zero audio); with both 1 (FlashTalk) one branch.
The schedule is upstream's: ``linspace(1000, 1, steps)`` then 0, shifted ``s t / (1 + (s - 1) t)``.

Batched steps (:class:`~pipeline.stage.BatchedStage`): the pipeline may hand ``I_{k-1}`` and
``N_{k+1}`` over together; their windows (of different lengths) are packed along T and sampled as
one, each attending only to itself (``WanAvatarDiT.forward(windows=)``), so one DiT forward per
sampler step serves both — on a node, one AllGather of every sharded block instead of two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.sampler import FlowMatchEulerSampler
from pipeline.families.wan import ports as P
from pipeline.families.wan.conditioning import condition, known_latents
from pipeline.module import Module
from pipeline.schedule import ChunkStep
from pipeline.stage import BatchedStage, Port, Values
from pipeline.stage_common import Timings

NUM_TIMESTEPS = 1000


class WanEulerSampler(FlowMatchEulerSampler):
    """Euler on upstream's grid (``linspace(1000, 1, n)`` and 0, shifted), in units of ``t / 1000``."""

    def timesteps(self, start: float = 1.0) -> Tensor:
        if start != 1.0:
            raise ValueError(f"start={start}: the Wan sampler runs upstream's grid from pure noise (start 1)")
        t = torch.cat([torch.linspace(1.0, 1.0 / NUM_TIMESTEPS, self.num_steps, dtype=torch.float64),
                       torch.zeros(1, dtype=torch.float64)])
        return (self.shift * t / (1.0 + (self.shift - 1.0) * t)).float()


class WanA2VStage(BatchedStage):
    name = "a2v"
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
    def prepare(self, values: Values) -> _Window:
        step = values.get(P.STEP)
        options = values.get(P.OPTIONS)
        state = values.get(P.ROLLING)
        known = known_latents(step, str(options["conditioning"]), values.get(P.REF_LATENT), state.last_n,
                              state.prev_last, self.reencode)
        cond, clean, known_BT = condition(step, known, values.get(P.PAD_LATENT))
        return _Window(step, values.get(P.NOISE), cond, clean, known_BT, values.get(P.AUDIO_WINDOWS), options,
                       values.get(P.DIT_CONTEXT))

    @torch.no_grad()
    def run_batch(self, prepared: Sequence[_Window]) -> list[dict[Port[Any], object]]:
        """One sampling over the windows packed along T: one DiT forward (all guidance branches) per
        sampler step for all of them; each window's result equals its own sampling."""
        first = prepared[0]
        options = first.options  # job values: the same for every step
        sizes = tuple(len(w.step.window) for w in prepared)
        packed = len(prepared) > 1

        def cat(parts: list[Tensor], dim: int) -> Tensor:
            return torch.cat(parts, dim=dim) if packed else parts[0]

        dit = self.dit.get()
        g_text, g_audio = float(options["text_guidance"]), float(options["audio_guidance"])
        with self.timings.model("a2v"):
            audio = cat([dit.audio_tokens(w.audio_windows) for w in prepared], 1)  # type: ignore[operator]
            silent = (cat([dit.audio_tokens(torch.zeros_like(w.audio_windows)) for w in prepared], 1)  # type: ignore[operator]
                      if g_audio != 1.0 else None)
            velocity = guided_velocity(dit, cat([w.cond for w in prepared], 2), first.context, audio, silent,
                                       g_text, g_audio, windows=sizes if packed else None)
            sampler = WanEulerSampler(int(options["steps"]), float(options["shift"]))
            noise = cat([w.noise for w in prepared], 2)
            x0 = sampler.sample(velocity, noise, cat([w.clean for w in prepared], 2).to(noise.dtype),
                                cat([w.known_BT for w in prepared], 1))
        out: list[dict[Port[Any], object]] = []
        for w, x0_w in zip(prepared, torch.split(x0, list(sizes), dim=2) if packed else [x0], strict=True):
            g0 = w.step.generate.start - w.step.window.start
            out.append({P.STEP_LATENTS: x0_w[:, :, g0 : g0 + len(w.step.generate)].contiguous()})
        return out

    def reencode(self, latents: Tensor, n: int) -> Tensor:
        """Upstream's motion frames: decode ``latents`` on their own, encode the last ``1 + 4(n - 1)``
        video frames again as a clip → ``n`` latents."""
        vae = self.vae.get()
        with self.timings.model("vae.reencode"):
            frames = vae.decode_chunk(latents, vae.new_cache())  # type: ignore[operator]
            out: Tensor = vae.encode(frames[:, :, -(1 + 4 * (n - 1)):])  # type: ignore[operator]
        return out.to(latents.dtype)


@dataclass(frozen=True)
class _Window:
    """What one step's sampling needs (:meth:`WanA2VStage.prepare`)."""

    step: ChunkStep
    noise: Tensor
    cond: Tensor
    clean: Tensor
    known_BT: Tensor
    audio_windows: Tensor
    options: dict[str, Any]  # job values: the same for every window
    context: tuple[Tensor, Tensor]


def guided_velocity(dit: object, cond: Tensor, context: tuple[Tensor, Tensor], audio: Tensor,
                    silent: Tensor | None, g_text: float, g_audio: float, *,
                    windows: tuple[int, ...] | None = None) -> Callable[[Tensor, Tensor], Tensor]:
    """The sampler's ``velocity(x, t)``: every guidance branch in one batched DiT forward (over
    several windows packed along T: ``windows``, their latent frame counts)."""
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
        v = dit(x_BCThw.expand(nb, *x_BCThw.shape[1:]), cond_nb, t_B, ctx_nb, audio_nb,  # type: ignore[operator]
                windows=windows)
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
