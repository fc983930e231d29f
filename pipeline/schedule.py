"""The N/I chunk plan: pure arithmetic over the low-resolution latent timeline (no tensors).

Terms (DESIGN §3). An N chunk holds ``L`` timeline frames, ``C`` boundary (context) frames and an
interpolation span ``e`` (``0 < e < L``).

* ``N_k`` generates timeline frames ``[kL, (k+1)L)`` (the last one may be short). ``N_0`` sees only
  the reference; ``N_k`` (k >= 1) also sees the last ``C`` frames of ``N_{k-1}`` as clean context.
  With ``reference_frame`` every N window also holds the reference's own low-res latent as one more
  known frame in front of it (``ChunkStep.reference_slot``): each chunk is re-anchored on the
  reference, so errors in the context cannot accumulate into drift.
* ``I_k`` runs after ``N_k`` and ``N_{k+1}``. Its anchors are ``N_k``'s last frame (``(k+1)L - 1``)
  and ``N_{k+1}``'s frame ``e`` (``(k+1)L + e``); it generates the ``e`` frames between them, which
  replace ``N_{k+1}[0:e]``. Its predictions at the anchor positions are discarded.
* When the last N chunk is too short to hold frame ``e``, the span shrinks to what fits
  (``e_k = len(N_{k+1}) - 1``); a one-frame last chunk gets no I chunk at all.
* Execution order: ``N0, N1, I0, N2, I1, …``. Emission follows the final timeline
  ``N_0[0:L], I_0 + N_1[e:L], I_1 + N_2[e:L], …``: emission ``j`` is always the timeline range
  ``[jL, (j+1)L)``, made final by ``N_0`` (j = 0), by ``I_{j-1}``, or by ``N_j`` when ``I_{j-1}``
  does not exist.

Timeline vs video frames (:class:`FrameGrid`). The timeline is the A2V model's latent timeline. For a
per-frame latent space (the tiny family) one timeline frame is one video frame. A causal video VAE
with temporal compression ``s`` (the Wan VAE: ``s = 4``) maps timeline frame 0 to one video frame
and every later one to ``s``: ``T`` timeline frames are ``1 + s(T - 1)`` video frames. The plan keeps
its N/I arithmetic on the timeline and translates ranges with :meth:`ChunkPlan.video_frames`; the
last emission is cut at ``num_video_frames`` (the audio's length), so the video is never longer than
the audio by more than a frame. With ``FrameGrid.reference_is_first`` the reference *is* timeline
frame 0 (image-to-video models: the first video frame is the reference image): ``N_0``'s window is
``[0, L)`` with frame 0 known (``reference_slot``) and generated through (its output there is the
reference's latent itself).

The plan is consumed by the pipeline and by the resume logic of the worker, both of which rely on
``steps`` being a pure function of ``(num_frames, L, C, e)`` and the grid.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

PlanKey = tuple[int | bool, ...]


class PlanError(ValueError):
    """A chunk-plan parameter is out of range; the message names the field and the fix."""


@dataclass(frozen=True)
class FrameGrid:
    """How timeline (latent) frames map to video frames; the default is one to one (tiny).

    ``stride``: video frames per timeline frame; ``causal_first``: timeline frame 0 is a single video
    frame (a causal VAE's first frame); ``reference_is_first``: the reference is timeline frame 0
    (see the module docstring). A family declares its grid (``ModelFamily.frame_grid``).
    """

    stride: int = 1
    causal_first: bool = False
    reference_is_first: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.stride, int) or self.stride < 1:
            raise PlanError(f"FrameGrid.stride={self.stride!r}: must be an integer >= 1 (video frames per latent)")

    @property
    def is_identity(self) -> bool:
        return self == FrameGrid()

    def video_start(self, t: int) -> int:
        """First video frame of timeline frame ``t`` (``t`` may be the end of a range)."""
        if not self.causal_first:
            return t * self.stride
        return 0 if t <= 0 else 1 + self.stride * (t - 1)

    def video_frames(self, timeline: range) -> range:
        """The video frames of the timeline range (unclipped)."""
        return range(self.video_start(timeline.start), self.video_start(timeline.stop))

    def timeline_frames(self, num_video_frames: int) -> int:
        """Fewest timeline frames whose video frames cover ``num_video_frames``."""
        if self.causal_first:
            return 1 + -(-(num_video_frames - 1) // self.stride)
        return -(-num_video_frames // self.stride)


class ChunkKind(StrEnum):
    N = "N"
    I = "I"  # noqa: E741 - the write-up's name for interpolation chunks


@dataclass(frozen=True)
class Emission:
    """A timeline range made final by a step, and where each of its frames comes from.

    ``from_step`` frames are taken from the step's own output, ``from_pending`` from the pending N
    chunk (the N chunk the I chunk completed). Both are absolute timeline ranges, ordered, and
    together they tile ``frames`` exactly.
    """

    index: int
    frames: range
    from_step: range
    from_pending: range


@dataclass(frozen=True)
class ChunkStep:
    """One forward pass of the A2V model over a window of the timeline.

    ``window`` is the absolute range of timeline frames the model sees; ``known`` are the positions
    inside it that are given clean (context for N, anchors for I); ``generate`` the positions whose
    predictions are kept. ``emission`` is the range this step makes final, if any. With
    ``reference_slot`` the window's first position (``known[0]``) holds the reference's low-res latent
    instead of that timeline frame (the frame itself is never read: it is before the context); with
    ``FrameGrid.reference_is_first`` N_0's slot is timeline frame 0 itself, which is then both known
    and in ``generate`` (the sampler returns it clean: the reference's latent).
    """

    kind: ChunkKind
    index: int
    window: range
    known: tuple[int, ...]
    generate: range
    emission: Emission | None
    reference_slot: bool = False

    @property
    def name(self) -> str:
        return f"{self.kind.value}{self.index}"

    def known_mask(self) -> list[bool]:
        """Per window frame: True where the frame is given clean."""
        known = set(self.known)
        return [t in known for t in self.window]


def can_share_forward(first: ChunkStep, second: ChunkStep) -> bool:
    """Whether ``second`` (run right after ``first``) reads nothing ``first`` writes, so both can be
    sampled in one batch: only N chunks write the rolling state later steps read (the last N chunk,
    its last frame), an I chunk's output is only published. So an I chunk and the N chunk after it
    — ``I_{k-1}`` and ``N_{k+1}``, both anchored on ``N_k`` and earlier (DESIGN §3) — qualify."""
    return first.kind is ChunkKind.I and second.kind is ChunkKind.N


@dataclass(frozen=True)
class ReleasedStep:
    """A step ready to run, with what the chunk loop needs to publish its emission.

    ``plan`` holds the step at ``index`` of its ``steps``: the whole plan, or — live, while the feed
    runs — the plan that ends with the step's N chunk (:meth:`LiveChunkPlan.growing`), which agrees
    with the whole plan on every step it has. ``is_final``: ``plan`` is the whole plan, so it knows
    where the video ends. ``arrival_t`` (live): ``time.time()`` at which the last audio the step
    needs had arrived.
    """

    index: int
    step: ChunkStep
    plan: ChunkPlan
    is_final: bool = True
    arrival_t: float | None = None

    @property
    def video(self) -> range:
        """The video frames of the step's emission (cut at the video's end)."""
        if self.step.emission is None:
            return range(0)
        return self.plan.video_frames(self.step.emission.frames)

    @property
    def is_last_emission(self) -> bool:
        e = self.step.emission
        return e is not None and self.is_final and e.index == self.plan.num_emissions - 1


@dataclass(frozen=True)
class ChunkPlan:
    """The whole schedule for ``num_frames`` timeline frames."""

    num_frames: int
    chunk_frames: int  # L
    context_frames: int  # C
    interp_frames: int  # e
    use_i_chunks: bool = True  # False: the conventional baseline, N chunks only (seams measured against it)
    # True: every N window starts with the reference's own low-res latent as one more known frame
    # (N_0 at timeline position -1, N_k just before its context); for models trained that way
    reference_frame: bool = False
    grid: FrameGrid = FrameGrid()  # timeline -> video frames (default: one to one)
    num_video_frames: int = 0  # the video's length (the last emission is cut there); 0: the whole timeline

    def __post_init__(self) -> None:
        validate_plan_params(self.num_frames, self.chunk_frames, self.context_frames, self.interp_frames)
        if self.grid.reference_is_first and self.reference_frame:
            raise PlanError("reference_frame (a reference slot in front of every N window) and "
                            "FrameGrid.reference_is_first (the reference is timeline frame 0) exclude each "
                            "other: pick one")
        full = self.grid.video_start(self.num_frames)
        if not isinstance(self.num_video_frames, int) or not (
                0 <= self.num_video_frames <= full
                and (self.num_video_frames == 0 or self.grid.timeline_frames(self.num_video_frames) == self.num_frames)):
            raise PlanError(f"num_video_frames={self.num_video_frames!r}: {self.num_frames} timeline frames are "
                            f"{full} video frames; pass a count they cover with no spare timeline frame "
                            "(FrameGrid.timeline_frames), or 0")

    @property
    def total_video_frames(self) -> int:
        return self.num_video_frames or self.grid.video_start(self.num_frames)

    def video_frames(self, timeline: range) -> range:
        """The video frames of a timeline range, cut at the video's end."""
        r = self.grid.video_frames(timeline)
        end = self.total_video_frames
        return range(min(r.start, end), min(r.stop, end))

    @property
    def num_n_chunks(self) -> int:
        return -(-self.num_frames // self.chunk_frames)

    def n_range(self, k: int) -> range:
        L = self.chunk_frames
        return range(k * L, min((k + 1) * L, self.num_frames))

    def interp_span(self, k: int) -> int:
        """``e_k``: frames generated by ``I_k`` (0 when ``I_k`` does not exist)."""
        if k + 1 >= self.num_n_chunks or not self.use_i_chunks:
            return 0
        return min(self.interp_frames, len(self.n_range(k + 1)) - 1)

    @property
    def num_emissions(self) -> int:
        return self.num_n_chunks

    def emission_frames(self, j: int) -> range:
        return self.n_range(j)

    @property
    def steps(self) -> list[ChunkStep]:
        """Every step in execution order: N0, N1, I0, N2, I1, …"""
        return [step for k in range(self.num_n_chunks) for step in self.chunk_steps(k)]

    def released(self, start: int = 0) -> Iterator[ReleasedStep]:
        """The steps from index ``start`` on, one N chunk at a time (nothing held for the whole plan)."""
        i = 0
        for k in range(self.num_n_chunks):
            for step in self.chunk_steps(k):
                if i >= start:
                    yield ReleasedStep(i, step, self)
                i += 1

    def chunk_steps(self, k: int) -> list[ChunkStep]:
        """The steps released with ``N_k``: ``N_k`` itself, then ``I_{k-1}`` when it exists (it needs
        only ``N_k`` and earlier). ``steps`` is their concatenation over ``k``; the live plan
        (:class:`LiveChunkPlan`) calls this on growing plans, one ``k`` at a time."""
        L, C = self.chunk_frames, self.context_frames
        gen = self.n_range(k)
        ctx = range(max(0, gen.start - C), gen.start) if k > 0 else range(gen.start, gen.start)
        if self.reference_frame:
            ctx = range(ctx.start - 1, ctx.stop)
        elif self.grid.reference_is_first and k == 0:
            ctx = range(0, 1)  # the reference is frame 0: known, and part of N_0's output
        emission = None
        if k == 0:
            emission = Emission(0, gen, gen, range(gen.stop, gen.stop))
        elif self.interp_span(k - 1) == 0:
            # no I chunk will complete this N chunk: it is final as it stands
            emission = Emission(k, gen, gen, range(gen.stop, gen.stop))
        out = [ChunkStep(ChunkKind.N, k, range(ctx.start, gen.stop), tuple(ctx), gen, emission,
                         reference_slot=self.reference_frame or (self.grid.reference_is_first and k == 0))]
        e_i = self.interp_span(k - 1) if k >= 1 else 0
        if e_i:
            left, right = k * L - 1, k * L + e_i
            inner = range(left + 1, right)
            emission = Emission(k, gen, inner, range(right, gen.stop))
            out.append(ChunkStep(ChunkKind.I, k - 1, range(left, right + 1), (left, right), inner, emission))
        return out

    @property
    def key(self) -> PlanKey:
        """What identifies the plan: a resume snapshot is only valid for the same key. The grid's
        fields are appended only when it is not the identity, so a one-to-one plan keeps the key (and
        the snapshots) it always had."""
        base: PlanKey = (self.num_frames, self.chunk_frames, self.context_frames, self.interp_frames,
                         self.use_i_chunks, self.reference_frame)
        if self.grid.is_identity and not self.num_video_frames:
            return base
        return (*base, self.grid.stride, self.grid.causal_first, self.grid.reference_is_first,
                self.total_video_frames)

    def seams(self) -> list[int]:
        """First frame of every producer's span on the final timeline after frame 0: with I chunks
        both ``jL`` (where ``I_{j-1}`` starts) and ``jL + e_{j-1}`` (where ``N_j`` resumes)."""
        out: set[int] = set()
        for step in self.steps:
            if step.emission is None:
                continue
            for part in (step.emission.from_step, step.emission.from_pending):
                if len(part) and part.start > 0:
                    out.add(part.start)
        return sorted(out)

    def describe(self) -> str:
        return " -> ".join(s.name for s in self.steps)


@dataclass(frozen=True)
class LiveChunkPlan:
    """The open-ended plan of a live render: :class:`ChunkPlan`'s steps, released as the audio grows.

    The final length is unknown until the feed ends, so the steps come out one N chunk at a time:
    ``N_k`` with ``I_{k-1}`` (:meth:`ChunkPlan.chunk_steps`), taken from :meth:`growing` (the plan that
    ends with ``N_k``) while the feed runs and from :meth:`final` once it ended. Both are exactly the
    steps of ``ChunkPlan(num_frames=final length)``: a plan's chunk ``k`` depends on the length only
    through whether ``N_k`` and ``N_{k+1}`` are full, which is known once the audio reaches one video
    frame past ``N_k`` (the test of this equivalence is ``tests/unit/test_schedule.py``).

    When ``N_k`` (and ``I_{k-1}``) can run, before the feed ended: when the audio covers
    :meth:`release_video_frames` ``(k)`` video frames — ``N_k``'s last video frame, plus
    ``audio_lookahead_frames`` (the audio the family's step stages read past a window's last frame,
    ``ModelFamily.audio_lookahead_frames``), and at least one frame (so ``N_k`` is not the last chunk).
    ``I_{k-1}`` needs nothing later than ``N_k``: its window lies inside ``N_{k-1}`` and ``N_k``.

    Look-ahead (docs/live.md). Emission ``j`` covers ``N_j``'s frames and is made final by ``N_j``
    (N chunks only) or by ``I_{j-1}``, released with ``N_j``: in **both** modes it can be rendered once
    the audio reaches :attr:`lookahead_video_frames` video frames past its own last frame. Its first
    frame waits a chunk more (its own chunk's audio). The I mode costs compute — one more step before
    each emission is final — not audio look-ahead: ``I_{k-1}`` replaces the head of ``N_k``, not the
    tail of ``N_{k-1}``.
    """

    chunk_frames: int  # L
    context_frames: int  # C
    interp_frames: int  # e
    use_i_chunks: bool = True  # False: the low-latency mode (N chunks only, context still latents)
    reference_frame: bool = False
    grid: FrameGrid = FrameGrid()
    audio_lookahead_frames: int = 0  # video frames of audio a step reads past its window's last frame

    def __post_init__(self) -> None:
        validate_plan_params(1, self.chunk_frames, self.context_frames, self.interp_frames)
        if not isinstance(self.audio_lookahead_frames, int) or self.audio_lookahead_frames < 0:
            raise PlanError(f"audio_lookahead_frames={self.audio_lookahead_frames!r}: must be an integer >= 0")
        self.growing(0)  # the flag combination is checked by ChunkPlan

    def growing(self, k: int) -> ChunkPlan:
        """The plan of a timeline that ends with a full ``N_k``: its chunk ``k`` is the final plan's
        whenever the final timeline is longer than ``(k + 1) L`` frames."""
        return self._plan((k + 1) * self.chunk_frames, 0)

    def final(self, num_video_frames: int) -> ChunkPlan:
        """The whole plan once the feed ended with ``num_video_frames`` video frames of audio."""
        num_frames = self.grid.timeline_frames(num_video_frames)
        return self._plan(num_frames, 0 if self.grid.is_identity else num_video_frames)

    def _plan(self, num_frames: int, num_video_frames: int) -> ChunkPlan:
        return ChunkPlan(num_frames, self.chunk_frames, self.context_frames, self.interp_frames,
                         use_i_chunks=self.use_i_chunks, reference_frame=self.reference_frame, grid=self.grid,
                         num_video_frames=num_video_frames)

    @property
    def lookahead_video_frames(self) -> int:
        """Video frames of audio past an emission's last frame before it can be rendered (both modes)."""
        return max(1, self.audio_lookahead_frames)

    def release_video_frames(self, k: int) -> int:
        """Video frames of audio that must have arrived to run ``N_k`` (and ``I_{k-1}``) while the
        feed has not ended."""
        return self.grid.video_start((k + 1) * self.chunk_frames) + self.lookahead_video_frames

    @property
    def key(self) -> PlanKey:
        """A live plan's rolling-state key (``num_frames`` 0: open-ended; sessions are not resumed)."""
        return (0, self.chunk_frames, self.context_frames, self.interp_frames, self.use_i_chunks,
                self.reference_frame)


def validate_plan_params(num_frames: int, chunk_frames: int, context_frames: int, interp_frames: int) -> None:
    """Raise :class:`PlanError` naming the first bad field."""
    if not isinstance(num_frames, int) or num_frames < 1:
        raise PlanError(
            f"num_frames={num_frames!r}: the audio must cover at least one video frame; "
            "pass a longer audio file"
        )
    if not isinstance(chunk_frames, int) or chunk_frames < 2:
        raise PlanError(f"chunk_frames (L)={chunk_frames!r}: must be an integer >= 2")
    if not isinstance(context_frames, int) or not 0 <= context_frames <= chunk_frames:
        raise PlanError(
            f"context_frames (C)={context_frames!r}: must be an integer in [0, L={chunk_frames}]"
        )
    if not isinstance(interp_frames, int) or not 0 < interp_frames < chunk_frames:
        raise PlanError(
            f"interp_frames (e)={interp_frames!r}: must be an integer with 0 < e < L={chunk_frames}"
        )


def frames_for_audio(num_samples: int, sample_rate: int, fps: int) -> int:
    """Video frames covering ``num_samples`` of audio: ceil, so no audio is cut off."""
    if num_samples <= 0:
        raise PlanError("audio has no samples: pass an audio file with sound in it")
    return -(-num_samples * fps // sample_rate)
