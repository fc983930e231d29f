"""Identity fidelity of final frames against the reference and ground truth (issue 15, item 1).

Who calls what: ``python -m bench.quality --fidelity`` (:func:`run_fidelity`) renders, for each of N
held-out identities, a short clip with the real pipeline (``render_fn``, default
``bench.quality_render:render_for_quality``) and the generator's ground-truth clip of the same
identity and audio, feeds both to a :class:`FidelityMeter` frame by frame, and reports each
statistic as model / ground truth (:func:`ratios`, :func:`aggregate`). ``--sheet`` also writes a
contact sheet (:func:`contact_sheet`). Everything reads final RGB frames only; what the generator
knows (region masks, the reference, the reference without an accessory or with one it lacks)
defines where to look.

Definitions (per clip; all distances on 0-255, mean over RGB):

* **alignment** — each frame's head pose (translation, rotation, scale about the face centre, the
  generator's own pose model) is fitted by pattern search minimising the mean absolute difference to
  the reference over the head (its outline band included, eyes and mouth left out); the frame is
  then warped back into the reference's coordinates ("aligned").
* **region distance** — per region (skin, eyes, brows, nose, lips, mouth interior/teeth, hair,
  glasses, earrings, hat), the mean absolute difference between the aligned frame and the reference
  over the pixels the region covers (coverage >= 0.5) in the reference, pooled over frames. Lips and
  mouth are compared with the reference redrawn with the frame's mouth opening and width (a function
  of the audio, which the model also gets), over that drawing's masks; frames with a closed mouth add
  no mouth pixels. **background** — unaligned, over pixels at least 14 px away from where the
  reference's head is (beyond the head motion), neck and shoulders included.
* **structural** — SSIM (luma, 7x7 uniform window) between the aligned frame and the same targets,
  averaged over each region's pixels and over the whole head (``ssim_head``).
* **accessory presence** — an accessory pixel *votes present* when the aligned frame is closer to
  the reference than to the reference drawn without that accessory (``FaceIdentity.without``);
  only pixels where the two differ by > 24 levels vote. The accessory is *visibly there* in a frame
  when >= 50 % of its pixels vote present; the presence rate is the fraction of such frames.
* **false presence** ``false_A`` — the opposite error, for each accessory A the reference does *not*
  wear: the counterfactuals are the reference drawn by the generator wearing A in each style it draws
  A in (``ACCESSORY_STYLES`` via ``FaceIdentity.with_accessory``: glasses round or square in the 8
  accent colours, gold or silver earrings, a hat in the 8 accent colours; fixed, not sampled). Per
  style, the pixels A covers in that drawing (coverage >= 0.5) that differ from the reference by
  > 24 levels vote *drawn* when the aligned frame is closer to that drawing than to the reference.
  A is visibly there in a frame when >= 50 % of the votes of ANY one style say drawn (a hallucinated
  accessory may have any colour: near-black rims are found by the black style only); a style with
  fewer than 10 % of its pixels voting (drawn nearly in the colour beneath it) is left out. The rate
  is the fraction of such frames; ``None`` for an accessory the reference wears. Ground truth's is 0
  on every benchmark frame (20 held-out identities x 100), and on 20-frame clips of them blurred
  (sigma 1.5 or 3), noised (sigma 20) or tinted +-15 levels (the worst frame: 48 % of one style's
  votes), so no ratio is taken: the model's rate is reported beside truth's.
  Limits: votes over low-contrast pixels (24-40 levels, e.g. silver earrings over a pale background)
  tip on a light halo; rims drawn at another size than the generator's, or in a colour nearer the
  skin than every style, are not counted.
* **seam jump** — per frame, the head's displacement: the mean distance moved by the corners of the
  head's box between the fitted poses of frames t-1 and t (position, rotation and scale in pixels).
  ``seam_jump_score`` = mean displacement at the chunk seams / median elsewhere (as ``seam_score``),
  the median floored at the fit's finest step (``FIT_STEP_PX``: a head that stands still between
  seams, or a fit that flips between two poses, has median 0, and motion under the step is not
  resolved anyway);
  ``seam_outline_score`` likewise for the change of the aligned frame in a 3-px band around the
  head's outline (what the pose fit cannot absorb).

Ratios: model / ground truth, distances floored at 1.0 and 1 - SSIM at 0.01 first (ground truth is
exactly 0 on the background), so ratio > 1 is worse except for presence (lower is worse). False
presence has no ratio (ground truth's is 0): the rates themselves, model and truth, are aggregated
over the identities that lack the accessory.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from models.avatars.dataset import AvatarRenderer
from models.avatars.face import ACCESSORIES, ACCESSORY_STYLES, FaceRenderer, HeadPose

DIST_REGIONS: tuple[str, ...] = ("skin", "eyes", "brows", "nose", "lips", "mouth", "hair", "glasses",
                                 "earrings", "hat", "background")
EXPRESSION_REGIONS = ("lips", "mouth")  # compared with the reference redrawn at the frame's mouth
VOTE_LEVELS = 24.0  # accessory pixels that vote: |with - without| above this (mean over RGB)
VISIBLE_FRACTION = 0.5  # an accessory is visibly there when this fraction of its pixels votes present
FALSE_STYLE_SHARE = 0.1  # a counterfactual style votes for false presence when this share of its pixels can
# (the rest is nearly the colour beneath it: the generator's own drawing would hardly show there)
BACKGROUND_MARGIN = 14  # px between the reference head and the background pixels scored
DIST_FLOOR, DSSIM_FLOOR = 1.0, 0.01
FIT_STEP_PX = 0.25  # the pose fit's finest pattern-search step at the head's edge (fit_pose)

Pose = tuple[float, float, float, float]  # dx px, dy px, angle degrees, scale
# bench.quality's RenderFn: (image, audio, seconds, use_i_chunks, out_dir) -> (frames, chunk seams)
RenderFnLike = Callable[[Path, Path, float, bool, Path], tuple[Iterable[np.ndarray] | Iterator[np.ndarray], Sequence[int]]]


def _dilate(mask: np.ndarray, r: int) -> np.ndarray:
    """Binary dilation by a (2r+1)^2 square via an integral image."""
    if r <= 0:
        return mask
    k = 2 * r + 1
    ii = np.pad(np.pad(mask.astype(np.int32), r).cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    return (ii[k:, k:] - ii[:-k, k:] - ii[k:, :-k] + ii[:-k, :-k]) > 0


def _box_mean(x: np.ndarray, r: int = 3) -> np.ndarray:
    """Mean over a (2r+1)^2 window, edges replicated."""
    k = 2 * r + 1
    ii = np.pad(np.pad(x, r, mode="edge").cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    return (ii[k:, k:] - ii[:-k, k:] - ii[k:, :-k] + ii[:-k, :-k]) / (k * k)


def ssim_map(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """SSIM per pixel of two (H, W, 3) images on 0-255 (luma, 7x7 uniform window, the usual
    constants)."""
    w = np.array([0.299, 0.587, 0.114], np.float64)
    x, y = np.asarray(a, np.float64) @ w, np.asarray(b, np.float64) @ w
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = _box_mean(x), _box_mean(y)
    vx, vy = _box_mean(x * x) - mx * mx, _box_mean(y * y) - my * my
    cxy = _box_mean(x * y) - mx * my
    return ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))


def ratio_of_scores(values: np.ndarray, boundaries: Iterable[int], floor: float = 1e-3) -> float:
    """Mean of ``values`` at the boundaries / median elsewhere, at least ``floor`` (``values[0]`` unused);
    NaN without a boundary inside."""
    d = np.asarray(values, np.float64)
    b = sorted({int(x) for x in boundaries if 0 < int(x) < len(d)})
    if not b or len(d) < 3:
        return float("nan")
    inside = np.ones(len(d), bool)
    inside[0] = False
    inside[b] = False
    return float(d[b].mean() / max(float(np.median(d[inside])), floor))


@dataclass
class FidelityMeter:
    """Per-clip fidelity statistics of one identity's frames; :meth:`add` per final frame (in
    timeline order), then :meth:`summary`. Keeps sums and a few floats per frame, no frames
    (``false_fraction``: per accessory the reference lacks, the best style's share of pixels voting
    drawn, per frame).

    ``renderer`` is the generator of the identity (reference, masks, counterfactuals); frames must be
    (size, size, 3) uint8 like its reference. :meth:`add` takes the frame's mouth opening and width
    (the ground truth's at that time: both follow the audio) for the lips / mouth targets."""

    renderer: AvatarRenderer
    pose_log: list[Pose] = field(default_factory=list)
    outline_change: list[float] = field(default_factory=list)
    visible: dict[str, list[bool]] = field(default_factory=dict)
    false_fraction: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        face = self.renderer.face
        n = face.size
        self._face, self._n = face, n
        self._ref = self.renderer.reference().astype(np.float32)
        masks = face.region_masks(HeadPose())
        head = masks["background"] < 0.5
        ys, xs = np.nonzero(_dilate(head, BACKGROUND_MARGIN))
        self._crop = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)  # x0, y0, x1, y1
        x0, y0, x1, y1 = self._crop
        c = (slice(y0, y1), slice(x0, x1))
        self._masks = {k: v[c] >= 0.5 for k, v in masks.items() if k not in EXPRESSION_REGIONS}
        self._masks["head"] = head[c]
        self._bg = (masks["background"] > 0.999) & ~_dilate(head, BACKGROUND_MARGIN)
        still = np.zeros((n, n), bool)  # what the fit ignores: eyes (blinks) and the mouth (speech)
        mb = self.renderer.reference_mouth_box()
        still[mb[1] : mb[3], mb[0] : mb[2]] = True
        still |= masks["eyes"] > 0
        fit = (_dilate(head, 3) & ~_dilate(still, 3))[c]
        fit[1::2] = False  # every other row: half the cost, the same optimum
        self._fit_mask = fit
        self._band = (_dilate(head, 3) & _dilate(~head, 3))[c]  # within 3 px of the outline, both sides
        hy, hx = np.nonzero(head)
        self._head_box = (float(hx.min()), float(hy.min()), float(hx.max() + 1), float(hy.max() + 1))
        self._ref_crop = self._ref[c]
        self._cx, self._cy = face.identity.face_cx * n, face.identity.face_cy * n
        self._radius = face.identity.face_ry * n
        self._votes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for acc in face.identity.accessories:
            without = FaceRenderer(face.identity.without(acc), n).render(HeadPose()).astype(np.float32)[c]
            px = self._masks[acc] & (np.abs(self._ref_crop - without).mean(axis=-1) > VOTE_LEVELS)
            self._votes[acc] = (px, self._ref_crop[px], without[px])
            self.visible[acc] = []
        # false presence: the reference against itself drawn with each accessory it lacks, in every
        # style the generator draws it in; one gather per frame over all styles' voting pixels
        self._false: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        flat_ref = self._ref_crop.reshape(-1, 3)
        for acc in ACCESSORIES:
            if acc in face.identity.accessories:
                continue
            idx, cf, counts = [], [], []
            for style in range(len(ACCESSORY_STYLES[acc])):
                drawn = FaceRenderer(face.identity.with_accessory(acc, style), n)
                with_ = drawn.render(HeadPose()).astype(np.float32)[c]
                cover = drawn.region_masks(HeadPose(), names=(acc,))[acc][c] >= 0.5
                px = np.flatnonzero(cover & (np.abs(with_ - self._ref_crop).mean(axis=-1) > VOTE_LEVELS))
                if px.size and px.size >= FALSE_STYLE_SHARE * cover.sum():
                    idx.append(px)
                    cf.append(with_.reshape(-1, 3)[px])
                    counts.append(px.size)
            if idx:
                flat = np.concatenate(idx)
                style_of = np.repeat(np.arange(len(idx)), counts)
                self._false[acc] = (flat, np.concatenate(cf), flat_ref[flat], style_of, np.asarray(counts, np.float64))
                self.false_fraction[acc] = []
        self._sums = {k: 0.0 for k in (*DIST_REGIONS, *(f"ssim_{r}" for r in DIST_REGIONS), "ssim_head")}
        self._counts = dict.fromkeys(self._sums, 0)
        self._prev_aligned: np.ndarray | None = None
        self._pose: Pose = (0.0, 0.0, 0.0, 1.0)

    # ---- alignment ------------------------------------------------------------------------------
    def warp(self, frame: Image.Image, pose: Pose) -> np.ndarray:
        """The frame sampled at the posed positions of the reference crop's pixels (float32 crop)."""
        dx, dy, ang, s = pose
        x0, y0, x1, y1 = self._crop
        a = math.radians(ang)
        ca, sa = s * math.cos(a), s * math.sin(a)
        coeffs = (ca, -sa, self._cx + dx + ca * (x0 - self._cx) - sa * (y0 - self._cy),
                  sa, ca, self._cy + dy + sa * (x0 - self._cx) + ca * (y0 - self._cy))
        out = frame.transform((x1 - x0, y1 - y0), Image.Transform.AFFINE, coeffs, resample=Image.Resampling.BILINEAR)
        return np.asarray(out, np.float32)

    def fit_pose(self, frame: np.ndarray, start: Pose | None = None) -> Pose:
        """Pattern search over (dx, dy, angle, scale) with steps in pixels at the head's edge,
        2 -> 0.25 px, from ``start`` (default: the previous frame's pose), then one parabolic
        sub-step per parameter (so displacements are not quantised to the last step)."""
        img = Image.fromarray(frame)
        m = self._fit_mask

        def cost(p: Pose) -> float:
            return float(np.abs(self.warp(img, p)[m] - self._ref_crop[m]).mean())

        best = start or self._pose
        best_c = cost(best)
        deg_per_px, scale_per_px = math.degrees(1.0 / self._radius), 1.0 / self._radius
        for step in (2.0, 1.0, 0.5, FIT_STEP_PX):
            deltas = [(step, 0, 0, 0), (-step, 0, 0, 0), (0, step, 0, 0), (0, -step, 0, 0),
                      (0, 0, step * deg_per_px, 0), (0, 0, -step * deg_per_px, 0),
                      (0, 0, 0, step * scale_per_px), (0, 0, 0, -step * scale_per_px)]
            for _ in range(8):
                cands = [(best[0] + d[0], best[1] + d[1], best[2] + d[2], best[3] + d[3]) for d in deltas]
                costs = [cost(p) for p in cands]
                k = int(np.argmin(costs))
                if costs[k] >= best_c - 1e-6:
                    break
                best, best_c = cands[k], costs[k]
        refined = list(best)
        for j, d in enumerate(deltas[::2]):
            h = d[j]
            lo = cost(tuple(b - (h if i == j else 0) for i, b in enumerate(best)))  # type: ignore[arg-type]
            hi = cost(tuple(b + (h if i == j else 0) for i, b in enumerate(best)))  # type: ignore[arg-type]
            curv = lo - 2 * best_c + hi
            if curv > 1e-9:
                refined[j] += float(np.clip(0.5 * h * (lo - hi) / curv, -h, h))
        cand: Pose = (refined[0], refined[1], refined[2], refined[3])
        return cand if cost(cand) <= best_c else best

    def head_points(self, pose: Pose) -> np.ndarray:
        """The corners of the reference head's box placed by ``pose`` (4, 2)."""
        x0, y0, x1, y1 = self._head_box
        dx, dy, ang, s = pose
        a = math.radians(ang)
        pts = np.array([(x0, y0), (x1, y0), (x0, y1), (x1, y1)], np.float64) - (self._cx, self._cy)
        rot = np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
        return (pts * s) @ rot.T + (self._cx + dx, self._cy + dy)

    # ---- per frame ------------------------------------------------------------------------------
    def _acc(self, key: str, values: np.ndarray) -> None:
        self._sums[key] += float(values.sum())
        self._counts[key] += int(values.size)

    def add(self, frame: np.ndarray, mouth_open: float = 0.0, mouth_width: float = 0.5) -> None:
        if frame.shape != self._ref.shape or frame.dtype != np.uint8:
            raise ValueError(f"frame {frame.shape} {frame.dtype}: expected {self._ref.shape} uint8 like the reference")
        self._pose = self.fit_pose(frame)
        self.pose_log.append(self._pose)
        aligned = self.warp(Image.fromarray(frame), self._pose)
        x0, y0, x1, y1 = self._crop
        c = (slice(y0, y1), slice(x0, x1))
        target = self._face.render(HeadPose(), mouth_open, mouth_width, 0.0).astype(np.float32)[c]
        expr = self._face.region_masks(HeadPose(), mouth_open, mouth_width, 0.0, names=EXPRESSION_REGIONS)
        masks = {**self._masks, **{k: v[c] >= 0.5 for k, v in expr.items()}}
        diff = np.abs(aligned - target).mean(axis=-1)
        smap = ssim_map(aligned, target)
        for r in DIST_REGIONS[:-1]:
            if masks[r].any():
                self._acc(r, diff[masks[r]])
                self._acc(f"ssim_{r}", smap[masks[r]])
        self._acc("ssim_head", smap[masks["head"]])
        f = frame.astype(np.float32)
        self._acc("background", np.abs(f[self._bg] - self._ref[self._bg]).mean(axis=-1))
        bg_s = ssim_map(f, self._ref)[self._bg]
        self._acc("ssim_background", bg_s)
        for acc, (px, with_, without) in self._votes.items():
            got = aligned[px]
            present = np.abs(got - with_).sum(axis=-1) < np.abs(got - without).sum(axis=-1)
            self.visible[acc].append(bool(present.mean() >= VISIBLE_FRACTION))
        flat_aligned = aligned.reshape(-1, 3)
        for acc, (flat, with_, without, style_of, counts) in self._false.items():
            got = flat_aligned[flat]
            closer = np.abs(got - with_).sum(axis=-1) < np.abs(got - without).sum(axis=-1)
            self.false_fraction[acc].append(float((np.bincount(style_of, closer, len(counts)) / counts).max()))
        prev = self._prev_aligned
        self.outline_change.append(float(np.abs(aligned - prev)[self._band].mean()) if prev is not None else 0.0)
        self._prev_aligned = aligned

    def displacements(self) -> np.ndarray:
        """Per frame, the mean distance the head box's corners moved since the previous frame (px)."""
        pts = [self.head_points(p) for p in self.pose_log]
        out = np.zeros(len(pts))
        for t in range(1, len(pts)):
            out[t] = float(np.linalg.norm(pts[t] - pts[t - 1], axis=1).mean())
        return out

    def summary(self, boundaries: Sequence[int]) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {"frames": len(self.pose_log)}
        for k, total in self._sums.items():
            name = k if k.startswith("ssim_") else f"dist_{k}"
            out[name] = round(total / self._counts[k], 4) if self._counts[k] else None
        for acc in ACCESSORIES:
            v = self.visible.get(acc)
            out[f"presence_{acc}"] = round(float(np.mean(v)), 4) if v else None
            f = self.false_fraction.get(acc)
            out[f"false_{acc}"] = round(float(np.mean(np.asarray(f) >= VISIBLE_FRACTION)), 4) if f else None
        disp = self.displacements()
        b = [x for x in boundaries if 0 < x < len(disp)]
        out["seam_jump_px"] = round(float(disp[b].mean()), 4) if b else None
        out["seam_jump_score"] = round(ratio_of_scores(disp, b, FIT_STEP_PX), 4)
        out["seam_outline_score"] = round(ratio_of_scores(np.asarray(self.outline_change), b), 4)
        return out


def ratios(model: dict[str, float | int | None], truth: dict[str, float | int | None]) -> dict[str, float]:
    """model / ground truth per statistic present in both (distances floored at 1.0, 1 - SSIM at
    0.01; SSIM reported as the ratio of 1 - SSIM, so > 1 is worse, like the distances)."""
    out: dict[str, float] = {}
    for k, m in model.items():
        g = truth.get(k)
        if m is None or g is None or k == "frames" or k == "seam_jump_px" or k.startswith("false_"):
            continue  # false presence: ground truth's is ~0, so the rates themselves are reported
        if k.startswith("dist_"):
            out[k] = max(float(m), DIST_FLOOR) / max(float(g), DIST_FLOOR)
        elif k.startswith("ssim_"):
            out["d" + k] = max(1 - float(m), DSSIM_FLOOR) / max(1 - float(g), DSSIM_FLOOR)
        elif float(g) > 0 and math.isfinite(float(m)) and math.isfinite(float(g)):
            out[k] = float(m) / float(g)
    return {k: round(v, 4) for k, v in out.items()}


def aggregate(rows: Sequence[dict[str, object]]) -> dict[str, dict[str, float | int]]:
    """Pool per-identity summaries (``{"model": summary, "truth": summary, "accessories": [...]}``):
    for each statistic, the mean over the identities that have it, for model and truth, and their
    ratio (floors as in :func:`ratios`) — over all identities, those with accessories and those
    without."""
    groups = {"all": rows, "with_accessories": [r for r in rows if r["accessories"]],
              "without_accessories": [r for r in rows if not r["accessories"]]}
    out: dict[str, dict[str, float | int]] = {}
    for name, group in groups.items():
        agg: dict[str, float | int] = {"identities": len(group)}
        if group:
            keys = [k for k in group[0]["model"] if k not in ("frames",)]  # type: ignore[attr-defined]
            model = {k: _mean([r["model"].get(k) for r in group]) for k in keys}  # type: ignore[attr-defined]
            truth = {k: _mean([r["truth"].get(k) for r in group]) for k in keys}  # type: ignore[attr-defined]
            for k in keys:
                if model[k] is not None:
                    agg[f"model_{k}"] = round(float(model[k]), 4)  # type: ignore[arg-type]
                if truth[k] is not None:
                    agg[f"truth_{k}"] = round(float(truth[k]), 4)  # type: ignore[arg-type]
            agg.update({f"ratio_{k}": v for k, v in ratios(model, truth).items()})
        out[name] = agg
    return out


def _mean(values: Iterable[object]) -> float | None:
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]  # type: ignore[arg-type]
    return float(np.mean(v)) if v else None


def contact_sheet(rows: Sequence[tuple[str, np.ndarray, Sequence[np.ndarray], Sequence[np.ndarray]]],
                  times: Sequence[int], path: Path, tile: int = 192, fps: int = 25) -> None:
    """One block per identity: the reference, then ground truth (top) and model (bottom) at each of
    ``times`` (frame indices), tiles resized to ``tile`` px with Lanczos; labels drawn with Pillow;
    saved as a 256-colour PNG."""
    from PIL import ImageDraw

    pad, label_h = 6, 14
    cols = 1 + len(times)
    width = pad + cols * (tile + pad) + 60
    block = 2 * (tile + pad) + label_h
    img = Image.new("RGB", (width, pad + len(rows) * (block + pad)), "white")
    d = ImageDraw.Draw(img)

    def put(arr: np.ndarray, col: int, y: int) -> None:
        img.paste(Image.fromarray(arr).resize((tile, tile), Image.Resampling.LANCZOS), (60 + pad + col * (tile + pad), y))

    for i, (title, ref, truth, model) in enumerate(rows):
        top = pad + i * (block + pad)
        d.text((60 + pad, top), f"{title}   reference | frame " + ", ".join(f"{t} ({t / fps:.2f} s)" for t in times),
               fill="black")
        y0, y1 = top + label_h, top + label_h + tile + pad
        d.text((4, y0 + tile // 2), "ground\ntruth", fill="black")
        d.text((4, y1 + tile // 2), "model", fill="black")
        put(ref, 0, y0)
        for j, (g, m) in enumerate(zip(truth, model, strict=True)):
            put(g, 1 + j, y0)
            put(m, 1 + j, y1)
    # 256 colours (median cut): a third of the bytes, so the README can carry the current sheet
    img.quantize(256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def sheet_times(num_frames: int, chunk_frames: int = 16) -> list[int]:
    """Frames the sheet shows: the first, both sides of the third chunk seam (47 | 48 for L = 16,
    the demo's visible jump), and the last."""
    seam = 3 * chunk_frames
    return [0, seam - 1, seam, num_frames - 1] if num_frames > seam + 1 else [0, num_frames // 2, num_frames - 1]


# clip_fn(ground-truth renderer, audio) -> (the clip's final frames, its chunk seams)
ClipFn = Callable[[AvatarRenderer, np.ndarray], tuple[list[np.ndarray], Sequence[int]]]


def pipeline_clip(render_fn: RenderFnLike, seconds: float) -> ClipFn:
    """The model's clip: ``render_fn`` (the real pipeline, with I chunks) on the identity's reference
    and the audio, written to a temporary folder; its first ``seconds`` of frames."""
    import tempfile

    from bench.quality import write_wav
    from models.avatars.dataset import FPS

    n = math.ceil(seconds * FPS)

    def clip(gt: AvatarRenderer, audio: np.ndarray) -> tuple[list[np.ndarray], Sequence[int]]:
        with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
            tmpd = Path(tmp)
            Image.fromarray(gt.reference()).save(tmpd / "reference.png")
            write_wav(tmpd / "audio.wav", audio)
            frames, bounds = render_fn(tmpd / "reference.png", tmpd / "audio.wav", seconds, True, tmpd)
            out: list[np.ndarray] = []
            for frame in frames:
                if len(out) >= n:
                    break
                out.append(np.asarray(frame))
        return out, bounds

    return clip


def check_heldout_range(first: int, num_identities: int) -> None:
    """Raise ``ValueError`` unless held-out identities ``first .. first + num_identities - 1`` exist."""
    from models.avatars.dataset import IDENTITY_SPLITS

    lo, hi = IDENTITY_SPLITS["heldout"]
    if first < 0 or num_identities < 1 or first + num_identities > hi - lo:
        raise ValueError(f"held-out identities {first}..{first + num_identities - 1}: there are {hi - lo} "
                         f"(0..{hi - lo - 1}), so the first must be in [0, {hi - lo - max(num_identities, 1)}]")


def check_heldout_args(p: argparse.ArgumentParser, first: int, num_identities: int) -> None:
    """A CLI's ``--first-identity`` / ``--identities``: :func:`check_heldout_range`, reported through
    ``p.error`` with both flags named (before any model loads)."""
    try:
        check_heldout_range(first, num_identities)
    except ValueError as exc:
        p.error(f"--first-identity {first} --identities {num_identities}: {exc}")


def run_fidelity(num_identities: int, seconds: float, seed: int, render_fn: RenderFnLike | None,
                 sheet: Path | None = None, log_fn: Callable[[str], None] | None = None, *,
                 clip_fn: ClipFn | None = None, first: int = 0) -> dict[str, object]:
    """For held-out identities ``first .. first + num_identities - 1`` (seeds 1 000 000 + K; ``first``
    > 0 scores identities a setting was not chosen on): held-out speech of
    ``seconds`` (seed ``seed + K``), the model's clip (``render_fn`` with I chunks, or ``clip_fn``:
    e.g. ``bench.reconstruction``'s chain upper bounds) and the generator's clip of the same
    identity and audio (motion seed ``seed + 17``, as ``bench.quality --ground-truth``), both scored
    by a :class:`FidelityMeter` on the model's seams. The sheet shows identity 0 and then the first
    identities wearing an accessory not shown yet (three at most). Model frames of one clip are held
    until scored (short clips: seconds).
    Returns ``{"identities": [per identity], "aggregate": aggregate(...), "audio": "heldout-voices", ...}``."""
    from bench.quality import HELDOUT_VOICES_AUDIO, heldout_speech, normalize_loudness
    from models.avatars.dataset import FPS, IDENTITY_SPLITS

    if clip_fn is None:
        if render_fn is None:
            raise ValueError("run_fidelity needs render_fn or clip_fn")
        clip_fn = pipeline_clip(render_fn, seconds)
    n = math.ceil(seconds * FPS)
    times = sheet_times(n)
    rows: list[dict[str, object]] = []
    shown: list[tuple[str, np.ndarray, list[np.ndarray], list[np.ndarray]]] = []
    check_heldout_range(first, num_identities)
    lo = IDENTITY_SPLITS["heldout"][0]
    for k in range(first, first + num_identities):
        ident = lo + k
        gt = AvatarRenderer(ident, motion_seed=seed + 17)
        audio = normalize_loudness(heldout_speech(seconds, seed + k))
        truth_meter, truths, gt_frames = FidelityMeter(gt), [], []
        model_frames, bounds = clip_fn(gt, audio)
        model_frames = model_frames[:n]
        model_meter = FidelityMeter(gt)
        for t, (frame, truth) in enumerate(gt.stream(audio, num_frames=len(model_frames))):
            truths.append(truth)
            truth_meter.add(frame, truth.mouth_open, truth.mouth_width)
            if t in times:
                gt_frames.append(frame)
        for frame, truth in zip(model_frames, truths, strict=True):
            model_meter.add(frame, truth.mouth_open, truth.mouth_width)
        bounds = [int(b) for b in bounds]
        model_s, truth_s = model_meter.summary(bounds), truth_meter.summary(bounds)
        accs = list(gt.identity.accessories)
        rows.append({"identity_seed": ident, "accessories": accs, "frames": len(model_frames),
                     "model": model_s, "truth": truth_s, "ratio": ratios(model_s, truth_s)})
        seen = {a for title, *_ in shown for a in ACCESSORIES if a in title}
        if sheet is not None and len(shown) < 3 and (not shown or set(accs) - seen):  # each accessory once
            shown.append((f"held-out {k} ({', '.join(accs) or 'no accessories'})", gt.reference(), gt_frames,
                          [model_frames[t] for t in times if t < len(model_frames)]))
        if log_fn is not None:
            drawn = {k: v for k, v in model_s.items() if k.startswith("false_") and v}  # rates, not ratios
            log_fn(f"identity {ident} {accs}: {rows[-1]['ratio']}" + (f"; model's {drawn}" if drawn else ""))
    if sheet is not None:
        contact_sheet(shown, times, sheet)
    return {"seconds": seconds, "frames_per_clip": n, "audio": HELDOUT_VOICES_AUDIO, "identities": rows,
            "aggregate": aggregate(rows)}


def markdown_table(result: dict[str, object]) -> str:
    """The aggregate as the Markdown table docs/quality.md and the model card show."""
    agg = result["aggregate"]["all"]  # type: ignore[index]
    lines = ["| statistic | model | ground truth | model / ground truth |", "|---|---|---|---|"]
    for key in [*(f"dist_{r}" for r in DIST_REGIONS), "ssim_head", *(f"ssim_{r}" for r in DIST_REGIONS),
                *(f"presence_{a}" for a in ACCESSORIES), *(f"false_{a}" for a in ACCESSORIES), "seam_jump_px",
                "seam_jump_score", "seam_outline_score"]:
        m, g = agg.get(f"model_{key}"), agg.get(f"truth_{key}")
        if m is None:
            continue
        r = agg.get(f"ratio_{'d' + key if key.startswith('ssim_') else key}", "")
        lines.append(f"| {key} | {m} | {g} | {r} |")
    return "\n".join(lines)
