"""Training data from the synthetic avatar generator: random frames for the VAE, cached latent clips
for the A2V DiT and the SR model.

Who calls what:
* ``train_vae`` draws batches of random frames (or crops) of TRAIN identities from :class:`FrameSampler`
  each step (frames are cheap to draw: ~4 ms each), and held-out frames for PSNR from
  :func:`heldout_frames`;
* ``train_all`` calls :func:`build_latent_cache` once, after the VAE is final: it renders clips with
  speech, encodes them with the frozen VAE encoder and writes shards under the cache directory
  (resumable: finished shards are skipped);
* ``train_a2v`` / ``train_sr`` load every shard with :class:`LatentClips` (a few tens of MB) and slice
  windows from it. Pixels are never kept after encoding.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from models.avatars.dataset import IDENTITY_SPLITS, AvatarRenderer, FrameTruth, render_clip
from models.avatars.speech import SpeechSynth
from models.vae import CausalVAE

log = logging.getLogger(__name__)

# the small features a viewer reads identity from (models.avatars.face.REGIONS): what detail-weighted
# losses (``train_vae --detail-weight``) weight; skin, hair, hat and background keep weight 1
DETAIL_REGIONS: tuple[str, ...] = ("brows", "nose", "earrings", "glasses", "eyes", "lips", "mouth")


def to_unit(rgb_uint8: np.ndarray) -> torch.Tensor:
    """``(..., H, W, 3)`` uint8 -> float in [-1, 1] with channels moved before H, W."""
    t = torch.from_numpy(np.array(rgb_uint8, copy=True)).float().div(127.5).sub(1.0)
    return t.movedim(-1, -3)


class DrawnFrames(NamedTuple):
    """What :meth:`FrameSampler.draw` draws: ``frames`` and ``refs`` ``(B, 3, 1, S, S)`` in [-1, 1]; when
    asked, ``detail`` ``(B, 1, 1, S, S)`` in [0, 1] (the regions' coverage, occlusion included:
    :meth:`models.avatars.dataset.AvatarRenderer.coverage`), ``shift`` ``(B, 2, S/c, S/c)`` (dy, dx in
    pixels: where each cell's head came from in the reference) and ``head`` ``(B, 1, S/c, S/c)`` (1 where
    the head covers the cell whole, the cells ``shift`` holds for)."""

    frames: torch.Tensor
    refs: torch.Tensor
    detail: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    head: torch.Tensor | None = None


class FrameSampler:
    """Random single frames of random identities of a split (pose, blink, mouth opening and width drawn
    at random), as ``(B, 3, 1, S, S)`` in [-1, 1]. Keeps a small LRU of per-identity renderers."""

    def __init__(self, split: str = "train", size: int = 256, pool: int = 64) -> None:
        if split not in IDENTITY_SPLITS:
            raise ValueError(f"split={split!r}: must be one of {sorted(IDENTITY_SPLITS)}")
        self.split, self.size, self.pool = split, size, pool
        self._renderers: OrderedDict[int, AvatarRenderer] = OrderedDict()

    def _renderer(self, ident: int) -> AvatarRenderer:
        r = self._renderers.get(ident)
        if r is None:
            r = AvatarRenderer(ident, size=self.size)
            self._renderers[ident] = r
            if len(self._renderers) > self.pool:
                self._renderers.popitem(last=False)
        return r

    def batch(self, gen: torch.Generator, batch: int, crop: int | None = None) -> torch.Tensor:
        return self.draw(gen, batch, crop).frames

    def draw(self, gen: torch.Generator, batch: int, crop: int | None = None,
             regions: tuple[str, ...] | None = None, motion_cell: int | None = None) -> DrawnFrames:
        """A batch (:class:`DrawnFrames`): the frames, the identities' neutral reference frames, and
        when asked ``regions``' coverage of each frame and, per ``motion_cell`` x ``motion_cell`` cell, where
        the head came from in the reference (``FaceRenderer.reference_shift``) with the cells it covers
        whole. The frames do not depend on what else is asked: the same generator draws the same batch."""
        if motion_cell is not None and crop is not None and crop < self.size:
            raise ValueError(f"motion_cell={motion_cell} with crop={crop}: the head's motion is drawn for whole "
                             "frames: pass crop=None")
        lo, hi = IDENTITY_SPLITS[self.split]
        out, refs, details, shifts, heads = [], [], [], [], []
        for _ in range(batch):
            u = torch.rand(5, generator=gen).tolist()
            ident = lo + int(torch.randint(hi - lo, (1,), generator=gen))
            r = self._renderer(ident)
            frame_idx = int(torch.randint(100_000, (1,), generator=gen))
            # mouths are open in about 2/3 of speech frames: draw half the frames wide open-ish
            mouth_open = u[0] if u[1] < 0.7 else 0.0
            img, truth = r.frame(frame_idx, mouth_open, u[2])
            if u[3] < 0.1:  # the neutral reference frame itself (what the pipeline encodes)
                img = r.reference()
                truth = FrameTruth(0.0, truth.mouth_box, truth.face_box)  # neutral pose, mouth, eyes
            x = to_unit(img)
            refs.append(to_unit(r.reference()))
            d = None if regions is None else torch.from_numpy(r.coverage(truth, regions)[0])[None]  # (1, S, S)
            if motion_cell is not None:
                shift, head = r.head_motion(truth, motion_cell)
                shifts.append(torch.from_numpy(shift))
                heads.append(torch.from_numpy(head)[None].float())
            if crop is not None and crop < self.size:
                y0, x0 = (int(v) for v in torch.randint(0, (self.size - crop) // 8 + 1, (2,), generator=gen) * 8)
                x = x[:, y0 : y0 + crop, x0 : x0 + crop]
                d = None if d is None else d[:, y0 : y0 + crop, x0 : x0 + crop]
            out.append(x)
            if d is not None:
                details.append(d)
        detail = torch.stack(details)[:, :, None] if regions is not None else None
        motion = (torch.stack(shifts), torch.stack(heads)) if motion_cell is not None else (None, None)
        return DrawnFrames(torch.stack(out)[:, :, None], torch.stack(refs)[:, :, None], detail, *motion)


def heldout_frames(count: int, size: int = 256, seed: int = 12345) -> torch.Tensor:
    """A fixed set of held-out-identity frames ``(count, 3, 1, size, size)`` for PSNR."""
    return heldout_frames_with_reference(count, size, seed)[0]


def heldout_frames_with_reference(count: int, size: int = 256, seed: int = 12345) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`heldout_frames` and each frame's identity's neutral reference, both ``(count, 3, 1, size, size)``."""
    drawn = FrameSampler("heldout", size).draw(torch.Generator().manual_seed(seed), count)
    return drawn.frames, drawn.refs


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two tensors in [-1, 1] (peak-to-peak 2)."""
    mse = float(((a.clamp(-1, 1) - b.clamp(-1, 1)) ** 2).mean())
    return float(10 * np.log10(4.0 / max(mse, 1e-12)))


# ------------------------------------------------------------------------------------------ latents

def build_latent_cache(vae: CausalVAE, out_dir: Path, num_clips: int, clip_frames: int, *, split: str = "train",
                       seed: int = 0, shard_clips: int = 16, audio_context: int = 2,
                       num_identities: int | None = None, size: int = 256, worker: int = 0,
                       num_workers: int = 1, synth: SpeechSynth | None = None) -> list[Path]:
    """Render ``num_clips`` speech clips of ``clip_frames`` frames, encode them, write shards.

    Each shard ``shard_XXXX.pt`` holds ``hr`` (n, T, C, 32, 32) float16 hr latents, ``ref`` (n, C, 32, 32)
    float16 (the identity's neutral reference frame), ``audio`` (n, (T + 2*audio_context) * 640) float32
    (the audio of the clip with ``audio_context`` frames on each side, as the audio encoder wants it),
    ``mouth`` (n, T) float32, ``mouth_box`` (n, T, 4) int16 (each frame's mouth box in pixels, x0, y0, x1, y1:
    where speech moves the face), ``identity`` (n,) int64, ``detail`` (n, T, 32, 32) float16: the
    fraction of each latent cell's pixels that show the face's small features (:data:`DETAIL_REGIONS`),
    and ``detail_share`` (n, T, 32, 32) float16: each cell's share of those features, every feature
    visible in a frame summing to 1 over its cells (:meth:`AvatarRenderer.coverage`); ``ref_detail`` and
    ``ref_share`` (n, 32, 32) float16: the same two maps of the reference frame (:func:`reference_maps`).
    Existing shards are kept (resume).
    ``worker`` / ``num_workers``: this process builds shards ``s % num_workers == worker`` only (run
    several processes to build in parallel; the set of shards does not depend on the split).
    ``synth``: the speech (default the espeak-ng voices, which refuse without espeak-ng on PATH).
    """
    synth = synth or SpeechSynth()  # before any directory is made: a missing espeak-ng fails first
    out_dir.mkdir(parents=True, exist_ok=True)
    lo, hi = IDENTITY_SPLITS[split]
    span = hi - lo if num_identities is None else min(num_identities, hi - lo)
    paths = []
    n_shards = -(-num_clips // shard_clips)
    t0 = time.monotonic()
    for s in range(n_shards):
        path = out_dir / f"shard_{s:04d}.pt"
        paths.append(path)
        if path.is_file() or s % num_workers != worker:
            continue
        hr, ref, audio, mouth, mbox, ident, detail, share, ref_maps = [], [], [], [], [], [], [], [], []
        for j in range(s * shard_clips, min(num_clips, (s + 1) * shard_clips)):
            rng = np.random.default_rng([seed, j, 17])
            identity = lo + int(rng.integers(span))
            clip = render_clip(identity, int(rng.integers(2**31)), clip_frames + 2 * audio_context, split,
                               size=size, synth=synth, detail_regions=DETAIL_REGIONS)
            frames = to_unit(clip.frames[audio_context : audio_context + clip_frames])  # (T, 3, H, W)
            with torch.no_grad():
                z = vae.encode(frames.transpose(0, 1)[None])[0].transpose(0, 1)  # (T, C, h, w)
                zr = vae.encode(to_unit(clip.reference)[None, :, None])[0, :, 0]
            hr.append(z.half())
            ref.append(zr.half())
            audio.append(torch.from_numpy(clip.audio))
            mouth.append(torch.from_numpy(clip.mouth_open[audio_context : audio_context + clip_frames]))
            mbox.append(torch.from_numpy(clip.mouth_box[audio_context : audio_context + clip_frames]).short())
            ident.append(identity)
            assert clip.detail is not None and clip.detail_share is not None
            cell = size // z.shape[-1]
            window = slice(audio_context, audio_context + clip_frames)
            cover, part = cell_maps(clip.detail[window], clip.detail_share[window], cell)
            detail.append(cover)
            share.append(part)
            ref_maps.append(reference_maps(identity, size, cell))
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"hr": torch.stack(hr), "ref": torch.stack(ref), "audio": torch.stack(audio),
                    "mouth": torch.stack(mouth), "mouth_box": torch.stack(mbox), "identity": torch.tensor(ident),
                    "detail": torch.stack(detail), "detail_share": torch.stack(share),
                    "ref_detail": torch.stack([m[0] for m in ref_maps]),
                    "ref_share": torch.stack([m[1] for m in ref_maps])}, tmp)
        tmp.replace(path)
        log.info("latent cache: shard %d/%d written (%.0f s)", s + 1, n_shards, time.monotonic() - t0)
    return paths


def cell_maps(cover: np.ndarray, share: np.ndarray, cell: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pixel feature maps ``(..., S, S)`` (:meth:`AvatarRenderer.coverage`) on the latent grid of
    ``cell``-pixel cells, float16: the coverage averaged over a cell's pixels, the share summed (so each
    feature still sums to 1 over the frame)."""
    def pool(x: np.ndarray) -> torch.Tensor:
        out = torch.nn.functional.avg_pool2d(torch.from_numpy(x).reshape(-1, 1, *x.shape[-2:]), cell)
        return out.reshape(*x.shape[:-2], *out.shape[-2:])

    return pool(cover).half(), (pool(share) * cell * cell).half()


def reference_maps(identity: int, size: int, cell: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cell_maps` of the identity's reference frame (neutral pose, mouth shut, eyes open):
    ``(size/cell,)*2`` each."""
    r = AvatarRenderer(identity, size=size)
    return cell_maps(*r.coverage(FrameTruth(0.0, r.reference_mouth_box(), r.reference_face_box()), DETAIL_REGIONS),
                     cell)


class LatentClips:
    """Every cached shard in memory: ``hr`` (N, T, C, H, W) float32, ``ref`` (N, C, H, W), ``audio``
    (N, S), ``mouth`` (N, T), ``mouth_box`` (N, T, 4) float32 pixels, ``detail`` and ``detail_share``
    (N, T, H, W), ``ref_detail`` and ``ref_share`` (N, H, W), each None for a cache written before it
    was kept.
    Windows are sliced by the trainers."""

    def __init__(self, cache_dir: Path) -> None:
        paths = sorted(cache_dir.glob("shard_*.pt"))
        if not paths:
            raise FileNotFoundError(f"no latent shards in {cache_dir}: run models.training.train_all (or "
                                    "data.build_latent_cache) first")
        blobs = [torch.load(p, map_location="cpu") for p in paths]
        self.hr = torch.cat([b["hr"] for b in blobs]).float()
        self.ref = torch.cat([b["ref"] for b in blobs]).float()
        self.audio = torch.cat([b["audio"] for b in blobs]).float()
        self.mouth = torch.cat([b["mouth"] for b in blobs]).float()
        self.identity = torch.cat([b["identity"] for b in blobs])
        self.detail = torch.cat([b["detail"] for b in blobs]).float() if all("detail" in b for b in blobs) else None
        self.detail_share = (torch.cat([b["detail_share"] for b in blobs]).float()
                             if all("detail_share" in b for b in blobs) else None)
        self.ref_detail, self.ref_share = ((torch.cat([b["ref_detail"] for b in blobs]).float(),
                                            torch.cat([b["ref_share"] for b in blobs]).float())
                                           if all("ref_share" in b for b in blobs) else (None, None))
        self.mouth_box = (torch.cat([b["mouth_box"] for b in blobs]).float()
                          if all("mouth_box" in b for b in blobs) else None)
        log.info("latent clips: %d clips x %d frames from %d shards", self.hr.shape[0], self.hr.shape[1], len(paths))

    @property
    def num_clips(self) -> int:
        return int(self.hr.shape[0])

    @property
    def clip_frames(self) -> int:
        return int(self.hr.shape[1])
