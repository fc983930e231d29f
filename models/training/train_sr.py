"""Train the one-step SR model: low-res latent (+ hr reference latent) -> hr latent, on cached clips.

Who calls it: ``train_all`` (after the latent cache exists) or ``python -m models.training.train_sr``.
Input ``to_lowres(z)`` of a frame, corrupted by Gaussian noise of random strength (at inference the
low-res latents come from the A2V sampler, not from the encoder), target ``z``; reference = the
identity's neutral frame latent. Loss: L1 in latent space, each cell weighted by its distance to the
reference's (``train_a2v.change_weights``: the mouth is a few cells of the frame); ``--feature-weight W``
adds W cells' worth of weight to each of the face's features in a frame, spread over its cells, so an
earring counts as much as the glasses (:func:`sr_weights`). Frames are independent (SR is per frame),
so a batch is a random set of frames of random clips. ``--feature-blur P`` washes the face's small
features out of the low-res input of a share P of each batch (:func:`blur_features`), as the A2V's
latents lose them, so the SR learns to take them from the reference (issue 15). ``--pixel-weight W``
adds W x an L1 in pixels through the cache's frozen decoder, on a window around a feature of each
frame (:func:`pixel_loss`): a feature that is a small mark in the latent weighs what it weighs on screen.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from models.checkpoint import build_modules
from models.presets import ModelPreset, get_preset
from models.sr import SRDiT
from models.training.common import (
    DEFAULT_CACHE,
    Budget,
    LossLog,
    cosine_lr,
    load_state,
    on_device,
    save_state,
    setup_logging,
    step_generator,
    warm_start,
)
from models.training.data import LatentClips
from models.training.train_a2v import EMA, box_cover, change_weights, lowres
from models.training.train_vae import plain_decoder
from models.vae import CausalVAE

log = logging.getLogger(__name__)

PIXEL_CROP_CELLS = 8  # hr latent cells per side of the window --pixel-weight decodes (64 px in tiny)
PIXEL_FEATURE_WEIGHT = 64.0  # a pixel of a cell wholly a feature's counts 1 + this in that window's L1


def blur_features(lr_BChw: torch.Tensor, detail_BHW: torch.Tensor, mouth_box_B4: torch.Tensor, strength_B: torch.Tensor,
                  cell_px: float) -> torch.Tensor:
    """The low-res latents with the face's small features washed out, as the A2V's own latents lose them
    (issue 15: glasses present in 67 % of frames after encode -> lowres -> SR, 33 % after the A2V): each
    cell moves towards its 5x5 neighbourhood mean by ``strength`` x 4 x its feature coverage (capped at
    1: the features are thin lines, so a cell a quarter covered is washed out fully), except the mouth
    box's cells, whose state only the low-res latent knows (the reference's mouth is shut)."""
    f = detail_BHW.shape[-1] // lr_BChw.shape[-1]  # hr cells per low-res cell, per side
    cover = F.avg_pool2d(detail_BHW[:, None], f)  # (B, 1, h, w)
    mouth = box_cover(mouth_box_B4[:, None], lr_BChw.shape[-2], lr_BChw.shape[-1], cell_px)  # (B, 1, h, w)
    m = (4 * cover).clamp(0, 1) * (1 - mouth) * strength_B[:, None, None, None]
    smooth = F.avg_pool2d(lr_BChw, 5, stride=1, padding=2, count_include_pad=False)
    return lr_BChw + m * (smooth - lr_BChw)


def sr_batch(clips: LatentClips, lr_all: torch.Tensor, gen: torch.Generator, size: int, noise: float,
             feature_blur: float = 0.0, cell_px: float = 16.0, reference_share: float = 0.0,
             ref_lr: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(lr input (B, C, 1, h, w) with noise, hr target (B, C, 1, H, W), ref (B, C, H, W), the cells'
    detail coverage and feature share (B, 1, H, W) each, None when the cache has none). ``feature_blur``
    > 0: that share of the batch gets :func:`blur_features` at a random strength (``cell_px``: a low-res
    cell in pixels). ``reference_share`` > 0: that share of the batch is the clip's reference frame
    itself (target the reference latent, input ``ref_lr``, its low-res latent, with the same noise and
    blur; the blur spares the mouth box of the frame the row replaced, the cache keeps none for the
    reference, whose mouth is shut), the one frame where copying the reference cell by cell is exactly right."""
    idx = torch.randint(clips.num_clips, (size,), generator=gen)
    fr = torch.randint(clips.clip_frames, (size,), generator=gen)
    hr = clips.hr[idx, fr][:, :, None]
    lr = lr_all[idx, fr][:, :, None]
    detail = None if clips.detail is None else clips.detail[idx, fr][:, None]
    share = None if clips.detail_share is None else clips.detail_share[idx, fr][:, None]
    if reference_share > 0.0:
        assert ref_lr is not None and clips.ref_detail is not None and clips.ref_share is not None  # train_sr checks
        on = torch.rand(size, generator=gen) < reference_share
        hr = torch.where(on[:, None, None, None, None], clips.ref[idx][:, :, None], hr)
        lr = torch.where(on[:, None, None, None, None], ref_lr[idx][:, :, None], lr)
        detail = torch.where(on[:, None, None, None], clips.ref_detail[idx][:, None], detail)
        share = torch.where(on[:, None, None, None], clips.ref_share[idx][:, None], share)
    sig = torch.rand(size, 1, 1, 1, 1, generator=gen) * noise
    lr = lr + sig * torch.randn(lr.shape, generator=gen)
    if feature_blur > 0.0:
        assert detail is not None and clips.mouth_box is not None  # train_sr checks the cache
        strength = torch.rand(size, generator=gen) * (torch.rand(size, generator=gen) < feature_blur)
        lr = blur_features(lr[:, :, 0], detail[:, 0], clips.mouth_box[idx, fr], strength, cell_px)[:, :, None]
    return lr, hr, clips.ref[idx], detail, share


def sr_weights(y_BC1HW: torch.Tensor, ref_BCHW: torch.Tensor, detail: torch.Tensor | None,
               share: torch.Tensor | None, detail_weight: float, feature_weight: float) -> torch.Tensor:
    """Per-cell loss weights ``(B, 1, H, W)``: the change weight (:func:`change_weights`) times ``1 +
    detail_weight x`` the cell's feature coverage, plus ``feature_weight x`` its feature share (each
    feature visible in the frame sums to 1 over its cells, so it adds ``feature_weight`` cells' worth of
    weight whatever its size: a pair of earrings, ~70 pixels over 5-7 cells of 8 x 8, gets as much as
    the glasses, ~350 pixels over ~28 cells)."""
    w = change_weights(y_BC1HW, ref_BCHW)
    if detail_weight > 0.0:
        assert detail is not None  # train_sr checks the cache
        w = w * (1.0 + detail_weight * detail)
    if feature_weight > 0.0:
        assert share is not None
        w = w + feature_weight * share
    return w


def feature_crops(share_B1HW: torch.Tensor, gen: torch.Generator, size: int) -> torch.Tensor:
    """Top-left cells ``(B, 2)`` of a ``size`` x ``size`` window per frame, centred on a cell drawn in
    proportion to the frame's feature shares (uniformly in a frame that shows none), kept inside it."""
    B, _, H, W = share_B1HW.shape
    p = share_B1HW.reshape(B, H * W).float() + 1e-6
    cell = torch.multinomial(p, 1, generator=gen)[:, 0]
    yx = torch.stack([cell // W, cell % W], dim=1) - size // 2
    return torch.minimum(yx.clamp(min=0), torch.tensor([H - size, W - size]))


def crop_cells(z_BC1HW: torch.Tensor, origin_B2: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` x ``size`` window of each frame's latent at ``origin_B2`` -> ``(B, C, 1, size, size)``."""
    return torch.stack([z[..., y:y + size, x:x + size] for z, (y, x) in zip(z_BC1HW, origin_B2.tolist(), strict=True)])


def pixel_loss(vae: CausalVAE, pred_BC1HW: torch.Tensor, target_BC1HW: torch.Tensor, share_B1HW: torch.Tensor,
               gen: torch.Generator, size: int = PIXEL_CROP_CELLS) -> torch.Tensor:
    """L1 in pixels between the decoded SR output and the decoded target on a window around one of each
    frame's features (:func:`feature_crops`; the whole frame if it is smaller), each pixel weighted ``1 +
    PIXEL_FEATURE_WEIGHT x`` its cell's feature share: a small feature that the latent L1 sees as a small
    mark (the silver earrings of held-out 34 differ from no earrings by ~0.5 at their cells,
    docs/quality.md "Why the gold earrings go") weighs what it weighs on screen. ``vae``: the cache's,
    frozen by the caller. The window is decoded on its own, on both sides alike: its border without
    its neighbours, and the decoder's group norms over the window, not the frame (docs/quality.md "The
    ninth checkpoint" measures how far that is from decoding the frame)."""
    size = min(size, *share_B1HW.shape[-2:])
    origin = feature_crops(share_B1HW.cpu(), gen, size).to(pred_BC1HW.device)
    f = vae.cfg.factor
    with torch.no_grad():
        want = vae.decode(crop_cells(target_BC1HW, origin, size), clamp=False)[0][:, :, 0]
    got = vae.decode(crop_cells(pred_BC1HW, origin, size), clamp=False)[0][:, :, 0]
    w = 1.0 + PIXEL_FEATURE_WEIGHT * F.interpolate(crop_cells(share_B1HW[:, :, None], origin, size)[:, :, 0], scale_factor=f)
    return ((got - want).abs().mean(dim=1, keepdim=True) * w).sum() / w.sum()


@torch.no_grad()
def sr_eval(sr: SRDiT, clips: LatentClips, lr_all: torch.Tensor, count: int = 64) -> float:
    """L1 of the SR output vs the hr latent on a fixed set of frames (clean low-res input)."""
    lr, hr, ref, _, _ = sr_batch(clips, lr_all, torch.Generator().manual_seed(4242), count, 0.0)
    b = on_device({"lr": lr, "hr": hr, "ref": ref}, next(sr.parameters()).device)
    return float((sr(b["lr"], b["ref"]) - b["hr"]).abs().mean())


def train_sr(preset: ModelPreset, cache_dir: Path, state_path: Path, *, minutes: float, seed: int = 0,
             batch: int = 16, lr: float = 1e-3, noise: float = 0.15, log_every: int = 20,
             save_every_s: float = 120.0, threads: int | None = None, detail_weight: float = 0.0,
             feature_weight: float = 0.0, feature_blur: float = 0.0, reference_share: float = 0.0,
             init_from: Path | None = None, device: str = "cpu",
             reinit_reshaped: bool = False, pixel_weight: float = 0.0) -> dict[str, float]:
    """Train (or resume) until ``minutes`` of wall time in total; returns final figures.

    ``init_from``: a fresh run starts from that checkpoint's SR (its EMA weights) instead of bilinear
    upsampling (:func:`~models.training.common.warm_start`; ``reinit_reshaped``: tensors whose shape
    changed since keep the seeded init: the head at zero, the reference windows as no-ops).

    ``detail_weight`` > 0 multiplies each cell's change weight by ``1 + detail_weight * coverage`` of
    the face's small features (the latent cache's ``detail``; issue 15); ``feature_weight`` > 0 adds that
    many cells' worth of weight to each feature visible in a frame (``detail_share``; :func:`sr_weights`).
    ``reference_share`` > 0: that share of each batch is the reference frame itself (:func:`sr_batch`).
    ``feature_blur`` > 0: that share
    of each batch has its features washed out of the low-res input (:func:`blur_features`), so the SR
    learns to restore them from the reference. ``pixel_weight`` > 0 adds that times :func:`pixel_loss`,
    through the VAE the cache's latents were encoded with (``vae_final.pt`` beside ``cache_dir``, frozen).

    ``device``: where the model trains (``cuda`` on a GPU machine); batches are drawn on the CPU from
    the step's generator either way (:func:`~models.training.common.on_device`)."""
    if threads:
        torch.set_num_threads(threads)
    sr = build_modules(preset, seed)["sr"]
    assert isinstance(sr, SRDiT)
    sr.to(device)
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
    if feature_weight > 0.0 and clips.detail_share is None:
        raise ValueError(f"feature_weight={feature_weight}: the latent cache in {cache_dir} has no feature shares "
                         "(written before they were kept); delete it and build it again (train_all --stage cache)")
    if reference_share > 0.0 and clips.ref_share is None:
        raise ValueError(f"reference_share={reference_share}: the latent cache in {cache_dir} has no reference "
                         "feature maps (written before they were kept); delete it and build it again "
                         "(train_all --stage cache)")
    pixel_vae = None
    if pixel_weight > 0.0:
        if clips.detail_share is None or not (cache_dir.parent / "vae_final.pt").is_file():
            raise ValueError(f"pixel_weight={pixel_weight}: needs the VAE the latents in {cache_dir} were encoded "
                             f"with ({cache_dir.parent / 'vae_final.pt'}) and their feature shares: build the cache "
                             "with train_all (--stage reuse-vae or the VAE stage, then --stage cache), or pass "
                             "--pixel-weight 0")
        from models.training.train_all import final_vae  # train_all imports this module

        # the cache keeps no reference pixels for a decoder that reads them: its plain path judges the crops
        pixel_vae = plain_decoder(final_vae(preset, cache_dir.parent).to(device))
    if feature_blur > 0.0 and (clips.detail is None or clips.mouth_box is None):
        raise ValueError(f"feature_blur={feature_blur}: the latent cache in {cache_dir} has no detail maps or mouth "
                         "boxes (written before they were kept); delete it and build it again (train_all --stage cache)")
    cell_px = float(preset.vae_factor * preset.lowres_factor)
    lr_all = lowres(clips.hr, preset.lowres_factor)  # (N, T, C, h, w)
    ref_lr = lowres(clips.ref[:, None], preset.lowres_factor)[:, 0]  # (N, C, h, w)
    losses = LossLog(state_path.with_suffix(".jsonl"), "sr")
    if "bilinear_l1" not in st.extra:
        st.extra["bilinear_l1"] = sr_eval(sr, clips, lr_all) if st.step == 0 else float("nan")
    if init_from is not None and warm_start({"sr": sr}, init_from, preset.name, st,
                                            reinit_reshaped=reinit_reshaped):
        ema = EMA({"sr": sr})  # the average starts at the loaded weights, not at bilinear upsampling
        st.extra["init_l1"] = sr_eval(sr, clips, lr_all)
    budget = Budget(minutes, st.elapsed_s)  # training time: starts after the start-of-run scoring
    last_save = budget.elapsed_s
    while not budget.done():
        gen = step_generator(seed, st.step, 2)
        x, y, ref, detail, share = sr_batch(clips, lr_all, gen, batch, noise, feature_blur, cell_px,
                                            reference_share, ref_lr)
        b = on_device({"x": x, "y": y, "ref": ref, "detail": detail, "share": share}, next(sr.parameters()).device)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(lr, budget.fraction)
        x, y, ref = b["x"], b["y"], b["ref"]
        w = sr_weights(y, ref, b["detail"], b["share"], detail_weight, feature_weight)  # (B, 1, H, W)
        pred = sr(x, ref)
        loss = ((pred - y).abs().mean(dim=1) * w).sum() / w.sum()
        if pixel_weight > 0.0:
            assert pixel_vae is not None and b["share"] is not None
            loss = loss + pixel_weight * pixel_loss(pixel_vae, pred, y, b["share"], gen)
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
    st.extra["feature_weight"] = feature_weight
    st.extra["reference_share"] = reference_share
    st.extra["feature_blur"] = feature_blur
    st.extra["pixel_weight"] = pixel_weight
    st.extra["lr"] = lr
    st.extra["batch"] = batch
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
    p.add_argument("--device", default="cpu", help="where the model trains: cpu, or cuda on a GPU machine")
    p.add_argument("--batch", type=int, default=16, help="frames per step")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate of the cosine schedule (a continuation of a trained SR: lower)")
    p.add_argument("--detail-weight", type=float, default=0.0,
                   help="extra loss weight on latent cells showing the face's small features (issue 15)")
    p.add_argument("--feature-weight", type=float, default=0.0,
                   help="cells' worth of extra loss weight for each of the face's features in a frame, spread over "
                        "its cells: small features (earrings, nostrils) count as much as large ones (issue 15)")
    p.add_argument("--reference-share", type=float, default=0.0,
                   help="share of each batch that is the reference frame itself (input its low-res latent, target "
                        "the reference): teaches the copy from the reference cell by cell (issue 15)")
    p.add_argument("--feature-blur", type=float, default=0.0,
                   help="share of each batch whose low-res input has the face's features washed out (issue 15)")
    p.add_argument("--pixel-weight", type=float, default=0.0,
                   help="weight of an L1 in pixels, through the cache's frozen decoder, on a window around a "
                        "feature of each frame (issue 15: small features are small marks in the latent)")
    p.add_argument("--from", dest="from_checkpoint", type=Path, default=None,
                   help="start from this checkpoint's SR (a fresh state file only)")
    p.add_argument("--reinit-reshaped", action="store_true",
                   help="with --from: tensors whose shape differs from the checkpoint's (a preset with other latent "
                        "channels: patch embeddings, head, reference windows) keep the seeded init; the rest load")
    a = p.parse_args(argv)
    if a.reinit_reshaped and a.from_checkpoint is None:
        p.error("--reinit-reshaped needs --from CHECKPOINT (it says which of that checkpoint's tensors to skip)")
    setup_logging(a.cache_dir / "train.log")
    out = train_sr(get_preset(a.preset), a.cache_dir / "latents", a.cache_dir / "sr_state.pt", minutes=a.minutes,
                   seed=a.seed, lr=a.lr, threads=a.threads, detail_weight=a.detail_weight,
                   feature_weight=a.feature_weight, reference_share=a.reference_share,
                   feature_blur=a.feature_blur, init_from=a.from_checkpoint, device=a.device, batch=a.batch,
                   reinit_reshaped=a.reinit_reshaped, pixel_weight=a.pixel_weight)
    log.info("sr done: %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
