"""Consistency metrics for long avatar renders: lip sync, identity drift, seams (issue 6).

Everything is computed from the FINAL output frames (RGB uint8, after SR and decode) and the driving
audio; nothing reads model internals. Frames are consumed one at a time by :class:`QualityMeter`
(constant memory: four floats per frame are kept), so a 10-minute render never sits in memory.

* lip sync — ``lipsync_r``: Pearson r between the audio envelope per video frame
  (``models.avatars.speech.mouth_opening_track`` of the loudness-normalised audio: the very function
  the generator draws mouths with) and the mouth opening measured from pixels
  (``models.avatars.face.measure_mouth_opening``), at offset 0; ``lipsync_offset_frames``: the lag
  in [-5, 5] maximising r (positive: the video lags the audio), ``lipsync_r_best`` the r there.
* drift — per frame, the face distance (mean over channels of |mean colour of the inner face region -
  that of the reference|; colour means are insensitive to the small head motion) and the background
  distance (mean absolute per-pixel difference to the reference over two side bands of the frame,
  which the head never covers). Per second means, each floored at 1.0 (0-255 scale);
  ``drift_*_ratio`` = mean over the last minute / mean over the first 10 s (shorter renders: the
  first third and the rest, capped at 10 s / 60 s). ``drift_ratio`` = max(face, background).
* seams — ``seam_score`` = mean frame-to-frame change (mean abs diff) at chunk boundaries / median
  change at all other frames. Boundary ``b`` is the first frame of a new producer (an N or I chunk),
  so its change is ``|f[b] - f[b-1]|``.

CLI: ``python -m bench.quality --json [--audio FILE] [--minutes M] [--plot out.png] [--ground-truth]``.
``--fidelity [--identities N] [--seconds S] [--sheet out.png]`` scores identity fidelity instead
(``bench.fidelity``: per-region distance to the reference after aligning the head, accessory
presence and false presence, SSIM, head jump at seams) as model / ground-truth ratios over N
held-out identities, and writes a contact sheet (reference, ground truth, model at several times).
``--ground-truth`` scores generator renders of a held-out identity (the baseline); the model mode calls a
``render_fn`` (default ``bench.quality_render:render_for_quality``, imported lazily) twice, with and without
I chunks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.machine import machine
from models.avatars.face import Box, measure_mouth_opening
from models.avatars.speech import SAMPLE_RATE, mouth_opening_track, normalize_loudness

log = logging.getLogger(__name__)

MAX_LAG = 5
# render_fn(image_path, audio_path, seconds, use_i_chunks, out_dir) -> (frames, chunk boundaries)
RenderFn = Callable[[Path, Path, float, bool, Path], tuple[Iterable[np.ndarray], Sequence[int]]]
# Margin around the reference mouth box / inside the reference face box for renders without ground
# truth boxes: covers the generator's head motion (+-6 px, +-4 degrees, +-3 % at 256 px).
MOTION_MARGIN = 0.04


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson r; 0.0 when either side is constant (a frozen mouth carries no sync)."""
    a = np.asarray(a, np.float64) - np.mean(a)
    b = np.asarray(b, np.float64) - np.mean(b)
    den = math.sqrt(float(np.sum(a * a)) * float(np.sum(b * b)))
    return float(np.sum(a * b) / den) if den > 1e-12 else 0.0


def lipsync(envelope: np.ndarray, mouth: np.ndarray, max_lag: int = MAX_LAG) -> tuple[float, int, float]:
    """``(r at offset 0, best offset, r at best offset)``; offset k pairs envelope[t] with
    mouth[t + k] (k > 0: the video lags the audio by k frames)."""
    n = min(len(envelope), len(mouth))
    env, mo = np.asarray(envelope[:n]), np.asarray(mouth[:n])
    best_k, best_r = 0, -2.0
    r0 = pearson(env, mo)
    for k in range(-max_lag, max_lag + 1):
        r = pearson(env[: n - k], mo[k:]) if k >= 0 else pearson(env[-k:], mo[: n + k])
        if r > best_r + 1e-9 or (abs(r - best_r) <= 1e-9 and abs(k) < abs(best_k)):
            best_k, best_r = k, r
    return r0, best_k, best_r


def audio_envelope(audio: np.ndarray, num_frames: int, fps: int = 25) -> np.ndarray:
    """The per-video-frame envelope lip sync is scored against (loudness-normalised first)."""
    return mouth_opening_track(normalize_loudness(audio), num_frames, fps)


def drift_ratio(per_second: np.ndarray, fps_seconds: float = 1.0) -> tuple[float, int, int]:
    """``(ratio, head seconds, tail seconds)``: mean of the tail window / mean of the head window of
    per-second distances, each floored at 1.0."""
    d = np.maximum(np.asarray(per_second, np.float64), 1.0)
    n = len(d)
    if n < 2:
        return 1.0, n, n
    head = min(10, max(1, n // 3))
    tail = min(60, n - head)
    return float(d[-tail:].mean() / d[:head].mean()), head, tail


def seam_score(frame_diffs: np.ndarray, boundaries: Iterable[int]) -> float:
    """``frame_diffs[t] = mean|f[t] - f[t-1]|`` (``frame_diffs[0]`` unused); mean at boundaries over the
    median elsewhere. NaN when there is no boundary inside the render."""
    d = np.asarray(frame_diffs, np.float64)
    b = sorted({int(x) for x in boundaries if 0 < int(x) < len(d)})
    if not b or len(d) < 3:
        return float("nan")
    inside = np.ones(len(d), bool)
    inside[0] = False
    inside[b] = False
    med = float(np.median(d[inside])) if inside.any() else float("nan")
    return float(d[b].mean() / max(med, 1e-6))


def chunk_boundaries(num_frames: int, chunk_frames: int, context_frames: int, interp_frames: int,
                     use_i_chunks: bool = True) -> list[int]:
    """First frames of each producer's span on the final timeline, from ``pipeline.schedule.ChunkPlan``:
    with I chunks, ``I_{j-1}`` makes ``[jL, jL+e)`` and ``N_j`` the rest, so both ``jL`` and
    ``jL + e`` are seams; without them only ``jL``."""
    from pipeline.schedule import ChunkPlan

    return ChunkPlan(num_frames, chunk_frames, context_frames, interp_frames, use_i_chunks=use_i_chunks).seams()


def _erode(mask: np.ndarray, r: int) -> np.ndarray:
    """Binary erosion by a (2r+1)^2 square, via an integral image (no scipy)."""
    if r <= 0:
        return mask
    k = 2 * r + 1
    pad = np.pad(mask.astype(np.int32), r)
    ii = np.pad(pad.cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    box = ii[k:, k:] - ii[:-k, k:] - ii[k:, :-k] + ii[:-k, :-k]
    return box == k * k


def _shrink(box: Box, frac_x: float, frac_y: float) -> Box:
    x0, y0, x1, y1 = box
    dx, dy = (x1 - x0) * frac_x, (y1 - y0) * frac_y
    return (int(x0 + dx), int(y0 + dy), int(math.ceil(x1 - dx)), int(math.ceil(y1 - dy)))


@dataclass
class QualityMeter:
    """Accumulates per-frame measurements; call :meth:`add` per output frame, then :meth:`summary`.

    ``reference`` is the conditioning image (H, W, 3 uint8). ``mouth_box`` / ``face_box`` /
    ``eyes_box`` are the reference's boxes. The face region is the inner face box less the mouth and
    eyes (which open, close and blink, and would swamp a colour shift), all by the motion margin. For
    generator renders, per-frame ground-truth boxes may be passed to :meth:`add`: the mouth is then
    measured in its own box and the face region moves with the face box's centre.
    """

    reference: np.ndarray
    mouth_box: Box
    face_box: Box
    eyes_box: Box | None = None
    fps: int = 25
    mouth: list[float] = field(default_factory=list)
    face_dist: list[float] = field(default_factory=list)
    bg_dist: list[float] = field(default_factory=list)
    diffs: list[float] = field(default_factory=list)
    _prev: np.ndarray | None = None

    def __post_init__(self) -> None:
        h, w = self.reference.shape[:2]
        self._ref = self.reference.astype(np.float32)
        band = max(2, int(0.08 * w))
        self._bg_rows = slice(0, int(0.75 * h))
        self._bg_cols = np.r_[0:band, w - band : w]
        self._ref_bg = self._ref[self._bg_rows][:, self._bg_cols]
        m = int(MOTION_MARGIN * w)
        x0, y0, x1, y1 = self.mouth_box
        self._wide_mouth: Box = (max(0, x0 - m), max(0, y0 - m // 2), min(w, x1 + m), min(h, y1 + m // 2))
        # face region: skin-coloured pixels of the reference's face box (colour within 12 levels of the
        # median of the box's centre), less mouth and eyes, eroded so head motion keeps it on skin
        fx0, fy0, fx1, fy1 = _shrink(self.face_box, 0.08, 0.06)
        cx0, cy0, cx1, cy1 = _shrink(self.face_box, 0.3, 0.3)
        skin = np.median(self._ref[cy0:cy1, cx0:cx1].reshape(-1, 3), axis=0)
        mask = np.zeros((h, w), bool)
        mask[fy0:fy1, fx0:fx1] = np.abs(self._ref[fy0:fy1, fx0:fx1] - skin).max(axis=-1) < 12
        for box in (self.mouth_box, self.eyes_box):
            if box is not None:
                bx0, by0, bx1, by1 = box
                mask[max(0, by0 - m // 2) : by1 + m // 2, max(0, bx0 - m // 2) : bx1 + m // 2] = False
        # a narrow face (hair low on the forehead) can lose all of it to the full erosion: erode less
        # rather than refuse the face (the per-frame mask follows the face box's centre anyway)
        r = int(0.025 * w)
        eroded = _erode(mask, r)
        while eroded.sum() < 16 and r > 0:
            r -= 1
            eroded = _erode(mask, r)
        if eroded.sum() < 16:
            raise ValueError(f"face_box={self.face_box}: leaves {int(eroded.sum())} face pixels once the "
                             "mouth and eyes are cut out; pass the face's box in frame pixels")
        mask = eroded
        self._face_mask = mask
        self._ref_face_mean = self._ref[mask].mean(axis=0)
        self._face_centre = ((self.face_box[0] + self.face_box[2]) / 2, (self.face_box[1] + self.face_box[3]) / 2)

    def _face_mean(self, img: np.ndarray, face_box: Box | None) -> np.ndarray:
        if face_box is None:
            return img[self._face_mask].mean(axis=0)
        dx = int(round((face_box[0] + face_box[2]) / 2 - self._face_centre[0]))
        dy = int(round((face_box[1] + face_box[3]) / 2 - self._face_centre[1]))
        mask = np.roll(self._face_mask, (dy, dx), axis=(0, 1))  # the margin keeps the roll off the edges
        return img[mask].mean(axis=0)

    def add(self, frame: np.ndarray, mouth_box: Box | None = None, face_box: Box | None = None) -> None:
        if frame.shape != self.reference.shape or frame.dtype != np.uint8:
            raise ValueError(f"frame {frame.shape} {frame.dtype}: expected {self.reference.shape} uint8 like the reference")
        f = frame.astype(np.float32)
        self.mouth.append(float(measure_mouth_opening(frame[None], mouth_box or self._wide_mouth)[0]))
        self.face_dist.append(float(np.abs(self._face_mean(f, face_box) - self._ref_face_mean).mean()))
        self.bg_dist.append(float(np.abs(f[self._bg_rows][:, self._bg_cols] - self._ref_bg).mean()))
        self.diffs.append(float(np.abs(f - self._prev).mean()) if self._prev is not None else 0.0)
        self._prev = f

    def per_second(self, values: Sequence[float]) -> np.ndarray:
        v = np.asarray(values, np.float64)
        n = max(1, len(v) // self.fps)
        return np.array([v[i * self.fps : (i + 1) * self.fps].mean() for i in range(n)]) if len(v) else v

    def per_minute(self, values: Sequence[float]) -> list[float]:
        v, w = np.asarray(values, np.float64), 60 * self.fps
        return [round(float(v[i : i + w].mean()), 3) for i in range(0, len(v), w)]

    def summary(self, audio: np.ndarray, boundaries: Iterable[int]) -> dict[str, float | int | list[float]]:
        n = len(self.mouth)
        env = audio_envelope(audio, n, self.fps)
        r0, lag, rb = lipsync(env, np.asarray(self.mouth))
        face_r, head, tail = drift_ratio(self.per_second(self.face_dist))
        bg_r, _, _ = drift_ratio(self.per_second(self.bg_dist))
        return {
            "frames": n, "seconds": n / self.fps,
            "lipsync_r": round(r0, 4), "lipsync_offset_frames": lag, "lipsync_r_best": round(rb, 4),
            "drift_ratio": round(max(face_r, bg_r), 4), "drift_face_ratio": round(face_r, 4),
            "drift_background_ratio": round(bg_r, 4), "drift_head_seconds": head, "drift_tail_seconds": tail,
            "drift_face_first": round(float(np.mean(self.face_dist[: head * self.fps])), 3),
            "drift_face_last": round(float(np.mean(self.face_dist[-tail * self.fps :])), 3),
            "drift_background_first": round(float(np.mean(self.bg_dist[: head * self.fps])), 3),
            "drift_background_last": round(float(np.mean(self.bg_dist[-tail * self.fps :])), 3),
            "drift_face_per_minute": self.per_minute(self.face_dist),
            "drift_background_per_minute": self.per_minute(self.bg_dist),
            "seam_score": round(seam_score(np.asarray(self.diffs), boundaries), 4),
        }

    def series(self, audio: np.ndarray, boundaries: Iterable[int], window_s: int = 10) -> dict[str, np.ndarray]:
        """Per-window values for the plot: lip-sync r and seam score per ``window_s`` seconds, drift
        distances per second."""
        n, w = len(self.mouth), window_s * self.fps
        env = audio_envelope(audio, n, self.fps)
        mo, d = np.asarray(self.mouth), np.asarray(self.diffs)
        b = np.asarray(sorted(set(boundaries)), dtype=np.int64)
        lips, seams = [], []
        for s in range(0, max(1, n - w + 1), w):
            lips.append(pearson(env[s : s + w], mo[s : s + w]))
            inside = b[(b >= s) & (b < s + w)] - s
            seams.append(seam_score(d[s : s + w], inside) if s else seam_score(d[:w], inside))
        return {"lipsync_r": np.asarray(lips), "seam_score": np.asarray(seams),
                "drift_face": self.per_second(self.face_dist), "drift_background": self.per_second(self.bg_dist)}


def load_audio(path: Path) -> np.ndarray:
    """Any audio file PyAV can decode -> mono float32 at 16 kHz."""
    import av

    chunks: list[np.ndarray] = []
    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise ValueError(f"--audio {path}: the file has no audio stream")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        for frame in container.decode(audio=0):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray().reshape(-1))
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray().reshape(-1))
    if not chunks:
        raise ValueError(f"--audio {path}: decoded no samples")
    return np.concatenate(chunks).astype(np.float32)


def loop_audio(audio: np.ndarray, num_samples: int) -> np.ndarray:
    reps = -(-num_samples // max(1, len(audio)))
    return np.tile(audio, reps)[:num_samples].astype(np.float32)


HELDOUT_VOICES_AUDIO = "heldout-voices"  # the "audio" of a summary driven by heldout_speech


def require_heldout_voices() -> None:
    """For the CLIs, before they load anything: raise :class:`RuntimeError` unless ``espeak-ng`` is on
    PATH, naming the bench's own way out (``--audio``). The synth refuses too; the benchmarks score on
    the held-out voices only (the speech-like signal drives the mouth differently: face 22 reads 0.903
    on it and 0.776 on the voices)."""
    from models.avatars.speech import espeak_available

    if not espeak_available():
        raise RuntimeError("the held-out voices need espeak-ng, which is not on PATH: install it "
                           "(apt-get install espeak-ng; `make test` does) or drive bench.quality with "
                           "--audio FILE; the benchmarks do not fall back to the speech-like signal")


def heldout_speech(seconds: float, seed: int = 0) -> np.ndarray:
    """Held-out espeak-ng voices speaking random sentences, back to back, for ``seconds`` (16 kHz
    float32). Without espeak-ng the synth refuses (the CLIs check first: :func:`require_heldout_voices`)."""
    from models.avatars.speech import SpeechSynth

    synth = SpeechSynth(cache_size=1)
    parts, total, i = [], 0, 0
    while total < seconds * SAMPLE_RATE:
        utt = synth.utterance(seed * 100_003 + i, "heldout", min_seconds=4.0).audio
        pause = np.zeros(int(SAMPLE_RATE * (0.2 + 0.3 * (i % 3))), np.float32)
        parts += [utt, pause]
        total += utt.size + pause.size
        i += 1
    return np.concatenate(parts)[: int(seconds * SAMPLE_RATE)]


def write_wav(path: Path, audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    import wave

    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())


def _preset_plan() -> tuple[int, int, int]:
    try:
        from models.presets import get_preset

        p = get_preset("tiny")
        return int(p.chunk_frames), int(p.context_frames), int(p.interp_frames)
    except ImportError:  # the models branch not merged yet: the tiny preset's values
        return 16, 4, 4


def run(args: argparse.Namespace, render_fn: RenderFn | None = None
        ) -> tuple[dict[str, float | int | str | list[float]], dict[str, np.ndarray], list[int]]:
    """Score one render (ground truth, or the model twice: with and without I chunks). Returns the
    summary, the per-window series for :func:`plot`, and the chunk boundaries used."""
    from models.avatars.dataset import FPS, IDENTITY_SPLITS, AvatarRenderer

    if not args.ground_truth and render_fn is None:  # fail before spending minutes on speech
        render_fn = _load_render_fn(args.render_fn)
    seconds = args.minutes * 60.0
    n = math.ceil(seconds * FPS)
    audio = (loop_audio(load_audio(Path(args.audio)), int(seconds * SAMPLE_RATE)) if args.audio
             else heldout_speech(seconds, args.seed))
    audio = normalize_loudness(audio)
    preset = _preset_plan()
    L, C, e = args.chunk_frames or preset[0], args.context_frames or preset[1], args.interp_frames or preset[2]
    ident = IDENTITY_SPLITS["heldout"][0] + args.identity
    gt = AvatarRenderer(ident, motion_seed=args.seed + 17)
    ref = gt.reference()
    out: dict[str, float | int | str | list[float]] = {"mode": "ground-truth" if args.ground_truth else "model",
                                         "identity_seed": ident, "chunk_frames": L, "context_frames": C,
                                         "interp_frames": e, "audio": args.audio or HELDOUT_VOICES_AUDIO,
                                         "machine": machine()}
    if args.ground_truth:
        meter = QualityMeter(ref, gt.reference_mouth_box(), gt.reference_face_box(), gt.reference_eyes_box())
        fixed = QualityMeter(ref, gt.reference_mouth_box(), gt.reference_face_box(), gt.reference_eyes_box())
        for frame, truth in gt.stream(audio, num_frames=n):
            meter.add(frame, truth.mouth_box, truth.face_box)
            fixed.mouth.append(float(measure_mouth_opening(frame[None], fixed._wide_mouth)[0]))
        with_i, without_i = chunk_boundaries(n, L, C, e, True), chunk_boundaries(n, L, C, e, False)
        out.update(meter.summary(audio, with_i))
        out["seam_score_without_i"] = round(seam_score(np.asarray(meter.diffs), without_i), 4)
        out["lipsync_r_reference_box"] = round(lipsync(audio_envelope(audio, n), np.asarray(fixed.mouth))[0], 4)
        return out, meter.series(audio, with_i), with_i
    assert render_fn is not None
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        tmpd = Path(tmp)
        from PIL import Image

        Image.fromarray(ref).save(tmpd / "reference.png")
        write_wav(tmpd / "audio.wav", audio)
        result: dict[bool, tuple[dict[str, float | int | list[float]], QualityMeter, list[int]]] = {}
        for use_i in (True, False):
            meter = QualityMeter(ref, gt.reference_mouth_box(), gt.reference_face_box(), gt.reference_eyes_box())
            sub = tmpd / ("with_i" if use_i else "without_i")
            sub.mkdir()
            frames, bounds = render_fn(tmpd / "reference.png", tmpd / "audio.wav", seconds, use_i, sub)
            for frame in frames:
                meter.add(np.asarray(frame))
            result[use_i] = (meter.summary(audio, list(bounds)), meter, list(bounds))
    out.update(result[True][0])
    out["seam_score_without_i"] = result[False][0]["seam_score"]
    out["lipsync_r_without_i"] = result[False][0]["lipsync_r"]
    out["drift_ratio_without_i"] = result[False][0]["drift_ratio"]
    return out, result[True][1].series(audio, result[True][2]), result[True][2]


def _load_render_fn(spec: str) -> RenderFn:
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise SystemExit(f"--render-fn {spec}: cannot import {mod_name!r} ({exc}); the model renderer is "
                         "not available in this checkout: use --ground-truth, or pass "
                         "--render-fn module:function") from exc
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise SystemExit(f"--render-fn {spec}: {mod_name} has no {fn_name!r}")
    return fn  # type: ignore[no-any-return]


def plot(series: dict[str, np.ndarray], path: Path, title: str, window_s: int = 10) -> None:
    """Draw each metric over time with Pillow (no matplotlib): one panel per series, time in seconds on
    x; drift panels show the 1.0 floor as a grey line."""
    from PIL import Image, ImageDraw

    names = list(series)
    pw, ph, pad = 760, 170, 56
    img = Image.new("RGB", (pw + 2 * pad, len(names) * (ph + pad) + pad), "white")
    d = ImageDraw.Draw(img)
    d.text((pad, 12), title, fill="black")
    for i, name in enumerate(names):
        y = np.asarray(series[name], np.float64)
        top = pad + i * (ph + pad)
        d.rectangle([pad, top, pad + pw, top + ph], outline="black")
        finite = y[np.isfinite(y)]
        if finite.size == 0:
            d.text((pad + 5, top + 5), f"{name}: no data", fill="black")
            continue
        step = 1 if name.startswith("drift") else window_s  # seconds per point
        lo, hi = float(min(finite.min(), 0.0)), float(max(finite.max(), 1.0 if name.startswith("drift") else 0.0))
        hi = hi * 1.05 if hi > lo else lo + 1.0

        def ypix(v: float, lo: float = lo, hi: float = hi, top: int = top) -> float:
            return top + ph - (v - lo) / (hi - lo) * ph

        d.text((pad + 5, top - 14), f"{name}  (one point per {step} s)", fill="black")
        for v in (lo, hi):
            d.text((4, ypix(v) - 6), f"{v:.2f}", fill="gray")
        if name.startswith("drift"):
            d.line([pad, ypix(1.0), pad + pw, ypix(1.0)], fill=(180, 180, 180), width=1)
        total_s = len(y) * step
        for k in range(5):
            x = pad + k * pw / 4
            d.text((x - 8, top + ph + 3), f"{total_s * k / 4:.0f}s", fill="gray")
        xs = [pad + (k + 0.5) * pw / len(y) for k in range(len(y))]
        ys = [ypix(v if np.isfinite(v) else lo) for v in y]
        if len(y) == 1:
            d.ellipse([xs[0] - 3, ys[0] - 3, xs[0] + 3, ys[0] + 3], fill=(30, 90, 200))
        else:
            d.line(list(zip(xs, ys, strict=True)), fill=(30, 90, 200), width=2)
    img.save(path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    p.add_argument("--audio", help="speech file to drive the render, looped to its length "
                   "(default: held-out espeak-ng voices)")
    p.add_argument("--minutes", type=float, default=10.0, help="render length in minutes (default 10)")
    p.add_argument("--plot", help="write a PNG of each metric over time")
    p.add_argument("--ground-truth", action="store_true", help="score generator renders (the baseline)")
    p.add_argument("--identity", type=int, default=0, help="held-out identity index (default 0)")
    p.add_argument("--seed", type=int, default=0, help="motion and speech seed (default 0)")
    p.add_argument("--chunk-frames", type=int, default=0, help="L for GT seams (default: tiny preset)")
    p.add_argument("--context-frames", type=int, default=0, help="C (default: tiny preset)")
    p.add_argument("--interp-frames", type=int, default=0, help="e (default: tiny preset)")
    p.add_argument("--render-fn", default="bench.quality_render:render_for_quality",
                   help="module:function rendering frames for the model mode")
    p.add_argument("--fidelity", action="store_true", help="identity fidelity (bench.fidelity) over "
                   "--identities held-out identities, model / ground-truth ratios")
    p.add_argument("--identities", type=int, default=20, help="fidelity: held-out identities 0..N-1 (default 20)")
    p.add_argument("--first-identity", type=int, default=0,
                   help="fidelity: score held-out identities K..K+N-1 instead (default 0), e.g. to confirm a "
                        "setting chosen on 0..19 on faces and voices it was not chosen on")
    p.add_argument("--seconds", type=float, default=4.0, help="fidelity: clip length in seconds (default 4)")
    p.add_argument("--sheet", help="write a contact sheet PNG (reference, ground truth, model at several "
                   "times); implies --fidelity")
    p.add_argument("--markdown", action="store_true", help="fidelity: print the aggregate as a Markdown table")
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error(f"--minutes {args.minutes}: must be > 0")
    if args.audio and (args.sheet or args.fidelity):
        p.error(f"--audio {args.audio}: --fidelity and --sheet score every identity on its own held-out "
                "voices; drop --audio, or drop --fidelity/--sheet to score one render on the file")
    if not args.audio:  # the held-out voices: refuse before loading a model, not after
        try:
            require_heldout_voices()
        except RuntimeError as exc:
            p.error(str(exc))
    if args.sheet or args.fidelity:
        return _main_fidelity(args, p)
    result, series, _ = run(args)
    if args.plot:
        plot(series, Path(args.plot), f"bench.quality {result['mode']} identity {result['identity_seed']}")
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:28s} {v}")
    return 0


def _main_fidelity(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from bench.fidelity import check_heldout_args, markdown_table, run_fidelity

    if args.identities < 1 or args.seconds <= 0:
        p.error(f"--identities {args.identities} --seconds {args.seconds}: need >= 1 identity and > 0 s")
    check_heldout_args(p, args.first_identity, args.identities)
    render_fn = _load_render_fn(args.render_fn)
    result = run_fidelity(args.identities, args.seconds, args.seed, render_fn,
                          Path(args.sheet) if args.sheet else None, log_fn=lambda m: print(m, file=sys.stderr),
                          first=args.first_identity)
    result["mode"] = "fidelity"
    result["machine"] = machine()
    if args.sheet:
        result["sheet"] = args.sheet
    if args.markdown:
        print(markdown_table(result))
    elif args.json:
        print(json.dumps(result))
    else:
        for group, agg in result["aggregate"].items():  # type: ignore[attr-defined]
            print(group)
            for k, v in agg.items():
                print(f"  {k:36s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
