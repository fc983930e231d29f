"""Evaluate a trained checkpoint: a streaming renderer with the pipeline's N/I chunk logic, used as
``bench.quality``'s ``render_fn``, and the chain's upper bounds (``reconstruction_report``).

Who calls what: ``python -m bench.quality --json --render-fn models.training.evaluate:render_for_quality``
calls :func:`render_for_quality` twice (with and without I chunks). It runs the same modules, plan
(``pipeline.schedule.ChunkPlan``, reference slots included), audio windows, known-frame handling and
SR/decode order as the pipeline's stages, in-process and without the MP4 encoder, so a 10-minute
score costs only model time. It takes the plan from ``pipeline.schedule`` and the known frames and
(guided) velocity from the A2V stage's own ``known_latents`` / ``velocity_fn``, so the two cannot
drift apart. ``bench.quality``'s default render-fn is the real pipeline (``bench/quality_render.py``);
this one exists to score checkpoints fast while training.
``LONGTAKE_EVAL_CHECKPOINT`` overrides the checkpoint (default models/checkpoints/tiny.safetensors).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from models.checkpoint import build_modules, load_checkpoint
from models.presets import ModelPreset, get_preset
from models.sampler import FlowMatchEulerSampler
from models.training.common import REPO_ROOT
from pipeline.schedule import ChunkKind, ChunkPlan
from pipeline.stages.a2v import known_latents, velocity_fn


class StreamRenderer:
    """One render: reference + audio -> frames, chunk by chunk, constant memory."""

    def __init__(self, modules: dict[str, torch.nn.Module], preset: ModelPreset, *, seed: int = 0) -> None:
        self.m, self.p, self.seed = modules, preset, seed
        self.sampler = FlowMatchEulerSampler(preset.num_steps, preset.shift)

    @torch.inference_mode()
    def frames(self, reference_rgb: np.ndarray, audio: np.ndarray, num_frames: int, use_i: bool
               ) -> Iterator[np.ndarray]:
        p, m = self.p, self.m
        L, C, e = p.chunk_frames, p.context_frames, p.interp_frames
        ref = torch.from_numpy(reference_rgb).permute(2, 0, 1)[None, :, None].float().div(127.5).sub(1.0)
        ref_z = m["vae"].encode(ref)[:, :, 0]
        ref_lr = m["vae"].to_lowres(ref_z[:, :, None])  # (1, C, 1, h, w)
        sr_tokens = m["sr"].embed_reference(ref_z)
        ctx = m["a2v"].embed_context(ref_z)
        spf, pad = p.samples_per_frame, p.audio.context_frames
        wave = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
        plan = ChunkPlan(num_frames, L, C, e, use_i_chunks=use_i, reference_frame=p.reference_frame)
        last_n: torch.Tensor | None = None
        prev_last: torch.Tensor | None = None
        pending: torch.Tensor | None = None  # N_k waiting for I_{k-1} (with I chunks)
        cache: list[torch.Tensor] | None = None
        h, w = p.lr_latent_hw
        for step in plan.steps:
            win = step.window
            known_mask = step.known_mask()
            s0, s1 = (win.start - pad) * spf, (win.stop + pad) * spf
            seg = torch.zeros(s1 - s0)
            lo, hi = max(0, s0), min(wave.numel(), s1)
            if hi > lo:
                seg[lo - s0 : hi - s0] = wave[lo:hi]
            feats = m["audio"](seg[None], len(win))
            silent = m["audio"](torch.zeros_like(seg)[None], len(win)) if p.audio_guidance != 1.0 else None
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + win.start * 3 + (step.kind is ChunkKind.I))
            noise = torch.randn((1, p.latent_channels, len(win), h, w), generator=gen)
            known_BT = torch.tensor([known_mask])
            known = torch.zeros_like(noise)
            if step.known:
                known[:, :, known_BT[0]] = known_latents(step, ref_lr, last_n, prev_last)
            velocity = velocity_fn(m["a2v"], known_BT, torch.tensor([list(win)]), ref_z, feats, ctx, silent,
                                   p.audio_guidance)
            x0 = self.sampler.sample(velocity, noise, known, known_BT)
            g0 = step.generate.start - win.start
            gen_lat = x0[:, :, g0 : g0 + len(step.generate)]
            if step.kind is ChunkKind.N:
                prev_last = last_n[:, :, -1:] if last_n is not None else None
                last_n = gen_lat
                if step.emission is None:
                    pending = gen_lat
                    continue
                out = gen_lat
            else:
                assert pending is not None
                out = torch.cat([gen_lat, pending[:, :, len(step.generate):]], dim=2)
                pending = None
            z = m["sr"](out, ref_z, ref_tokens=sr_tokens)
            rgb, cache = m["vae"].decode(z, cache)
            frames = ((rgb[0].permute(1, 2, 3, 0) + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
            yield from frames


def load_modules(checkpoint: Path | None = None, preset: str = "tiny") -> tuple[dict[str, torch.nn.Module], ModelPreset]:
    p = get_preset(preset)
    ckpt = checkpoint or Path(os.environ.get("LONGTAKE_EVAL_CHECKPOINT", "") or
                              REPO_ROOT / "models" / "checkpoints" / f"{preset}.safetensors")
    mods = build_modules(p)
    load_checkpoint(mods, ckpt)
    for mod in mods.values():
        mod.eval()
    return mods, p


def render_for_quality(image_path: Path, audio_path: Path, seconds: float, use_i_chunks: bool,
                       out_dir: Path) -> tuple[Iterator[np.ndarray], list[int]]:
    """``bench.quality``'s render_fn: (frames, chunk boundaries on the final timeline)."""
    from bench.quality import chunk_boundaries, load_audio

    torch.set_num_threads(int(os.environ.get("LONGTAKE_EVAL_THREADS", "2")))
    mods, p = load_modules()
    ref = np.asarray(Image.open(image_path).convert("RGB").resize((p.width, p.height)))
    audio = load_audio(audio_path)
    n = int(np.ceil(seconds * p.fps))
    r = StreamRenderer(mods, p)
    bounds = chunk_boundaries(n, p.chunk_frames, p.context_frames, p.interp_frames, use_i_chunks)
    return r.frames(ref, audio, n, use_i_chunks), list(bounds)


@torch.inference_mode()
def reconstruction_report(seconds: float = 20.0, identity: int = 0, seed: int = 0,
                          checkpoint: Path | None = None) -> dict[str, float]:
    """Upper bounds of the chain on a held-out ground-truth render: lip sync r and PSNR after the VAE
    alone (encode -> decode) and after encode -> to_lowres -> SR -> decode (what a perfect A2V would
    give). Separates what the autoencoder / SR lose from what the A2V DiT loses."""
    from bench.quality import QualityMeter, heldout_speech
    from models.avatars.dataset import IDENTITY_SPLITS, AvatarRenderer
    from models.avatars.speech import normalize_loudness
    from models.training.data import psnr, to_unit

    mods, p = load_modules(checkpoint)
    audio = normalize_loudness(heldout_speech(seconds, seed))
    gt = AvatarRenderer(IDENTITY_SPLITS["heldout"][0] + identity, motion_seed=seed + 17)
    ref = gt.reference()
    ref_z = mods["vae"].encode(to_unit(ref)[None, :, None])[:, :, 0]
    meters = {k: QualityMeter(ref, gt.reference_mouth_box(), gt.reference_face_box(), gt.reference_eyes_box())
              for k in ("gt", "vae", "sr")}
    errs: dict[str, list[float]] = {"vae": [], "sr": []}
    batch: list[np.ndarray] = []
    n = int(seconds * p.fps)

    def flush() -> None:
        x = to_unit(np.stack(batch)).transpose(0, 1)[None]  # (1, 3, T, H, W)
        z = mods["vae"].encode(x)
        outs = {"vae": mods["vae"].decode(z)[0],
                "sr": mods["vae"].decode(mods["sr"](mods["vae"].to_lowres(z), ref_z))[0]}
        for k, y in outs.items():
            errs[k].append(psnr(y, x))
            for f in ((y[0].permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy():
                meters[k].add(f)
        for f in batch:
            meters["gt"].add(f)
        batch.clear()

    for frame, _truth in gt.stream(audio, num_frames=n):
        batch.append(frame)
        if len(batch) == 16:
            flush()
    if batch:
        flush()
    out: dict[str, float] = {}
    for k, meter in meters.items():
        s = meter.summary(audio, [])
        out[f"{k}_lipsync_r"] = float(s["lipsync_r"])
        out[f"{k}_face_first"] = float(s["drift_face_first"])
        out[f"{k}_background_first"] = float(s["drift_background_first"])
        if k in errs:
            out[f"{k}_psnr_db"] = round(float(np.mean(errs[k])), 2)
    return out


if __name__ == "__main__":
    import json
    import sys

    torch.set_num_threads(2)
    print(json.dumps(reconstruction_report(float(sys.argv[1]) if len(sys.argv) > 1 else 20.0)))
