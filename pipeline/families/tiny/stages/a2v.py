"""A2VStage: multi-step flow-matching sampling of one step's low-res latents.

One DiT serves both chunk kinds: the step's window holds known (clean) frames and unknown frames to
generate. For ``N_k`` the known frames are the last C frames of ``N_{k-1}`` (kept as latents, never
decoded and re-encoded); for ``I_k`` they are the two anchors, ``N_k``'s last frame and
``N_{k+1}``'s frame ``e``. Predictions at known positions are discarded.

Audio guidance (the request's ``options["audio_guidance"]`` g != 1, default
``ModelPreset.audio_guidance``): every velocity is ``v(silence) + g * (v(audio) - v(silence))``, both
halves in one batched forward. Silence is a condition the model saw in every pause of its training
speech, so it needs no condition dropout in training; the guidance amplifies what the audio changes —
the mouth. ``options["audio_guidance_peak"]`` (default ``ModelPreset.audio_guidance_peak``, else g)
makes g a map (:func:`peak_guidance`): the peak on the cells the audio moves most in each frame, g
on the rest, ``ModelPreset.audio_guidance_focus`` deciding how sharply. The sampler (``models.sampler.FlowMatchEulerSampler``, the preset's shift) takes
``options["steps"]`` steps (default ``ModelPreset.num_steps``) from flow time ``options["start_noise"]``
for N chunks and ``options["interp_start_noise"]`` for I chunks (defaults ``ModelPreset.start_noise``
/ ``interp_start_noise``); all are job values (``pipeline.ports.OPTIONS``, checked by
``TinyFamily.options``), read per step.

Sampling from a guess (start < 1, :func:`step_prior`): an N chunk's unknown frames start from the
reference's low-res latent, an I chunk's from the straight line between its two anchors, each noised
to its kind's start. The A2V sees the reference in every N window (the reference slot) and still
draws where the head and its features go from noise in the first steps; starting on the reference
keeps them where the reference has them. An I chunk's line already holds where the head goes, from
one anchor to the other: the later its start, the more of that path it draws anew, and a path drawn
anew shows as a jump at the seams (models/checkpoints/MODEL_CARD.md, measured).

Batched steps (:class:`~pipeline.stage.BatchedStage`): the pipeline may hand ``I_{k-1}`` and
``N_{k+1}`` over together; their windows are packed along T and sampled as one, each window
attending only to itself (``A2VDiT.forward(windows=)``) and each frame on its own window's schedule
(the sampler's per-frame starts, the DiT's time per frame), so each step's latents are those of its
own sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from models.sampler import FlowMatchEulerSampler
from pipeline.families.tiny import ports as P
from pipeline.module import Module
from pipeline.schedule import ChunkKind, ChunkStep
from pipeline.stage import BatchedStage, Port, Values
from pipeline.stage_common import Timings, known_positions


class A2VStage(BatchedStage):
    name = "a2v"
    inputs = (P.STEP, P.ROLLING, P.OPTIONS, P.REF_LATENT, P.REF_LOWRES, P.TEXT_TOKENS, P.TEXT_MASK,
              P.AUDIO_FEATS, P.AUDIO_FEATS_SILENT, P.NOISE)
    outputs = (P.A2V_CONTEXT, P.STEP_LATENTS)

    def __init__(self, dit: Module, *, timings: Timings, shift: float, guidance_focus: float) -> None:
        self.dit = dit
        self.timings = timings
        self.shift = shift  # the sampler's (ModelPreset.shift); its steps are the request's
        self.focus = guidance_focus  # ModelPreset.audio_guidance_focus; the peak is the request's

    def modules(self) -> list[object]:
        return [self.dit]

    @torch.no_grad()
    def setup(self, values: Values) -> None:
        # Reference and text tokens are the same for every step of every chunk: embed them once.
        with self.timings.model("a2v"):
            context = self.dit.get().embed_context(  # type: ignore[operator]
                values.get(P.REF_LATENT), values.get_optional(P.TEXT_TOKENS), values.get_optional(P.TEXT_MASK))
        values.put(P.A2V_CONTEXT, tuple(context))

    def prepare(self, values: Values) -> _Window:
        step = values.get(P.STEP)
        noise = values.get(P.NOISE)
        device = noise.device  # the step's tensors live where the latents do
        known_BT = torch.tensor([step.known_mask()], dtype=torch.bool, device=device)
        known = torch.zeros_like(noise)
        ref_lowres = values.get(P.REF_LOWRES).to(noise.dtype)
        if step.known:
            state = values.get(P.ROLLING)
            known[:, :, known_positions(step, device)] = known_latents(
                step, ref_lowres, state.last_n, state.prev_last).to(noise.dtype)
        frame_index_BT = torch.tensor([list(step.window)], dtype=torch.long, device=device)
        options = values.get(P.OPTIONS)
        guidance, steps = float(options["audio_guidance"]), int(options["steps"])
        peak = float(options["audio_guidance_peak"])
        start = float(options["interp_start_noise" if step.kind is ChunkKind.I else "start_noise"])
        silent = values.get_optional(P.AUDIO_FEATS_SILENT) if guidance != 1.0 else None
        prior = step_prior(step, ref_lowres, known)  # unused by the sampler where start is 1
        return _Window(step, noise, known, known_BT, frame_index_BT, values.get(P.AUDIO_FEATS), silent,
                       values.get(P.REF_LATENT), values.get(P.A2V_CONTEXT), guidance, peak, steps, start, prior)

    @torch.no_grad()
    def run_batch(self, prepared: Sequence[_Window]) -> list[dict[Port[Any], object]]:
        """One sampling over the windows packed along T (``A2VDiT.forward(windows=)``): one DiT
        forward per sampler step for all of them; each window's result equals its own sampling."""
        first = prepared[0]
        sizes = tuple(len(w.step.window) for w in prepared)
        packed = len(prepared) > 1

        def cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
            return torch.cat(parts, dim=dim) if packed else parts[0]

        silent = None if first.silent is None else cat([w.silent for w in prepared if w.silent is not None], 1)  # all or none
        known_BT = cat([w.known_BT for w in prepared], 1)
        velocity = velocity_fn(self.dit.get(), known_BT, cat([w.frame_index_BT for w in prepared], 1), first.ref,
                               cat([w.audio for w in prepared], 1), first.context, silent, first.guidance,
                               windows=sizes if packed else None, peak=first.peak, focus=self.focus)
        sampler = FlowMatchEulerSampler(first.steps, self.shift)  # no weights: one per sampling is free
        starts = [w.start for w, n in zip(prepared, sizes, strict=True) for _ in range(n)]  # each its kind's
        with self.timings.model("a2v"):
            x0 = sampler.sample(velocity, cat([w.noise for w in prepared], 2), cat([w.known for w in prepared], 2),
                                known_BT, cat([w.prior for w in prepared], 2), starts)
        out: list[dict[Port[Any], object]] = []
        for w, x0_w in zip(prepared, torch.split(x0, list(sizes), dim=2) if packed else [x0], strict=True):
            g0 = w.step.generate.start - w.step.window.start
            out.append({P.STEP_LATENTS: x0_w[:, :, g0 : g0 + len(w.step.generate)].contiguous()})
        return out


@dataclass(frozen=True)
class _Window:
    """What one step's sampling needs (:meth:`A2VStage.prepare`)."""

    step: ChunkStep
    noise: torch.Tensor
    known: torch.Tensor
    known_BT: torch.Tensor
    frame_index_BT: torch.Tensor
    audio: torch.Tensor
    silent: torch.Tensor | None
    ref: torch.Tensor  # job values: the same for every window
    context: tuple[torch.Tensor, torch.Tensor | None]
    guidance: float  # the request's options: audio guidance and its peak, sampler steps, this kind's start time
    peak: float
    steps: int
    start: float
    prior: torch.Tensor  # the unknown frames' guess (used where start < 1), the window's shape


def known_latents(step: ChunkStep, ref_lowres: torch.Tensor, last_n: torch.Tensor | None,
                  prev_last: torch.Tensor | None) -> torch.Tensor:
    """The known frames of the step's window, in window order: the reference slot (with
    ``ChunkPlan.reference_frame``), then the context of an N chunk or the two anchors of an I chunk."""
    parts = [ref_lowres] if step.reference_slot else []
    from_state = len(step.known) - len(parts)
    if from_state:
        if last_n is None:
            raise RuntimeError(f"{step.name} needs the previous N chunk but the rolling state has none")
        if step.kind is ChunkKind.N:
            parts.append(last_n[:, :, -from_state:])
        else:
            if prev_last is None:
                raise RuntimeError(f"{step.name} needs its left anchor but the rolling state has none")
            e = len(step.generate)
            parts += [prev_last, last_n[:, :, e : e + 1]]
    return torch.cat(parts, dim=2)


def step_prior(step: ChunkStep, ref_lowres: torch.Tensor, known_BCThw: torch.Tensor) -> torch.Tensor:
    """The guess sampling starts from (``start_noise`` < 1), the window's shape: for an N chunk the
    reference's low-res latent at every frame; for an I chunk the straight line between its two
    anchors, the window's first and last frames in ``known_BCThw`` (the window with its known frames
    in place, as :class:`A2VStage` builds it from :func:`known_latents`), position ``i`` at
    ``i / (T - 1)`` of the way. Known positions are overwritten by the sampler."""
    if step.kind is ChunkKind.N:
        return ref_lowres.expand_as(known_BCThw)
    mask = step.known_mask()
    if not (mask[0] and mask[-1]):
        raise RuntimeError(f"{step.name}: an I window's anchors must be its first and last frames, got {mask}")
    T = known_BCThw.shape[2]
    w = torch.linspace(0.0, 1.0, T, dtype=known_BCThw.dtype, device=known_BCThw.device)[None, None, :, None, None]
    return torch.lerp(known_BCThw[:, :, :1], known_BCThw[:, :, -1:], w)


def velocity_fn(dit: object, known_BT: torch.Tensor, frame_index_BT: torch.Tensor, ref: torch.Tensor,
                audio: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor | None],
                silent: torch.Tensor | None = None, guidance: float = 1.0, *,
                windows: tuple[int, ...] | None = None, peak: float, focus: float
                ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The sampler's ``velocity(x, t)``, ``t`` a time per frame (the stage samples with per-frame
    starts), for one window (or several packed along T: ``windows``, their frame counts); with
    ``guidance`` != 1 the DiT runs once over the batch [audio, silence] and returns
    ``v(silence) + g * (v(audio) - v(silence))``: ``g`` is ``guidance`` everywhere when ``peak``
    equals it, else :func:`peak_guidance`'s map (``peak`` where the audio moves the velocity
    most in the frame)."""
    if guidance != 1.0 and silent is None:
        raise RuntimeError("audio guidance needs the context stage's silence features (it computes them when "
                           "the request's options['audio_guidance'] != 1)")
    if guidance == 1.0:
        silent = None
    nb = 1 if silent is None else 2
    audio_nb = audio if silent is None else torch.cat([audio, silent])
    known_nb, index_nb = known_BT.expand(nb, -1), frame_index_BT.expand(nb, -1)
    ref_nb = ref.expand(nb, *ref.shape[1:])
    tokens, mask = context
    context_nb = (tokens.expand(nb, *tokens.shape[1:]), None if mask is None else mask.expand(nb, -1))

    def velocity(x_BCThw: torch.Tensor, t_BT: torch.Tensor) -> torch.Tensor:  # a time per frame; B is 1
        v: torch.Tensor = dit(x_BCThw.expand(nb, *x_BCThw.shape[1:]), t_BT.expand(nb, -1), known_nb, index_nb,  # type: ignore[operator]
                              ref_nb, audio_nb, context=context_nb, windows=windows)
        if silent is None:
            return v
        v_audio, v_silent = v.chunk(2)
        d = v_audio - v_silent
        return v_silent + (guidance if peak == guidance else peak_guidance(d, guidance, peak, focus)) * d

    return velocity


def peak_guidance(d_BCThw: torch.Tensor, guidance: float, peak: float, focus: float) -> torch.Tensor:
    """Audio guidance per latent cell, ``(B, 1, T, h, w)``: ``guidance + (peak - guidance) * m ** focus``,
    ``m`` the cell's share of the frame's largest ``|v(audio) - v(silence)|`` (norm over channels,
    each frame on its own, so packed windows get what each would alone). The audio moves the mouth's
    cells most: a high ``focus`` keeps ``peak`` to them and ``guidance`` on the rest of the face,
    which a uniform ``peak`` would pull away from the reference (models/checkpoints/MODEL_CARD.md)."""
    a = d_BCThw.norm(dim=1, keepdim=True)
    m = a / a.amax(dim=(-2, -1), keepdim=True).clamp_min(1e-6)
    g: torch.Tensor = guidance + (peak - guidance) * m ** focus
    return g
