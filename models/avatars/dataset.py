"""Talking-avatar clips on the fly: identity + speech + motion -> frames with per-frame ground truth.

Who calls what:

* Training scripts use :class:`AvatarClipDataset` (a map-style ``torch.utils.data.Dataset``; item
  ``i`` is a pure function of ``(split, seed, i)``) or :func:`render_clip` directly.
* ``bench.quality --ground-truth`` uses :class:`AvatarRenderer` to stream a long render frame by frame
  for any audio (constant memory: nothing but the current frame is kept).

Determinism: an identity is a pure function of its identity seed, a clip of ``(identity seed, clip
seed)``. Train and held-out identities come from disjoint seed ranges (:data:`IDENTITY_SPLITS`) and
train and held-out clips use disjoint voice lists (``speech.TRAIN_VOICES`` / ``HELDOUT_VOICES``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from models.avatars.face import Box, FaceIdentity, FaceRenderer, HeadPose
from models.avatars.speech import (
    SAMPLE_RATE,
    SpeechSynth,
    mouth_opening_track,
    mouth_width_track,
)

if TYPE_CHECKING:
    import torch

FPS = 25
IDENTITY_SPLITS: dict[str, tuple[int, int]] = {"train": (0, 1_000_000), "heldout": (1_000_000, 1_001_000)}
_BLINK_PROFILE = (0.35, 0.85, 1.0, 0.75, 0.3)


class MotionTrack:
    """Smooth head motion and blinks as pure functions of ``(seed, frame index)``, so a clip can start
    anywhere on an unbounded timeline. Motion amplitudes: +-6 px / +-4 px translation, +-4 degrees,
    +-3 % scale at 256 px (sums of three slow sinusoids per degree of freedom, 0.05-0.45 Hz)."""

    AMPLITUDE = {"dx": 6.0, "dy": 4.0, "angle_deg": 4.0, "scale": 0.03}

    def __init__(self, seed: int, size: int = 256, fps: int = FPS) -> None:
        rng = np.random.default_rng([seed, 99])
        self.seed, self.fps, self.size = seed, fps, size
        self._waves = {
            k: (rng.uniform(0.05, 0.45, 3), rng.uniform(0, 2 * np.pi, 3), rng.dirichlet(np.ones(3)))
            for k in self.AMPLITUDE
        }

    def _value(self, key: str, frame: int) -> float:
        f, ph, w = self._waves[key]
        t = frame / self.fps
        return float(self.AMPLITUDE[key] * np.sum(w * np.sin(2 * np.pi * f * t + ph)))

    def pose(self, frame: int) -> HeadPose:
        k = self.size / 256
        return HeadPose(dx=self._value("dx", frame) * k, dy=self._value("dy", frame) * k,
                        angle_deg=self._value("angle_deg", frame), scale=1.0 + self._value("scale", frame))

    def blink(self, frame: int) -> float:
        """Eyelid closure in [0, 1]: about one blink per 3 s slot, at a seeded frame in the slot."""
        slot_len = 3 * self.fps
        out = 0.0
        for slot in (frame // slot_len, frame // slot_len - 1):
            if slot < 0:
                continue
            rng = np.random.default_rng([self.seed, 7, slot])
            if rng.random() < 0.8:
                start = slot * slot_len + int(rng.integers(0, slot_len - len(_BLINK_PROFILE)))
                if start <= frame < start + len(_BLINK_PROFILE):
                    out = max(out, _BLINK_PROFILE[frame - start])
        return out


@dataclass(frozen=True)
class FrameTruth:
    """What the generator knows about one frame it drew (``bench.quality`` / ``bench.fidelity`` read it;
    ``FaceRenderer.region_masks(pose, mouth_open, mouth_width, blink)`` gives its region masks)."""

    mouth_open: float
    mouth_box: Box
    face_box: Box
    mouth_width: float = 0.5
    blink: float = 0.0
    pose: HeadPose = HeadPose()


class AvatarRenderer:
    """One identity, rendered for any audio. ``reference()`` is the neutral frame (no motion, mouth
    closed, eyes open) a model is conditioned on; ``stream(audio)`` yields (frame, truth) pairs."""

    def __init__(self, identity_seed: int, motion_seed: int | None = None, size: int = 256, fps: int = FPS) -> None:
        self.identity = FaceIdentity.sample(identity_seed)
        self.face = FaceRenderer(self.identity, size)
        self.motion = MotionTrack(identity_seed * 7919 + 1 if motion_seed is None else motion_seed, size, fps)
        self.fps = fps

    def reference(self) -> np.ndarray:
        return self.face.render(HeadPose(), 0.0, 0.5, 0.0)

    def reference_mouth_box(self) -> Box:
        return self.face.mouth_box(HeadPose())

    def reference_face_box(self) -> Box:
        return self.face.face_box(HeadPose())

    def reference_eyes_box(self) -> Box:
        return self.face.eyes_box(HeadPose())

    def coverage(self, truth: FrameTruth, regions: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Two ``(size, size)`` float32 maps of the frame ``truth`` describes, from one call of
        ``FaceRenderer.region_masks`` (a few ms): how much of each pixel shows one of ``regions`` (their
        union, in [0, 1]), and each pixel's *share* of the regions it shows: every region visible in the
        frame (at least one pixel's worth) sums to 1 over the frame, whatever its size, so a loss weighted
        by the share counts an earring as much as the glasses."""
        masks = self.face.region_masks(truth.pose, truth.mouth_open, truth.mouth_width, truth.blink, names=regions)
        union = np.zeros((self.face.size, self.face.size), np.float32)
        share = np.zeros_like(union)
        for m in masks.values():
            union += m
            area = float(m.sum())
            if area >= 1.0:
                share += m / area
        return np.clip(union, 0.0, 1.0), share

    def head_motion(self, truth: FrameTruth, cell: int) -> tuple[np.ndarray, np.ndarray]:
        """Where the head of the frame ``truth`` describes came from in the reference, per ``cell`` x
        ``cell`` cell (``FaceRenderer.reference_shift``: ``(2, h, w)``, dy, dx in pixels), and the cells
        the head covers whole, the ones that shift holds for (``(h, w)`` bool; the head's coverage from
        one ``region_masks`` call). Read by the decoder's motion loss (``FrameSampler.draw``) and
        ``bench.warp_error``."""
        bg = self.face.region_masks(truth.pose, truth.mouth_open, truth.mouth_width, truth.blink,
                                    names=("background",))["background"]
        n = self.face.size // cell
        head = (1.0 - bg).reshape(n, cell, n, cell).mean(axis=(1, 3)) >= 0.999
        return self.face.reference_shift(truth.pose, cell), head

    def frame(self, index: int, mouth_open: float, mouth_width: float) -> tuple[np.ndarray, FrameTruth]:
        pose, blink = self.motion.pose(index), self.motion.blink(index)
        img = self.face.render(pose, mouth_open, mouth_width, blink)
        return img, FrameTruth(mouth_open, self.face.mouth_box(pose), self.face.face_box(pose), mouth_width, blink, pose)

    def stream(self, audio: np.ndarray, start_frame: int = 0, num_frames: int | None = None,
               sample_rate: int = SAMPLE_RATE) -> Iterator[tuple[np.ndarray, FrameTruth]]:
        """Frames for ``audio`` (already loudness-normalised, see ``speech.normalize_loudness``).
        The mouth tracks are computed for the whole audio up front (a few floats per frame)."""
        if sample_rate != SAMPLE_RATE:
            raise ValueError(f"sample_rate={sample_rate}: resample the audio to {SAMPLE_RATE} Hz first")
        total = math.ceil(len(audio) * self.fps / sample_rate)
        n = total if num_frames is None else num_frames
        opening = mouth_opening_track(audio, total, self.fps, sample_rate)
        width = mouth_width_track(audio, total, self.fps, sample_rate)
        for t in range(n):
            o = float(opening[t]) if t < total else 0.0
            w = float(width[t]) if t < total else 0.5
            yield self.frame(start_frame + t, o, w)


@dataclass
class AvatarClip:
    identity: int  # the identity seed
    clip_seed: int
    voice: str
    reference: np.ndarray  # H x W x 3 uint8
    frames: np.ndarray  # T x H x W x 3 uint8
    audio: np.ndarray  # T * sample_rate / fps float32 samples, 16 kHz
    mouth_open: np.ndarray  # T float32 in [0, 1]
    mouth_box: np.ndarray  # T x 4 int32 (x0, y0, x1, y1)
    face_box: np.ndarray  # T x 4 int32
    # T x H x W float32 coverage of the regions asked for (render_clip(detail_regions=...)) and each
    # pixel's share of them (AvatarRenderer.coverage), else None
    detail: np.ndarray | None = None
    detail_share: np.ndarray | None = None


def render_clip(identity_seed: int, clip_seed: int, num_frames: int, split: str = "train", size: int = 256,
                fps: int = FPS, synth: SpeechSynth | None = None, speech_pool: int | None = 256,
                detail_regions: tuple[str, ...] | None = None) -> AvatarClip:
    """One clip: ``num_frames`` video frames and the matching audio window, cut at a seeded offset out of
    a seeded utterance (so mouth tracks see the audio around the window, as in a long render).

    ``speech_pool``: utterances are drawn from this many per split (seeds ``0 .. pool-1``), so the
    synth's cache serves most clips without running espeak-ng (~5 s of speech each; 256 of them are
    ~90 MB of float32 per process); ``None`` makes a fresh utterance for every clip.
    ``detail_regions``: also return each frame's coverage of these regions and each pixel's share of
    them (:meth:`AvatarRenderer.coverage`, a few ms per frame) as ``AvatarClip.detail`` and
    ``detail_share``, for losses that weight the face's features."""
    if num_frames < 1:
        raise ValueError(f"num_frames={num_frames}: must be >= 1")
    synth = synth or SpeechSynth()
    rng = np.random.default_rng([clip_seed, 31])
    speech_seed = int(rng.integers(speech_pool if speech_pool else 2**31))
    utt = synth.utterance(speech_seed, split, min_seconds=max(4.0, num_frames / fps + 1.0))
    hop = SAMPLE_RATE // fps
    total = len(utt.audio) // hop
    start = int(rng.integers(0, max(1, total - num_frames + 1)))
    audio = np.zeros(num_frames * hop, dtype=np.float32)
    seg = utt.audio[start * hop : (start + num_frames) * hop]
    audio[: seg.size] = seg
    opening = mouth_opening_track(utt.audio, total + num_frames, fps)[start : start + num_frames]
    width = mouth_width_track(utt.audio, total + num_frames, fps)[start : start + num_frames]
    r = AvatarRenderer(identity_seed, motion_seed=clip_seed, size=size, fps=fps)
    t0 = int(rng.integers(0, 10_000))  # where on the motion timeline the clip starts
    frames = np.empty((num_frames, size, size, 3), dtype=np.uint8)
    mbox = np.empty((num_frames, 4), dtype=np.int32)
    fbox = np.empty((num_frames, 4), dtype=np.int32)
    maps = []  # (coverage, share) per frame, with detail_regions
    for t in range(num_frames):
        frames[t], truth = r.frame(t0 + t, float(opening[t]), float(width[t]))
        mbox[t], fbox[t] = truth.mouth_box, truth.face_box
        if detail_regions is not None:
            maps.append(r.coverage(truth, detail_regions))
    detail, share = (np.stack([m[0] for m in maps]), np.stack([m[1] for m in maps])) if maps else (None, None)
    return AvatarClip(identity_seed, clip_seed, utt.voice, r.reference(), frames, audio,
                      opening.astype(np.float32), mbox, fbox, detail, share)


def identity_for(split: str, seed: int, index: int, num_identities: int | None = None) -> int:
    """The identity seed of item ``index``: uniform over the split's range (or its first
    ``num_identities`` seeds)."""
    if split not in IDENTITY_SPLITS:
        raise ValueError(f"split={split!r}: must be one of {sorted(IDENTITY_SPLITS)}")
    lo, hi = IDENTITY_SPLITS[split]
    span = hi - lo if num_identities is None else min(num_identities, hi - lo)
    return lo + int(np.random.default_rng([seed, index, 5]).integers(span))


class AvatarClipDataset:
    """Map-style dataset of synthetic clips; ``len`` is ``num_clips``, item ``i`` is deterministic.
    (A plain class with ``__len__`` / ``__getitem__``, which is all ``torch.utils.data.DataLoader``
    needs; torch is imported only when an item is made, so ground-truth scoring does not load it.)

    Items are dicts of tensors: ``reference`` (H, W, 3) uint8, ``frames`` (T, H, W, 3) uint8,
    ``audio`` (T * 640,) float32 at 16 kHz, ``mouth_open`` (T,) float32, ``mouth_box`` / ``face_box``
    (T, 4) int32, ``identity`` () int64. Use ``num_workers`` in the DataLoader for throughput; each
    worker keeps its own small speech cache.
    """

    def __init__(self, split: str = "train", num_clips: int = 100_000, num_frames: int = 20, size: int = 256,
                 seed: int = 0, num_identities: int | None = None, fps: int = FPS,
                 use_espeak: bool = True, speech_pool: int | None = 256) -> None:
        if split not in IDENTITY_SPLITS:
            raise ValueError(f"split={split!r}: must be one of {sorted(IDENTITY_SPLITS)}")
        self.split, self.num_clips, self.num_frames, self.size = split, num_clips, num_frames, size
        self.seed, self.num_identities, self.fps = seed, num_identities, fps
        self._use_espeak, self.speech_pool = use_espeak, speech_pool
        self._synth: SpeechSynth | None = None

    def __len__(self) -> int:
        return self.num_clips

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        import torch

        if not 0 <= index < self.num_clips:
            raise IndexError(f"index {index} out of range [0, {self.num_clips})")
        if self._synth is None:  # created lazily so each DataLoader worker gets its own
            self._synth = SpeechSynth(self._use_espeak, cache_size=self.speech_pool or 16)
        ident = identity_for(self.split, self.seed, index, self.num_identities)
        clip_seed = int(np.random.default_rng([self.seed, index, 6]).integers(2**31))
        c = render_clip(ident, clip_seed, self.num_frames, self.split, self.size, self.fps, self._synth,
                        self.speech_pool)
        return {
            "reference": torch.from_numpy(c.reference.copy()),
            "frames": torch.from_numpy(c.frames),
            "audio": torch.from_numpy(c.audio),
            "mouth_open": torch.from_numpy(c.mouth_open),
            "mouth_box": torch.from_numpy(c.mouth_box),
            "face_box": torch.from_numpy(c.face_box),
            "identity": torch.tensor(ident, dtype=torch.int64),
        }

