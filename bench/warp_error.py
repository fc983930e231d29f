"""Where a decoder that copies the reference reads it, against where the head really came from.

A decoder with ``VAEConfig.ref_warp`` blends each output pixel towards the reference's pixels taken
from where its window read (the attention's expected offset, or with ``ref_warp_rigid`` the rigid read
fitted to it: ``CausalVAE.decode(offsets=)`` hands out the one the warp copies from). The
generator knows where every pixel of the head came from: the head is the reference's, moved by the
frame's pose (``FaceRenderer.reference_shift``). This scores the read against it on held-out
ground-truth clips (the identities, voices and motion ``bench.quality --fidelity`` scores), through
the two chains of ``bench.reconstruction`` (``vae``: the frames' own latents; ``sr``: their low-res
latents through the SR), over the cells the head covers whole:

* ``error_px``: the mean distance between the read and the true source, in pixels, over the head's
  cells; ``error_detail_px`` over the cells the features the reference can give cover at least half
  (:data:`STILL_FEATURES`: the ones issue 15 scores but the eyes, which blink), where a misread shows;
* ``motion_px``: the true displacement's mean length there (what a read that never moves would miss);
* ``followed``: the least-squares slope of the read on the true displacement (1: the read follows the
  head; 0: it stays where the cell is).

``python -m bench.warp_error --identities 20 --seconds 2 [--checkpoint F] [--json]`` (about a minute
a chain on one thread). Why it exists: issue 15's render copies the reference through this warp, and
the nose and hair it fails on are where a read a pixel or two off shows (docs/quality.md).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.machine import machine
from bench.reconstruction import CHAIN_BATCH, CHAINS, _chains, _reference, load_modules, parse_chains
from models.avatars.dataset import FPS, IDENTITY_SPLITS, AvatarRenderer, FrameTruth
from models.training.data import to_unit

# the features that move only with the head: the reference's are the frame's, so the warp should copy them
STILL_FEATURES: tuple[str, ...] = ("hair", "brows", "nose", "glasses", "earrings", "hat")


def clip_targets(gt: AvatarRenderer, truths: list[FrameTruth], cell: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per frame, the true source ``(T, 2, h, w)`` (dy, dx px) and the cells the head covers whole
    (``AvatarRenderer.head_motion``), and those of them :data:`STILL_FEATURES` cover at least half, both
    ``(T, h, w)`` bool."""
    shifts, heads, details = [], [], []
    n = gt.face.size // cell
    for truth in truths:
        shift, head = gt.head_motion(truth, cell)
        masks = gt.face.region_masks(truth.pose, truth.mouth_open, truth.mouth_width, truth.blink, names=STILL_FEATURES)
        feat = np.clip(sum(masks.values()), 0.0, 1.0)
        shifts.append(shift)
        heads.append(head)
        details.append(head & (feat.reshape(n, cell, n, cell).mean(axis=(1, 3)) >= 0.5))
    return np.stack(shifts), np.stack(heads), np.stack(details)


@dataclass
class ReadScore:
    """Sums of :func:`warp_error`'s statistics over reads: :meth:`add` per pass of frames (the read and
    the true source ``(T, 2, h, w)`` in pixels, the head's and the still features' cells ``(T, h, w)``),
    then :meth:`summary`."""

    err: float = 0.0
    err_detail: float = 0.0
    motion: float = 0.0
    cells: int = 0
    cells_detail: int = 0
    xy: float = 0.0
    xx: float = 0.0

    def add(self, read: np.ndarray, true: np.ndarray, head: np.ndarray, detail: np.ndarray) -> None:
        dist = np.hypot(*(read - true).transpose(1, 0, 2, 3))  # (T, h, w)
        self.err += float(dist[head].sum())
        self.err_detail += float(dist[detail].sum())
        self.motion += float(np.hypot(*true.transpose(1, 0, 2, 3))[head].sum())
        self.cells += int(head.sum())
        self.cells_detail += int(detail.sum())
        m = np.broadcast_to(head[:, None], read.shape)
        self.xy += float((read[m] * true[m]).sum())
        self.xx += float((true[m] ** 2).sum())

    def summary(self) -> dict[str, float]:
        return {"error_px": round(self.err / max(self.cells, 1), 3),
                "error_detail_px": round(self.err_detail / max(self.cells_detail, 1), 3),
                "motion_px": round(self.motion / max(self.cells, 1), 3),
                "followed": round(self.xy / max(self.xx, 1e-9), 3), "cells": self.cells}


@torch.inference_mode()
def warp_error(num_identities: int = 20, seconds: float = 2.0, seed: int = 0, checkpoint: Path | None = None,
               chains: tuple[str, ...] = CHAINS, first: int = 0) -> dict[str, dict[str, float]]:
    """``{chain: {"error_px", "error_detail_px", "motion_px", "followed", "cells"}}`` over held-out
    identities ``first ..`` (motion seed ``seed + 17`` and held-out speech ``seed + K``, as
    ``bench.fidelity``'s ground truth)."""
    from bench.quality import heldout_speech, normalize_loudness

    mods = load_modules(checkpoint)[0]
    vae = mods["vae"]
    if vae.decoder.ref_gate is None:  # type: ignore[union-attr]
        raise ValueError("this checkpoint's decoder does not warp the reference (VAEConfig.ref_warp=False): "
                         "there is no read to score")
    cell = vae.cfg.factor // 2  # type: ignore[union-attr]
    n = math.ceil(seconds * FPS)
    scores = {c: ReadScore() for c in chains}
    lo = IDENTITY_SPLITS["heldout"][0]
    for k in range(first, first + num_identities):
        gt = AvatarRenderer(lo + k, motion_seed=seed + 17)
        audio = normalize_loudness(heldout_speech(seconds, seed + k))
        drawn = list(gt.stream(audio, num_frames=n))
        shift, head, detail = clip_targets(gt, [t for _, t in drawn], cell)
        ref = _reference(vae, to_unit(gt.reference())[None])
        for i in range(0, n, CHAIN_BATCH):
            x = to_unit(np.stack([f for f, _ in drawn[i : i + CHAIN_BATCH]])).transpose(0, 1)[None]
            offsets: dict[str, list[torch.Tensor]] = {c: [] for c in chains}
            _chains(mods, x, ref, chains, offsets)
            for c in chains:
                read = offsets[c][0][0].numpy() * cell  # (T, 2, h, w) px
                t = slice(i, i + read.shape[0])
                scores[c].add(read, shift[t], head[t], detail[t])
    return {c: score.summary() for c, score in scores.items()}


def main(argv: list[str] | None = None) -> int:
    from bench.fidelity import check_heldout_args
    from bench.quality import require_heldout_voices

    p = argparse.ArgumentParser(prog="python -m bench.warp_error", description=__doc__.split("\n\n")[0])
    p.add_argument("--identities", type=int, default=20, help="held-out identities K..K+N-1 (default 20)")
    p.add_argument("--first-identity", type=int, default=0, help="K (default 0)")
    p.add_argument("--seconds", type=float, default=2.0, help="clip length per identity (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chains", default=",".join(CHAINS), help="comma-separated, of vae and sr (default both)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="default: $LONGTAKE_EVAL_CHECKPOINT, else the shipped one")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    a = p.parse_args(argv)
    chains = parse_chains(p, a.chains)
    check_heldout_args(p, a.first_identity, a.identities)
    torch.set_num_threads(a.threads)
    try:
        require_heldout_voices()
    except RuntimeError as exc:  # the held-out voices need espeak-ng
        p.error(str(exc))
    try:
        result = warp_error(a.identities, a.seconds, a.seed, a.checkpoint, chains, a.first_identity)
    except ValueError as exc:
        p.error(str(exc))
    if a.json:
        print(json.dumps({**result, "machine": machine()}))
        return 0
    print("| chain | error, head (px) | error, still features (px) | true motion (px) | followed |\n|---|---|---|---|---|")
    for c, r in result.items():
        print(f"| {c} | {r['error_px']} | {r['error_detail_px']} | {r['motion_px']} | {r['followed']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
