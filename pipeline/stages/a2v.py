"""A2VStage: multi-step flow-matching sampling of one step's low-res latents.

One DiT serves both chunk kinds: the step's window holds known (clean) frames and unknown frames to
generate. For ``N_k`` the known frames are the last C frames of ``N_{k-1}`` (kept as latents, never
decoded and re-encoded); for ``I_k`` they are the two anchors, ``N_k``'s last frame and
``N_{k+1}``'s frame ``e``. Predictions at known positions are discarded.

Audio guidance (``ModelPreset.audio_guidance`` g != 1): every velocity is
``v(silence) + g * (v(audio) - v(silence))``, both halves in one batched forward. Silence is a
condition the model saw in every pause of its training speech, so it needs no condition dropout in
training; the guidance amplifies what the audio changes — the mouth.
"""

from __future__ import annotations

import torch

from pipeline import ports as P
from pipeline.module import Module
from pipeline.schedule import ChunkKind, ChunkStep
from pipeline.stage import Phase, Stage, Values
from pipeline.stages.common import Timings


class A2VStage(Stage):
    name = "a2v"
    phase = Phase.STEP
    inputs = (P.STEP, P.ROLLING, P.REF_LATENT, P.REF_LOWRES, P.TEXT_TOKENS, P.TEXT_MASK, P.AUDIO_FEATS,
              P.AUDIO_FEATS_SILENT, P.NOISE)
    outputs = (P.A2V_CONTEXT, P.STEP_LATENTS)

    def __init__(self, dit: Module, sampler: object, *, timings: Timings, audio_guidance: float = 1.0) -> None:
        self.dit = dit
        self.sampler = sampler  # models.sampler.FlowMatchEulerSampler (no weights)
        self.timings = timings
        self.audio_guidance = audio_guidance

    def modules(self) -> list[object]:
        return [self.dit]

    @torch.no_grad()
    def setup(self, values: Values) -> None:
        # Reference and text tokens are the same for every step of every chunk: embed them once.
        with self.timings.model("a2v"):
            context = self.dit.get().embed_context(  # type: ignore[operator]
                values.get(P.REF_LATENT), values.get_optional(P.TEXT_TOKENS), values.get_optional(P.TEXT_MASK))
        values.put(P.A2V_CONTEXT, tuple(context))

    @torch.no_grad()
    def run(self, values: Values) -> None:
        step = values.get(P.STEP)
        noise = values.get(P.NOISE)
        known_BT = torch.tensor([step.known_mask()], dtype=torch.bool)
        known = torch.zeros_like(noise)
        if step.known:
            positions = [i for i, is_known in enumerate(step.known_mask()) if is_known]
            known[:, :, positions] = self._known_latents(step, values).to(noise.dtype)
        frame_index_BT = torch.tensor([list(step.window)], dtype=torch.long)
        ref, audio = values.get(P.REF_LATENT), values.get(P.AUDIO_FEATS)
        context = values.get(P.A2V_CONTEXT)
        dit = self.dit.get()
        g = self.audio_guidance
        silent = values.get_optional(P.AUDIO_FEATS_SILENT) if g != 1.0 else None
        if g != 1.0 and silent is None:
            raise RuntimeError("audio guidance needs the context stage's silence features (silence_features=True)")
        # the DiT's batch: [audio] alone, or [audio, silence] in one forward (audio guidance)
        nb = 1 if silent is None else 2
        audio_nb = audio if silent is None else torch.cat([audio, silent])
        known_nb, index_nb = known_BT.expand(nb, -1), frame_index_BT.expand(nb, -1)
        ref_nb = ref.expand(nb, *ref.shape[1:])
        tokens, mask = context
        context_nb = (tokens.expand(nb, *tokens.shape[1:]), None if mask is None else mask.expand(nb, -1))

        def velocity(x_BCThw: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            t_B = t.reshape(-1)[:1].expand(nb).to(x_BCThw.dtype)
            v = dit(x_BCThw.expand(nb, *x_BCThw.shape[1:]), t_B, known_nb, index_nb, ref_nb, audio_nb, context=context_nb)
            if silent is None:
                return v  # type: ignore[no-any-return]
            v_audio, v_silent = v.chunk(2)
            return v_silent + g * (v_audio - v_silent)  # type: ignore[no-any-return]

        with self.timings.model("a2v"):
            x0 = self.sampler.sample(velocity, noise, known, known_BT)  # type: ignore[attr-defined]
        g0 = step.generate.start - step.window.start
        values.put(P.STEP_LATENTS, x0[:, :, g0 : g0 + len(step.generate)].contiguous())

    @staticmethod
    def _known_latents(step: ChunkStep, values: Values) -> torch.Tensor:
        """The known frames of the step's window, in window order."""
        parts = [values.get(P.REF_LOWRES)] if step.reference_slot else []  # ChunkPlan.reference_frame
        from_state = len(step.known) - len(parts)
        if from_state:
            state = values.get(P.ROLLING)
            if state.last_n is None:
                raise RuntimeError(f"{step.name} needs the previous N chunk but the rolling state has none")
            if step.kind is ChunkKind.N:
                parts.append(state.last_n[:, :, -from_state:])
            else:
                if state.prev_last is None:
                    raise RuntimeError(f"{step.name} needs its left anchor but the rolling state has none")
                e = len(step.generate)
                parts += [state.prev_last, state.last_n[:, :, e : e + 1]]
        return torch.cat(parts, dim=2)
