"""RollingState: everything that survives from one chunk to the next, and nothing else.

The constant-memory contract (DESIGN §4): across chunks the pipeline keeps only the reference
conditioning (job-scoped values, recomputed from the inputs on resume), the latents the next steps
need (``last_n``: the most recent N chunk, which is the pending N_{k+1} until I_k is done and whose
last C frames are the next N chunk's context; ``prev_last``: the last frame of the N chunk before it,
I_k's left anchor), the causal decoder's cache, and the position in the plan. All of it is a few
low-resolution latent frames plus a few decoder activations: its size depends on the chunk shape,
never on the video's length.

:meth:`snapshot` turns the state into bytes after each emission; the worker stores them next to the
committed segment so a retry resumes from there (:meth:`restore`) and produces the same frames.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import torch

from pipeline.errors import InvalidInputError
from pipeline.schedule import PlanKey

# 2: ChunkPlan(reference_frame=True) re-anchors every N chunk (it anchored N_0 only in 1), so a
# version-1 snapshot of such a plan would resume into different windows
SNAPSHOT_VERSION = 2


@dataclass
class RollingState:
    next_step: int = 0  # index into ChunkPlan.steps of the next step to run
    next_emission: int = 0  # index of the next emission (= fragment index)
    last_n: torch.Tensor | None = None  # latents_BCThw of the most recent N chunk (low-res)
    prev_last: torch.Tensor | None = None  # latents_BC1hw: last frame of the N chunk before last_n
    decoder_cache: list[torch.Tensor] = field(default_factory=list)
    plan_key: PlanKey = (0, 0, 0, 0, True, False)  # ChunkPlan.key

    def nbytes(self) -> int:
        tensors = [t for t in (self.last_n, self.prev_last) if t is not None] + list(self.decoder_cache)
        return sum(t.numel() * t.element_size() for t in tensors)

    def snapshot(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "version": SNAPSHOT_VERSION,
                "next_step": self.next_step,
                "next_emission": self.next_emission,
                "last_n": None if self.last_n is None else self.last_n.detach().cpu().clone(),
                "prev_last": None if self.prev_last is None else self.prev_last.detach().cpu().clone(),
                "decoder_cache": [t.detach().cpu().clone() for t in self.decoder_cache],
                "plan_key": list(self.plan_key),
            },
            buf,
        )
        return buf.getvalue()

    @classmethod
    def restore(cls, data: bytes, *, plan_key: PlanKey,
                device: torch.device | str = "cpu") -> RollingState:
        try:
            raw = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
        except Exception as exc:
            raise InvalidInputError(
                f"resume_state is not a longtake rolling-state snapshot ({exc}); start the render "
                "from the beginning (no resume state)", field="resume_state") from exc
        if raw.get("version") != SNAPSHOT_VERSION:
            raise InvalidInputError(
                f"resume_state has version {raw.get('version')!r}, this build reads {SNAPSHOT_VERSION}; "
                "start the render from the beginning", field="resume_state")
        if tuple(raw["plan_key"]) != tuple(plan_key):
            raise InvalidInputError(
                f"resume_state belongs to a plan {tuple(raw['plan_key'])} (frames, L, C, e, I chunks, reference frame[, grid stride, causal first, reference first, video frames]) but this "
                f"render plans {tuple(plan_key)}: the inputs or preset changed; start from the beginning",
                field="resume_state")
        return cls(
            next_step=int(raw["next_step"]),
            next_emission=int(raw["next_emission"]),
            last_n=raw["last_n"],
            prev_last=raw["prev_last"],
            decoder_cache=list(raw["decoder_cache"]),
            plan_key=plan_key,
        )
