"""The chain's upper bounds on a held-out ground-truth render (``reconstruction_report``): lip sync r
and PSNR after the VAE alone, and after encode -> to_lowres -> SR -> decode (what a perfect A2V
would give). Separates what the autoencoder / SR lose from what the A2V DiT loses.

Who calls what: ``python -m bench.reconstruction 10`` (seconds) while training. Scoring a checkpoint's
*renders* is ``bench.quality``'s model mode, which scores the frames of the real pipeline
(``bench.quality_render``: ``render()`` with a frame tap), so there is one renderer.
``LONGTAKE_EVAL_CHECKPOINT`` overrides the checkpoint (default models/checkpoints/tiny.safetensors).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from bench.quality import QualityMeter, heldout_speech
from models.checkpoint import build_modules, load_checkpoint
from models.presets import ModelPreset, get_preset
from models.training.common import REPO_ROOT


def load_modules(checkpoint: Path | None = None, preset: str = "tiny") -> tuple[dict[str, torch.nn.Module], ModelPreset]:
    p = get_preset(preset)
    ckpt = checkpoint or Path(os.environ.get("LONGTAKE_EVAL_CHECKPOINT", "") or
                              REPO_ROOT / "models" / "checkpoints" / f"{preset}.safetensors")
    mods = build_modules(p)
    load_checkpoint(mods, ckpt)
    for mod in mods.values():
        mod.eval()
    return mods, p


@torch.inference_mode()
def reconstruction_report(seconds: float = 20.0, identity: int = 0, seed: int = 0,
                          checkpoint: Path | None = None) -> dict[str, float]:
    """Upper bounds of the chain on a held-out ground-truth render: lip sync r and PSNR after the VAE
    alone (encode -> decode) and after encode -> to_lowres -> SR -> decode (what a perfect A2V would
    give). Separates what the autoencoder / SR lose from what the A2V DiT loses."""
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
