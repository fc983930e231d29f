"""Train the causal VAE of a preset on random frames of TRAIN identities; report PSNR on held-out ones.

Who calls it: ``train_all`` (first stage) or ``python -m models.training.train_vae``. It writes a
resumable state file; :func:`finalize_vae` then rescales the latent channels to unit variance (folded
exactly into the encoder's output conv and the decoder's input conv) so flow-matching noise N(0, 1)
matches the latents' scale.

Why single frames: the decoder's causal temporal convs start with zero weights on past frames (so
the decoder is per-frame at init) and, trained on one-frame clips, they stay zero: the decoder is
exactly per-frame, which streams trivially and cannot smear errors across chunk boundaries.
Why crops: the network is fully convolutional; 128x128 crops cost a quarter of a full frame. The last
part of the budget trains on full frames so group-norm statistics match inference.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from pathlib import Path

import torch
from torch import nn

from models.checkpoint import GROWN_PARTS
from models.presets import ModelPreset, VAEConfig, get_preset
from models.training.common import (
    DEFAULT_CACHE,
    Budget,
    LossLog,
    cosine_lr,
    load_state,
    save_state,
    setup_logging,
    step_generator,
)
from models.training.data import (
    DETAIL_REGIONS,
    FrameSampler,
    heldout_frames,
    heldout_frames_with_reference,
    psnr,
)
from models.vae import CausalConv3d, CausalVAE, DecoderReference, pool_frames

log = logging.getLogger(__name__)


def zero_past_taps(vae: CausalVAE) -> None:
    """Zero the weights every causal temporal conv puts on past frames (the current frame's tap is the
    last ``cin`` input channels of the stacked conv)."""
    with torch.no_grad():
        for m in vae.modules():
            if isinstance(m, CausalConv3d):
                m.conv.weight[:, : m.cin * (m.kt - 1)] = 0.0


def _wmean(e: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return e.mean() if w is None else (e * w).sum() / (w.sum() * e.shape[1])


def edge_loss(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """L1 between horizontal and vertical finite differences: keeps the flat-colour edges sharp.
    ``weight`` (broadcast to ``(B, 1, T, H, W)``) weights each difference by its pixel pair's mean."""
    dy = (y[..., 1:, :] - y[..., :-1, :]) - (x[..., 1:, :] - x[..., :-1, :])
    dx = (y[..., :, 1:] - y[..., :, :-1]) - (x[..., :, 1:] - x[..., :, :-1])
    wy = None if weight is None else 0.5 * (weight[..., 1:, :] + weight[..., :-1, :])
    wx = None if weight is None else 0.5 * (weight[..., :, 1:] + weight[..., :, :-1])
    return _wmean(dy.abs(), wy) + _wmean(dx.abs(), wx)


def pixel_weight(detail: torch.Tensor | None, detail_weight: float) -> torch.Tensor | None:
    """Per-pixel loss weight ``1 + detail_weight * detail`` (``detail``: the coverage of the face's
    small features, ``FrameSampler.draw``); None when off. The weighted losses divide by
    the weights' sum, so their scale stays that of a plain mean."""
    if detail is None or detail_weight <= 0.0:
        return None
    return 1.0 + detail_weight * detail


def recon_loss(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """L1 + 2 MSE + 0.5 edge, each a (``weight``-weighted) mean over pixels."""
    l1 = _wmean((y - x).abs(), weight)
    mse = _wmean((y - x).pow(2), weight)
    edge = edge_loss(y, x, weight)
    return l1 + 2.0 * mse + 0.5 * edge, {"l1": l1.item(), "mse": mse.item(), "edge": edge.item()}


SCALE_FACTORS = (2, 4)


def vae_loss(vae: CausalVAE, x: torch.Tensor, gen: torch.Generator, kl_weight: float,
             weight: torch.Tensor | None = None, scale_equivariance: float = 0.0, *,
             reference: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Reconstruction (:func:`recon_loss`) + ``kl_weight`` x KL, plus with ``scale_equivariance`` > 0
    that weight x the reconstruction loss of the pooled frame from the decoded pooled latent
    (:meth:`~models.vae.CausalVAE.to_lowres`, and :func:`~models.vae.pool_frames` for the frame and
    its weights), by a factor drawn from :data:`SCALE_FACTORS` (Skorokhodov et al. 2025,
    "Improving the Diffusability of Autoencoders", arXiv 2502.14831): the decoder must read a pooled
    latent as the pooled picture, which takes the high frequencies out of the latent that the picture
    does not have. Factor 2 is the A2V's own ``to_lowres``."""
    if scale_equivariance > 0.0 and reference is not None:
        raise ValueError("vae_loss: scale_equivariance > 0 decodes pooled latents, which the reference window's "
                         "features (one resolution) cannot be read at: train a decoder that reads the reference "
                         "with scale_equivariance=0")
    mean, logvar = vae.encode_moments(x)
    z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=gen)
    y, _ = vae.decode(z, clamp=False, reference=reference)
    rec, parts = recon_loss(y, x, weight)
    kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
    loss = rec + kl_weight * kl
    out = {**parts, "kl": kl.item()}
    if scale_equivariance > 0.0:
        f = SCALE_FACTORS[int(torch.randint(len(SCALE_FACTORS), (1,), generator=gen))]
        y_down, _ = vae.decode(vae.to_lowres(z, f), clamp=False)  # refuses a latent f does not divide
        se, _ = recon_loss(y_down, pool_frames(x, f), None if weight is None else pool_frames(weight, f))
        loss = loss + scale_equivariance * se
        out["se"] = se.item()
    return loss, {"loss": loss.item(), **out}


@torch.no_grad()
def heldout_psnr(vae: CausalVAE, frames: torch.Tensor, sr: nn.Module | None = None, batch: int = 4,
                 references: torch.Tensor | None = None) -> float:
    """PSNR of encode -> decode (or, with ``sr``, encode -> to_lowres -> SR -> decode, the SR's reference
    being the frame itself) on held-out frames. ``references``: each frame's identity's neutral
    reference ``(N, 3, 1, S, S)``, for a decoder that reads it (never the frame itself: it would copy it)."""
    outs = []
    for i in range(0, frames.shape[0], batch):
        z = vae.encode(frames[i : i + batch])
        ref = None if references is None else vae.reference_features(references[i : i + batch, :, 0])
        if sr is not None:
            z = sr(vae.to_lowres(z), z[:, :, 0])
        y, _ = vae.decode(z, reference=ref)
        outs.append(y)
    return psnr(torch.cat(outs), frames)


def train_vae(preset: ModelPreset, state_path: Path, *, minutes: float, seed: int = 0, batch: int = 4,
              crop: int = 128, full_fraction: float = 0.15, full_batch: int = 2, lr: float = 2e-3,
              kl_weight: float = 1e-5, log_every: int = 20, save_every_s: float = 120.0,
              eval_frames: int = 16, threads: int | None = None, detail_weight: float = 0.0,
              scale_equivariance: float = 0.0) -> dict[str, float]:
    """Train (or resume) until ``minutes`` of wall time in total; returns final figures.

    ``detail_weight`` > 0 weights every reconstruction loss by ``1 + detail_weight`` on the face's
    small features (:data:`models.training.data.DETAIL_REGIONS`: brows, nose, eyes, lips, mouth,
    glasses, earrings), from the generator's region masks: they are a few percent of the frame, so a
    plain mean spends the encoder's latent on skin and background (issue 15).
    ``scale_equivariance``: the weight of :func:`vae_loss`'s downsampled-reconstruction term (0: off)."""
    if scale_equivariance > 0.0:  # refused now, not at the first step that draws a factor it fails on
        side = preset.vae_factor * math.lcm(*SCALE_FACTORS)
        for name, px in (("crop", crop), ("the preset's frame size", preset.height)):
            if px % side:
                raise ValueError(f"scale_equivariance={scale_equivariance}: {name} {px} is not a multiple of {side} "
                                 f"(the VAE factor {preset.vae_factor} x the pooling factors {SCALE_FACTORS}); "
                                 f"use a crop such as {side * max(1, px // side)}, or --scale-equivariance 0")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    # a decoder that reads the reference is trained plain here (crops cannot be given the reference); its
    # window and gate grow on these weights as no-ops (vae_from_state) and train in train_decoder
    vae = CausalVAE(without_reference(preset.vae))
    zero_past_taps(vae)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    st = load_state(state_path, {"vae": vae}, opt)
    budget = Budget(minutes, st.elapsed_s)
    sampler = FrameSampler("train", preset.height)
    losses = LossLog(state_path.with_suffix(".jsonl"), "vae")
    last_save = budget.elapsed_s
    vae.train()
    while not budget.done():
        gen = step_generator(seed, st.step)
        full = budget.fraction > 1.0 - full_fraction
        drawn = sampler.draw(gen, full_batch if full else batch, None if full else crop,
                             DETAIL_REGIONS if detail_weight > 0.0 else None)
        x, detail = drawn.frames, drawn.detail
        for g in opt.param_groups:
            g["lr"] = cosine_lr(lr, budget.fraction)
        loss, parts = vae_loss(vae, x, gen, kl_weight, pixel_weight(detail, detail_weight), scale_equivariance)
        vae_step(vae, opt, loss)
        st.step += 1
        losses.add(**parts)
        if st.step % log_every == 0:
            st.losses.append(losses.flush(st.step, budget.elapsed_s)["loss"])
        if budget.elapsed_s - last_save > save_every_s:
            st.elapsed_s = budget.elapsed_s
            save_state(state_path, {"vae": vae}, opt, st)
            last_save = budget.elapsed_s
    vae.eval()
    st.elapsed_s = budget.elapsed_s
    st.extra["detail_weight"] = detail_weight
    st.extra["kl_weight"] = kl_weight
    st.extra["scale_equivariance"] = scale_equivariance
    if eval_frames:
        st.extra["heldout_psnr_db"] = heldout_psnr(vae, heldout_frames(eval_frames, preset.height))
        log.info("vae: held-out PSNR %.2f dB after %d steps", st.extra["heldout_psnr_db"], st.step)
    save_state(state_path, {"vae": vae}, opt, st)
    return {"steps": st.step, "elapsed_s": st.elapsed_s, **st.extra}


@torch.no_grad()
def finalize_vae(vae: CausalVAE, preset: ModelPreset, count: int = 32, seed: int = 777) -> torch.Tensor:
    """Rescale each latent channel to unit std over ``count`` training frames, exactly: the encoder's
    mean outputs are divided by s_c (log-variance shifted by -2 log s_c) and the decoder's input conv
    multiplies channel c by s_c on every temporal tap. Returns the scales."""
    frames = FrameSampler("train", preset.height).batch(torch.Generator().manual_seed(seed), count)
    z = torch.cat([vae.encode(frames[i : i + 8]) for i in range(0, count, 8)])
    s = z.transpose(0, 1).reshape(z.shape[1], -1).std(dim=1).clamp(min=1e-4)  # (C,)
    c = s.numel()
    out_conv = vae.encoder.blocks[-1][2]
    out_conv.weight[:c] /= s[:, None, None, None]
    out_conv.bias[:c] /= s
    out_conv.bias[c:] -= 2 * torch.log(s)
    conv_in = vae.decoder.conv_in
    for tap in range(conv_in.kt):
        conv_in.conv.weight[:, tap * c : (tap + 1) * c] *= s[None, :, None, None]
    return s


def without_reference(cfg: VAEConfig) -> VAEConfig:
    """``cfg`` with a decoder that does not read the reference (no window, no warp)."""
    return dataclasses.replace(cfg, ref_window_radius=0, ref_warp=False)


def vae_from_state(cfg: VAEConfig, state_dict: dict[str, torch.Tensor]) -> CausalVAE:
    """``CausalVAE(cfg)`` holding ``state_dict``, which may lack a decoder window and gate (``GROWN_PARTS``:
    the weights of a plain decoder, from ``train_vae`` or a plain checkpoint): they stay the no-ops they
    start as. Anything else missing or unexpected is an error."""
    vae = CausalVAE(cfg)
    res = vae.load_state_dict(state_dict, strict=False)
    grown = tuple(p[len("vae."):] for p in GROWN_PARTS if p.startswith("vae."))
    bad = [k for k in res.missing_keys if not k.startswith(grown)] + list(res.unexpected_keys)
    if bad:
        raise ValueError(f"VAE state dict does not fit {cfg}: missing or unexpected {bad[:6]}"
                         f"{' ...' if len(bad) > 6 else ''}; was it written for another preset?")
    return vae


def plain_decoder(vae: CausalVAE) -> CausalVAE:
    """``vae`` itself, or, when its decoder reads the reference, a copy without the window and the warp
    (the decoder's plain path, frozen): for losses that decode where no reference pixels are at hand
    (``train_sr``'s pixel loss decodes crops of cached latents). A window that starts as a no-op makes it
    the same decoder."""
    if vae.decoder.ref_window is None:
        return vae
    plain = CausalVAE(without_reference(vae.cfg))
    own = plain.state_dict()
    plain.load_state_dict({k: v for k, v in vae.state_dict().items() if k in own})
    return plain.to(next(vae.parameters()).device).eval().requires_grad_(False)


def vae_step(vae: CausalVAE, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """One optimiser step on ``loss`` over the parameters ``opt`` holds (the whole VAE, or the decoder
    alone): gradients clipped at norm 1, then the causal taps on past frames back to zero (AdamW moves
    nothing there, zero grads; kept as a guarantee that the decoder stays per-frame)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([t for g in opt.param_groups for t in g["params"]], 1.0)
    opt.step()
    with torch.no_grad():
        zero_past_taps(vae)


def motion_loss(offset_cells: torch.Tensor, shift_px: torch.Tensor, head: torch.Tensor, cell: int) -> torch.Tensor:
    """Where a decoder's warp read the reference (``offset_cells`` ``(B, 2, h, w)``, cells of ``cell``
    pixels) against where the frame's head came from in it (``shift_px``, the generator's:
    ``FrameSampler.draw(motion_cell=cell)``): the mean distance in cells over the cells the head covers
    whole (``head``); zero when it covers none."""
    dist = (offset_cells - shift_px / cell).pow(2).sum(dim=1, keepdim=True).add(1e-6).sqrt()
    return (dist * head).sum() / head.sum().clamp(min=1.0)


def decoder_step(vae: CausalVAE, opt: torch.optim.Optimizer, z: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor | None, *, reference: DecoderReference | None = None,
                 motion: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """One step of the decoder alone (``opt`` over its parameters): decode latents ``z`` to frames ``x``
    (:func:`recon_loss`, per-pixel ``weight``; ``reference``: ``vae.reference_features`` of each row's
    reference, for a decoder that reads it), then :func:`vae_step`. ``motion``: (shift, head, weight) of
    one-frame rows, a decoder whose warp copies the reference also pays ``weight`` x :func:`motion_loss`
    on where it read. Returns the loss and its parts."""
    offsets: list[torch.Tensor] | None = [] if motion is not None else None
    y, _ = vae.decode(z, clamp=False, reference=reference, offsets=offsets)
    loss, parts = recon_loss(y, x, weight)
    if motion is not None:
        if not offsets:
            raise ValueError("decoder_step: a motion loss needs a decoder whose warp copies the reference "
                             "(VAEConfig.ref_warp=True): pass motion=None for this one")
        shift, head, w = motion
        m = motion_loss(offsets[0][:, 0], shift, head, vae.cfg.factor // 2)
        loss = loss + w * m
        parts["motion"] = m.item()
    vae_step(vae, opt, loss)
    return loss, parts


DECODER_LR = 1.5e-3  # the decoder-only stages' peak learning rate (cosine, no warm-up)
DECODER_SR_NOISE = 0.1  # the chain stage's noise on the SR's input: std uniform in [0, this)


def train_decoder(preset: ModelPreset, vae: CausalVAE, state_path: Path, *, minutes: float, seed: int = 0,
                  batch: int = 2, lr: float = DECODER_LR, log_every: int = 10, save_every_s: float = 120.0,
                  eval_frames: int = 16, threads: int | None = None, sr: nn.Module | None = None,
                  sr_noise: float = DECODER_SR_NOISE, detail_weight: float = 0.0,
                  init_from: str = "", motion_weight: float = 0.0) -> dict[str, float]:
    """Fine-tune only the decoder of the final (frozen-encoder) VAE on full frames.

    With ``sr`` (a trained, frozen SR model) the decoder learns to decode what the pipeline actually
    feeds it: ``sr(to_lowres(encode(x)) + noise, encode(reference))``, never the encoder's latents
    (the pipeline decodes only SR outputs), so it can undo some of the SR's blur.

    The latents the A2V and SR models are trained on depend only on the encoder, so this runs while
    they train. Full frames (not crops) so the decoder's group norms see inference statistics.
    ``vae`` is updated in place; its weights are also in ``state_path`` (resumable).
    ``detail_weight``: as in :func:`train_vae`. ``init_from``: where ``vae``'s decoder came from, recorded
    in a fresh run's state (as :func:`~models.training.common.warm_start` records a warm start).
    ``motion_weight``: for a decoder whose warp copies the reference, the weight of :func:`motion_loss`
    (where the warp reads, against the head's true motion from the generator; 0: off).
    """
    if motion_weight > 0.0 and vae.decoder.ref_gate is None:
        raise ValueError(f"motion_weight={motion_weight}: this decoder does not warp the reference "
                         "(VAEConfig.ref_warp=False), so there is nothing to teach where to read: pass 0")
    if threads:
        torch.set_num_threads(threads)
    vae.encoder.requires_grad_(False)
    vae.decoder.requires_grad_(True)
    opt = torch.optim.AdamW(vae.decoder.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    fresh = not state_path.is_file()
    st = load_state(state_path, {"vae": vae}, opt)
    if fresh:
        st.init_from = init_from
    sampler = FrameSampler("train", preset.height)
    losses = LossLog(state_path.with_suffix(".jsonl"), "vae_decoder")
    frames, frame_refs = heldout_frames_with_reference(eval_frames, preset.height) if eval_frames else (None, None)
    reads = vae.decoder.ref_window is not None  # the decoder reads each frame's identity's reference
    eval_refs = frame_refs if reads else None
    if frames is not None and "start_psnr_db" not in st.extra:
        st.extra["start_psnr_db"] = heldout_psnr(vae.eval(), frames, sr, references=eval_refs)
    cell = vae.cfg.factor // 2 if motion_weight > 0.0 else None  # the warp's cells, in pixels (motion loss)
    budget = Budget(minutes, st.elapsed_s)  # training time: starts after the start-of-run scoring
    last_save = budget.elapsed_s
    vae.decoder.train()
    while not budget.done():
        gen = step_generator(seed, st.step, 3)
        x, refs, detail, shift, head = sampler.draw(gen, batch, None, DETAIL_REGIONS if detail_weight > 0 else None,
                                                    motion_cell=cell)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(lr, budget.fraction, warmup=0.0)
        with torch.no_grad():
            mean, logvar = vae.encode_moments(x)
            ref_z = vae.encode(refs) if sr is not None or reads else None
            if sr is None:
                z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=gen)
            else:
                lr_z = vae.to_lowres(mean)
                sig = torch.rand(lr_z.shape[0], 1, 1, 1, 1, generator=gen) * sr_noise
                z = sr(lr_z + sig * torch.randn(lr_z.shape, generator=gen), ref_z[:, :, 0])  # type: ignore[index]
        # a decoder that reads the reference reads the identity's (its features: through the decoder, trained)
        ref = vae.reference_features(refs[:, :, 0], ref_z) if reads else None
        motion = (shift, head, motion_weight) if shift is not None and head is not None else None
        loss, parts = decoder_step(vae, opt, z, x, pixel_weight(detail, detail_weight), reference=ref, motion=motion)
        st.step += 1
        losses.add(loss=loss.item(), **parts)
        if st.step % log_every == 0:
            st.losses.append(losses.flush(st.step, budget.elapsed_s)["loss"])
        if budget.elapsed_s - last_save > save_every_s:
            st.elapsed_s = budget.elapsed_s
            save_state(state_path, {"vae": vae}, opt, st)
            last_save = budget.elapsed_s
    vae.eval()
    st.elapsed_s = budget.elapsed_s
    st.extra["detail_weight"] = detail_weight
    st.extra["lr"] = lr
    st.extra["motion_weight"] = motion_weight
    if sr is not None:
        st.extra["sr_noise"] = sr_noise
    if frames is not None:
        st.extra["heldout_psnr_db"] = heldout_psnr(vae, frames, sr, references=eval_refs)
        log.info("vae decoder: held-out PSNR %.2f -> %.2f dB after %d steps", st.extra["start_psnr_db"],
                 st.extra["heldout_psnr_db"], st.step)
    save_state(state_path, {"vae": vae}, opt, st)
    return {"steps": st.step, "elapsed_s": st.elapsed_s, **st.extra}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--minutes", type=float, default=18.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--crop", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--detail-weight", type=float, default=0.0,
                   help="extra loss weight on the face's small features (issue 15; 0: plain means)")
    p.add_argument("--kl-weight", type=float, default=1e-5,
                   help="weight of the latent's KL term (1e-3 against 1e-5 for 10 min: PSNR +0.3 dB but latents "
                        "rougher, bench.latent_stats; docs/quality.md)")
    p.add_argument("--scale-equivariance", type=float, default=0.0,
                   help="weight of the loss of decoding a 2x/4x pooled latent into the pooled frame (0: off; "
                        "smooths the latent the A2V predicts, bench.latent_stats; docs/quality.md)")
    a = p.parse_args(argv)
    setup_logging(a.cache_dir / "train.log")
    out = train_vae(get_preset(a.preset), a.cache_dir / "vae_state.pt", minutes=a.minutes, seed=a.seed,
                    batch=a.batch, crop=a.crop, lr=a.lr, threads=a.threads,
                    detail_weight=a.detail_weight, kl_weight=a.kl_weight,
                    scale_equivariance=a.scale_equivariance)
    log.info("vae done: %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
