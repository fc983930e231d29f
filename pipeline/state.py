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

A snapshot carries two keys, and :meth:`restore` continues only a render with the same ones: the
plan's (``ChunkPlan.key``: frames, chunk shape, I chunks, grid) and the resume key ``render()`` builds
(:data:`ResumeKey`: family, preset and a digest of its definition, the options as the family
resolved them, seed, text and reference image digests, and the identity of the loaded weights,
``pipeline.weights_identity``). Anything else — a deploy that changed the preset's defaults or
shipped other weights between two attempts — would continue the old latents with another method or
model, and the video would change at the seam.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import TypeAlias

import torch

from pipeline.errors import ResumeStateError
from pipeline.schedule import PlanKey

# 2: ChunkPlan(reference_frame=True) re-anchors every N chunk (it anchored N_0 only in 1), so a
# version-1 snapshot of such a plan would resume into different windows.
# 3: snapshots carry the resume key (options, model, seed, text, reference); a version-2 snapshot has
# none, so nothing shows it was made with this job's options and weights: it is refused like a
# mismatch (and a worker renders the job from the beginning).
SNAPSHOT_VERSION = 3

ResumeKey: TypeAlias = dict[str, str | int | float | None]
"""What decides the frames besides the plan, flat (``"options.steps"``, ``"weights"``, ...): built by
``pipeline.render.resume_key``; compared key by key so a refusal names what differs."""

# how a refusal groups what differs (anything else is named by its own key)
_MODEL_KEYS = ("family", "preset", "preset_config", "weights")
_SHOW = 80  # characters of a value quoted in a refusal
_PLAN_FIELDS = ("plan (frames, L, C, e, I chunks, reference frame[, grid stride, causal first, reference first, "
                "video frames])")


@dataclass
class RollingState:
    next_step: int = 0  # index into ChunkPlan.steps of the next step to run
    next_emission: int = 0  # index of the next emission (= fragment index)
    last_n: torch.Tensor | None = None  # latents_BCThw of the most recent N chunk (low-res)
    prev_last: torch.Tensor | None = None  # latents_BC1hw: last frame of the N chunk before last_n
    decoder_cache: list[torch.Tensor] = field(default_factory=list)
    plan_key: PlanKey = (0, 0, 0, 0, True, False)  # ChunkPlan.key
    resume_key: ResumeKey = field(default_factory=dict)  # render()'s resume_key

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
                "resume_key": dict(self.resume_key),
            },
            buf,
        )
        return buf.getvalue()

    @classmethod
    def restore(cls, data: bytes, *, plan_key: PlanKey, resume_key: ResumeKey,
                device: torch.device | str = "cpu") -> RollingState:
        """The state ``data`` (a :meth:`snapshot`) holds, for a render of ``plan_key`` and
        ``resume_key``. Raises :class:`~pipeline.errors.ResumeStateError` (``field="resume_state"``)
        when the bytes are no snapshot of this version or either key differs, naming what differs."""
        fix = ("render from the beginning without resume_state (a worker does so itself, discarding "
               "the segments made under the snapshot)")
        try:
            raw = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
            version = raw.get("version")
        except Exception as exc:
            raise ResumeStateError(
                f"resume_state is not a longtake rolling-state snapshot ({exc}); {fix}", differs=("unreadable",)
            ) from exc
        if version != SNAPSHOT_VERSION:
            raise ResumeStateError(
                f"resume_state has snapshot version {version!r}, this build reads {SNAPSHOT_VERSION} "
                f"(older snapshots do not record the options and model they were made with); {fix}",
                differs=("version",))
        was: ResumeKey = dict(raw["resume_key"])
        was["plan"] = str(tuple(raw["plan_key"]))
        now: ResumeKey = dict(resume_key)
        now["plan"] = str(tuple(plan_key))
        differs = tuple(k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))
        if differs:
            raise ResumeStateError(f"resume_state was made for another render: {_describe(differs, was, now)}; "
                                   f"{fix}", differs=differs)
        return cls(
            next_step=int(raw["next_step"]),
            next_emission=int(raw["next_emission"]),
            last_n=raw["last_n"],
            prev_last=raw["prev_last"],
            decoder_cache=list(raw["decoder_cache"]),
            plan_key=plan_key,
            resume_key=dict(resume_key),
        )


def _describe(differs: tuple[str, ...], was: ResumeKey, now: ResumeKey) -> str:
    """``the options (options.steps: 5 in the snapshot, 3 now), the model (weights: ...)``."""

    def show(v: str | int | float | None) -> str:
        text = "absent" if v is None else repr(v)
        return text if len(text) <= _SHOW else text[: _SHOW - 1] + "…"

    groups: dict[str, list[str]] = {}
    for k in differs:
        kind = ("the options" if k.startswith("options.") else "the model" if k in _MODEL_KEYS
                else "the chunk plan" if k == "plan" else f"the {k}")
        label = _PLAN_FIELDS if k == "plan" else k
        groups.setdefault(kind, []).append(f"{label}: {show(was.get(k))} in the snapshot, {show(now.get(k))} now")
    return ", ".join(f"{kind} ({'; '.join(items)})" for kind, items in groups.items())
