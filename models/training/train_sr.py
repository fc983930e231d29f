"""Train the one-step SR model: low-res latent (+ hr reference latent) -> hr latent, on cached clips.

Who calls it: ``train_all`` (after the latent cache exists) or ``python -m models.training.train_sr``.
Input ``to_lowres(z)`` of a frame, corrupted by Gaussian noise of random strength (at inference the
low-res latents come from the A2V sampler, not from the encoder), target ``z``; reference = the
identity's neutral frame latent. Loss: L1 in latent space, each cell weighted by its distance to the
reference's (``train_a2v.change_weights``: the mouth is a few cells of the frame). Frames are independent (SR is per frame),
so a batch is a random set of frames of random clips.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from models.checkpoint import build_modules
from models.presets import ModelPreset, get_preset
from models.sr import SRDiT
from models.training.common import (
    DEFAULT_CACHE,
    Budget,
    LossLog,
    cosine_lr,
    load_state,
    save_state,
    setup_logging,
    step_generator,
    warm_start,
)
from models.training.data import LatentClips
from models.training.train_a2v import EMA, change_weights, lowres

log = logging.getLogger(__name__)


def sr_batch(clips: LatentClips, lr_all: torch.Tensor, gen: torch.Generator, size: int, noise: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(lr input (B, C, 1, h, w) with noise, hr target (B, C, 1, H, W), ref (B, C, H, W), the cells'
    detail coverage (B, 1, H, W) or None when the cache has none)."""
    idx = torch.randint(clips.num_clips, (size,), generator=gen)
    fr = torch.randint(clips.clip_frames, (size,), generator=gen)
    hr = clips.hr[idx, fr][:, :, None]
    lr = lr_all[idx, fr][:, :, None]
    sig = torch.rand(size, 1, 1, 1, 1, generator=gen) * noise
    detail = None if clips.detail is None else clips.detail[idx, fr][:, None]
    return lr + sig * torch.randn(lr.shape, generator=gen), hr, clips.ref[idx], detail


@torch.no_grad()
def sr_eval(sr: SRDiT, clips: LatentClips, lr_all: torch.Tensor, count: int = 64) -> float:
    """L1 of the SR output vs the hr latent on a fixed set of frames (clean low-res input)."""
    lr, hr, ref, _ = sr_batch(clips, lr_all, torch.Generator().manual_seed(4242), count, 0.0)
    return float((sr(lr, ref) - hr).abs().mean())


def train_sr(preset: ModelPreset, cache_dir: Path, state_path: Path, *, minutes: float, seed: int = 0,
             batch: int = 16, lr: float = 1e-3, noise: float = 0.15, log_every: int = 20,
             save_every_s: float = 120.0, threads: int | None = None, detail_weight: float = 0.0,
             init_from: Path | None = None) -> dict[str, float]:
    """Train (or resume) until ``minutes`` of wall time in total; returns final figures.

    ``init_from``: a fresh run starts from that checkpoint's SR (its EMA weights) instead of bilinear
    upsampling (:func:`~models.training.common.warm_start`).

    ``detail_weight`` > 0 multiplies each cell's change weight by ``1 + detail_weight * coverage`` of
    the face's small features (the latent cache's ``detail``; issue 15)."""
    if threads:
        torch.set_num_threads(threads)
    sr = build_modules(preset, seed)["sr"]
    assert isinstance(sr, SRDiT)
    with torch.no_grad():  # residual head starts at zero: the model starts as bilinear upsampling
        sr.head.weight.zero_()
        sr.head.bias.zero_()
    ema = EMA({"sr": sr})
    opt = torch.optim.AdamW(sr.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    st = load_state(state_path, {"sr": sr, "ema_sr": ema.shadow["sr"]}, opt)
    clips = LatentClips(cache_dir)
    if detail_weight > 0.0 and clips.detail is None:
        raise ValueError(f"detail_weight={detail_weight}: the latent cache in {cache_dir} has no detail maps "
                         "(written before they were kept); delete it and build it again (train_all --stage cache)")
    lr_all = lowres(clips.hr, preset.lowres_factor)  # (N, T, C, h, w)
    budget = Budget(minutes, st.elapsed_s)
    losses = LossLog(state_path.with_suffix(".jsonl"), "sr")
    if "bilinear_l1" not in st.extra:
        st.extra["bilinear_l1"] = sr_eval(sr, clips, lr_all) if st.step == 0 else float("nan")
    if init_from is not None and warm_start({"sr": sr}, init_from, preset.name, st):
        ema = EMA({"sr": sr})  # the average starts at the loaded weights, not at bilinear upsampling
        st.extra["init_l1"] = sr_eval(sr, clips, lr_all)
    last_save = budget.elapsed_s
    while not budget.done():
        gen = step_generator(seed, st.step, 2)
        x, y, ref, detail = sr_batch(clips, lr_all, gen, batch, noise)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(lr, budget.fraction)
        w = change_weights(y, ref)  # (B, 1, H, W)
        if detail is not None and detail_weight > 0.0:
            w = w * (1.0 + detail_weight * detail)
        loss = ((sr(x, ref) - y).abs().mean(dim=1) * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(sr.parameters(), 1.0)
        opt.step()
        st.step += 1
        ema.update({"sr": sr}, min(0.998, (1 + st.step) / (10 + st.step)))
        losses.add(loss=loss.item())
        if st.step % log_every == 0:
            st.losses.append(losses.flush(st.step, budget.elapsed_s)["loss"])
        if budget.elapsed_s - last_save > save_every_s:
            st.elapsed_s = budget.elapsed_s
            save_state(state_path, {"sr": sr, "ema_sr": ema.shadow["sr"]}, opt, st)
            last_save = budget.elapsed_s
    st.elapsed_s = budget.elapsed_s
    st.extra["detail_weight"] = detail_weight
    st.extra["eval_l1"] = sr_eval(ema.shadow["sr"], clips, lr_all)
    log.info("sr: eval L1 %.4f (bilinear start %.4f) after %d steps", st.extra["eval_l1"],
             st.extra["bilinear_l1"], st.step)
    save_state(state_path, {"sr": sr, "ema_sr": ema.shadow["sr"]}, opt, st)
    return {"steps": st.step, "elapsed_s": st.elapsed_s, **st.extra}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--detail-weight", type=float, default=0.0,
                   help="extra loss weight on latent cells showing the face's small features (issue 15)")
    p.add_argument("--from", dest="from_checkpoint", type=Path, default=None,
                   help="start from this checkpoint's SR (a fresh state file only)")
    a = p.parse_args(argv)
    setup_logging(a.cache_dir / "train.log")
    out = train_sr(get_preset(a.preset), a.cache_dir / "latents", a.cache_dir / "sr_state.pt", minutes=a.minutes,
                   seed=a.seed, threads=a.threads, detail_weight=a.detail_weight, init_from=a.from_checkpoint)
    log.info("sr done: %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
