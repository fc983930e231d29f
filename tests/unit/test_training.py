"""Smoke tests of the trainers on a 64x64 variant of the tiny preset: a few real steps of each, the
loss goes down, resume continues from the saved step, the latent rescale is exact, the checkpoint
loads strictly through models.checkpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from models.avatars.speech import SpeechSynth
from models.checkpoint import CheckpointError, build_modules, load_checkpoint
from models.presets import ModelPreset, get_preset
from models.training.common import load_state, step_generator
from models.training.data import (
    DETAIL_REGIONS,
    FrameSampler,
    LatentClips,
    build_latent_cache,
    heldout_frames_with_reference,
)
from models.training.train_a2v import A2VBatcher, lowres, train_a2v
from models.training.train_all import assemble_checkpoint, chain_decoder, final_vae, save_final_vae
from models.training.train_sr import blur_features, feature_crops, pixel_loss, sr_batch, sr_weights, train_sr
from models.training.train_vae import (
    SCALE_FACTORS,
    decoder_step,
    finalize_vae,
    heldout_psnr,
    motion_loss,
    pixel_weight,
    plain_decoder,
    recon_loss,
    train_decoder,
    train_vae,
    vae_from_state,
    vae_loss,
    zero_past_taps,
)
from models.vae import CausalVAE, pool_frames


def _sha12(path: Path) -> str:
    """The first 12 hex digits of a file's SHA-256, as checkpoint_label writes them."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def small_preset() -> ModelPreset:
    """The tiny preset at 64 px, its decoder plain (a decoder that reads the reference: its own test)."""
    tiny = get_preset("tiny")
    return dataclasses.replace(tiny, height=64, width=64,
                               vae=dataclasses.replace(tiny.vae, ref_window_radius=0, ref_warp=False))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_vae_overfits_a_fixed_batch_and_rescale_is_exact() -> None:
    p = small_preset()
    torch.manual_seed(0)
    vae = CausalVAE(p.vae)
    zero_past_taps(vae)
    x = FrameSampler("train", 64).batch(step_generator(0, 0), 4)
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3)
    first = last = 0.0
    for i in range(25):
        loss, parts = vae_loss(vae, x, step_generator(0, i), 1e-5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first, last = (parts["loss"], last) if i == 0 else (first, parts["loss"])
    assert last < 0.7 * first
    vae.eval()
    clip = torch.rand(1, 3, 3, 64, 64) * 2 - 1  # 3 frames: the causal convs see real past frames
    with torch.no_grad():
        before, _ = vae.decode(vae.encode(clip))
        scales = finalize_vae(vae, p, count=8)
        z = vae.encode(FrameSampler("train", 64).batch(torch.Generator().manual_seed(777), 8))
        after, _ = vae.decode(vae.encode(clip))
    assert torch.allclose(before, after, atol=1e-4)
    assert not torch.allclose(scales, torch.ones_like(scales))
    assert torch.allclose(z.transpose(0, 1).reshape(8, -1).std(dim=1), torch.ones(8), atol=1e-3)


def test_vae_trainer_resumes(tmp_path: Path) -> None:
    p = small_preset()
    state = tmp_path / "vae_state.pt"
    out1 = train_vae(p, state, minutes=0.02, batch=2, crop=32, eval_frames=2, log_every=1)
    out2 = train_vae(p, state, minutes=0.04, batch=2, crop=32, eval_frames=2, log_every=1)
    assert out2["steps"] > out1["steps"] >= 1
    assert 0 < out2["heldout_psnr_db"] < 60


def test_detail_map_marks_the_face_features_of_the_same_frames() -> None:
    """draw with regions gives the frames batch draws for the same generator, and its map covers
    exactly those regions of the generator's masks: on the face, never in the background."""
    sampler = FrameSampler("train", 64)
    x = sampler.batch(step_generator(0, 3), 6)
    x2, _, detail, *_ = sampler.draw(step_generator(0, 3), 6, regions=DETAIL_REGIONS)
    assert detail is not None and torch.equal(x, x2) and detail.shape == (6, 1, 1, 64, 64)
    assert float(detail.min()) >= 0.0 and float(detail.max()) <= 1.0
    assert all(float(d.sum()) > 10 for d in detail)  # every frame shows some features
    assert float(detail[..., :4, :].sum()) == 0.0  # the top rows are background or hair
    # the map is the masks of exactly those regions: a region outside the set adds nothing
    x3, _, brows, *_ = sampler.draw(step_generator(0, 3), 6, regions=("brows",))
    assert brows is not None and torch.equal(x3, x) and 0 < float(brows.sum()) < float(detail.sum())
    assert sampler.draw(step_generator(0, 3), 6).detail is None
    crops = FrameSampler("train", 64).draw(step_generator(0, 3), 6, crop=32, regions=DETAIL_REGIONS).detail
    assert crops is not None and crops.shape == (6, 1, 1, 32, 32)
    assert "glasses" in DETAIL_REGIONS and "skin" not in DETAIL_REGIONS


def test_detail_weighted_losses_weight_the_features() -> None:
    """Weight 1 everywhere is the plain loss; with a detail weight an error on the features costs
    more than the same error on the background."""
    x = torch.zeros(1, 3, 1, 16, 16)
    detail = torch.zeros(1, 1, 1, 16, 16)
    detail[..., 4:8, 4:8] = 1.0
    on_face, on_background = x.clone(), x.clone()
    on_face[..., 5, 5] = 1.0
    on_background[..., 12, 12] = 1.0
    plain = recon_loss(on_face, x)[0]
    assert torch.allclose(recon_loss(on_face, x, torch.ones_like(detail))[0], plain)
    assert torch.allclose(recon_loss(on_background, x)[0], plain)
    w = pixel_weight(detail, 8.0)
    assert pixel_weight(detail, 0.0) is None and pixel_weight(None, 8.0) is None
    assert float(recon_loss(on_face, x, w)[0]) > 4 * float(recon_loss(on_background, x, w)[0])


def _first_logged_loss(state: Path) -> float:
    """Step 1's loss of a trainer run with ``log_every=1``: computed before any update, so a pure
    function of the seed, the batch, the init and the loss."""
    first = json.loads(state.with_suffix(".jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    return float(first["loss"])


def test_vae_trainer_applies_and_records_the_detail_weight(tmp_path: Path) -> None:
    """The same seed draws the same first batch on the same init: only the weight can make the first
    step's losses differ, so they differ exactly when the trainer hands the weight to the loss."""
    runs = {w: train_vae(small_preset(), tmp_path / f"vae_{w:g}.pt", minutes=0.02, batch=2, crop=32, eval_frames=2,
                         log_every=1, detail_weight=w) for w in (0.0, 8.0)}
    assert runs[8.0]["steps"] >= 1 and runs[8.0]["detail_weight"] == 8.0 and runs[0.0]["detail_weight"] == 0.0
    plain, weighted = (_first_logged_loss(tmp_path / f"vae_{w:g}.pt") for w in (0.0, 8.0))
    assert plain != pytest.approx(weighted, rel=1e-3)


def test_scale_equivariance_adds_the_pooled_frames_reconstruction() -> None:
    """With a weight, the loss is the plain loss (same draws) plus weight x the reconstruction loss of
    the pooled frame from the decoded pooled latent; an indivisible latent is refused."""
    torch.manual_seed(0)
    vae = CausalVAE(small_preset().vae)
    x, _, detail, *_ = FrameSampler("train", 64).draw(step_generator(0, 5), 2, regions=DETAIL_REGIONS)
    w = pixel_weight(detail, 4.0)
    plain, pp = vae_loss(vae, x, step_generator(0, 1), 1e-5, w)
    total, sp = vae_loss(vae, x, step_generator(0, 1), 1e-5, w, scale_equivariance=0.5)
    assert "se" not in pp and sp["se"] > 0
    assert total.item() == pytest.approx(plain.item() + 0.5 * sp["se"], rel=1e-5)
    gen = step_generator(0, 1)  # the draws vae_loss made: the latent's noise, then the factor
    mean, logvar = vae.encode_moments(x)
    z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=gen)
    f = SCALE_FACTORS[int(torch.randint(len(SCALE_FACTORS), (1,), generator=gen))]
    y_down, _ = vae.decode(vae.to_lowres(z, f), clamp=False)
    assert y_down.shape[-1] == 64 // f
    assert recon_loss(y_down, pool_frames(x, f), pool_frames(w, f))[0].item() == pytest.approx(sp["se"], rel=1e-5)
    with pytest.raises(ValueError, match="latent size 3x3 not divisible"):
        vae_loss(vae, x[..., :24, :24], step_generator(0, 1), 1e-5, scale_equivariance=0.5)


def test_vae_trainer_applies_and_records_the_scale_equivariance(tmp_path: Path) -> None:
    runs = {w: train_vae(small_preset(), tmp_path / f"se_{w:g}.pt", minutes=0.02, batch=2, crop=32, eval_frames=2,
                         log_every=1, scale_equivariance=w) for w in (0.0, 1.0)}
    assert runs[1.0]["scale_equivariance"] == 1.0 and runs[0.0]["scale_equivariance"] == 0.0
    plain, regularised = (_first_logged_loss(tmp_path / f"se_{w:g}.pt") for w in (0.0, 1.0))
    assert regularised > plain
    # a crop whose latent 2 divides but 4 does not (48 px: 6 cells) is refused before the first step
    with pytest.raises(ValueError, match=r"crop 48 is not a multiple of 32 .*use a crop such as 32"):
        train_vae(small_preset(), tmp_path / "se_48.pt", minutes=0.02, batch=2, crop=48, scale_equivariance=1.0)
    assert not (tmp_path / "se_48.pt").exists()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("train")
    p = small_preset()
    torch.manual_seed(0)
    vae = CausalVAE(p.vae).eval()
    save_final_vae(d / "vae_final.pt", vae.state_dict(), None)
    paths = build_latent_cache(vae, d / "latents", num_clips=3, clip_frames=1 + p.chunk_frames + p.context_frames,
                               shard_clips=2, size=64, synth=SpeechSynth(use_espeak=False))
    assert [q.name for q in paths] == ["shard_0000.pt", "shard_0001.pt"]
    return d


def test_latent_cache_layout_and_windows(cache: Path) -> None:
    p = small_preset()
    clips = LatentClips(cache / "latents")
    assert clips.hr.shape == (3, 21, 8, 8, 8) and clips.ref.shape == (3, 8, 8, 8)
    assert clips.audio.shape == (3, (21 + 4) * 640)
    # the face's features per latent cell: a fraction, on the face only (the corner cells are background)
    assert clips.detail is not None and clips.detail.shape == (3, 21, 8, 8)
    assert 0.0 < float(clips.detail.max()) <= 1.0 and float(clips.detail[..., 0, 0].max()) == 0.0
    # each cell's share of the features: every feature in view sums to 1 over the frame's cells, on the
    # cells the coverage marks and nowhere else
    share = clips.detail_share
    assert share is not None and share.shape == clips.detail.shape
    per_frame = share.sum(dim=(-2, -1))
    assert torch.allclose(per_frame, per_frame.round(), atol=0.02) and float(per_frame.round().min()) >= 5
    assert bool(((share > 0) == (clips.detail > 0)).all())
    # the same two maps of each clip's reference frame
    assert clips.ref_detail is not None and clips.ref_share is not None and clips.ref_share.shape == (3, 8, 8)
    assert bool(((clips.ref_share > 0) == (clips.ref_detail > 0)).all())
    ref_features = clips.ref_share.sum(dim=(-2, -1))
    assert torch.allclose(ref_features, ref_features.round(), atol=0.02) and float(ref_features.round().min()) >= 4  # brows, nose, eyes, lips: the mouth is shut
    assert clips.mouth_box is not None and clips.mouth_box.shape == (3, 21, 4)
    assert p.reference_frame and p.lowres_factor == 2
    b = A2VBatcher(clips, p)
    # each frame's mouth box as a coverage of the 16-px low-res cells: on the face, all of the box
    mc = b.batch(step_generator(1, 0), "N", 2)["mouth_cover"]
    assert mc.shape == (2, 21, 4, 4) and float(mc.min()) >= 0.0 and float(mc.max()) <= 1.0
    assert float(mc[..., 0, 0].max()) == 0.0 and bool((mc.sum(dim=(-2, -1)) > 0).all())
    # N: the reference slot + C context frames known; R: N_0 with the reference slot
    for kind, (t, known) in {"N": (21, 5), "N0": (16, 0), "I": (6, 2), "R": (17, 1)}.items():
        batch = b.batch(step_generator(1, 0), kind, 2)
        assert batch["x0"].shape == (2, 8, t, 4, 4)
        assert batch["wave"].shape == (2, (t + 4) * 640)
        assert int(batch["known"][0].sum()) == known
        if kind in ("N", "R"):  # known frames lead the window
            assert bool(batch["known"][0, :known].all())
    assert {b.draw_kind(step_generator(0, i)) for i in range(200)} == {"N", "I", "R"}  # what the plan runs
    i = b.batch(step_generator(1, 0), "I", 1)["known"][0]
    assert bool(i[0]) and bool(i[-1]) and not bool(i[1:-1].any())
    for kind in ("R", "N"):  # the reference's low-res latent is the first known frame, never corrupted
        r = b.batch(step_generator(1, 0), kind, 1)
        ident = int((clips.ref == r["ref"][0]).flatten(1).all(dim=1).nonzero()[0])
        assert torch.equal(r["x0"][0, :, 0], b.ref_lr[ident]) and torch.equal(r["ctx"][0, :, 0], b.ref_lr[ident])
        assert not torch.equal(r["ctx"][0, :, 1:], r["x0"][0, :, 1:])  # the context is corrupted


def test_change_weights_favour_what_moves() -> None:
    from models.training.train_a2v import change_weights

    ref = torch.zeros(1, 8, 4, 4)
    x = torch.zeros(1, 8, 2, 4, 4)
    x[:, :, :, 1, 2] = 1.0  # one cell (the "mouth") differs from the reference in both frames
    w = change_weights(x, ref)
    assert w.shape == (1, 2, 4, 4)
    assert float(w[0, 0, 1, 2]) == pytest.approx(10.0)  # capped
    assert float(w[0, 0, 0, 0]) == pytest.approx(1.0)
    still = change_weights(torch.zeros(1, 8, 2, 4, 4), ref)
    assert torch.allclose(still, torch.ones_like(still))  # nothing moves: the plain loss


def test_box_cover_is_the_boxs_share_of_each_cell() -> None:
    from models.training.train_a2v import box_cover

    c = box_cover(torch.tensor([[[8, 0, 24, 16], [0, 0, 64, 64]]]), 4, 4, 16.0)  # (1, 2, 4, 4)
    assert c[0, 0, 0].tolist() == [0.5, 0.5, 0.0, 0.0] and float(c[0, 0, 1:].abs().sum()) == 0.0
    assert bool((c[0, 1] == 1.0).all())
    box = torch.tensor([[[100, 150, 140, 170]]])  # 40 x 20 px over 16-px cells: the box's area in cells
    assert float(box_cover(box, 16, 16, 16.0).sum()) * 256 == pytest.approx(800.0)


def test_blur_features_washes_out_the_features_but_not_the_mouth() -> None:
    torch.manual_seed(0)
    lr = torch.randn(2, 8, 4, 4)  # low-res cells of 16 px over 32-px hr latent maps of 8-px cells
    detail = torch.zeros(2, 8, 8)
    detail[:, 0:2, 0:2] = 0.25  # low-res cell (0, 0) a quarter covered by a feature: fully washed at strength 1
    detail[:, 6:8, 6:8] = 0.5  # cell (3, 3): a feature inside the mouth box below, left alone
    mouth = torch.tensor([[48.0, 48.0, 64.0, 64.0]] * 2)
    out = blur_features(lr, detail, mouth, torch.tensor([1.0, 0.0]), cell_px=16.0)
    smooth = torch.nn.functional.avg_pool2d(lr, 5, stride=1, padding=2, count_include_pad=False)
    torch.testing.assert_close(out[0, :, 0, 0], smooth[0, :, 0, 0])
    changed = (out - lr).abs().amax(dim=1)
    assert float(changed[0].flatten()[1:].max()) == 0.0  # every other cell, the mouth's included, as it was
    assert torch.equal(out[1], lr[1])  # strength 0


def test_feature_weight_counts_a_small_feature_as_much_as_a_large_one() -> None:
    """sr_weights: the change weight alone without feature weights; the detail weight scales cells by
    their coverage, so a feature's total weight grows with its size; the feature weight adds the same
    total to every feature, a one-cell earring as much as eight cells of glasses."""
    y = torch.zeros(1, 8, 1, 4, 4)
    ref = torch.zeros(1, 8, 4, 4)
    detail = torch.zeros(1, 1, 4, 4)
    share = torch.zeros(1, 1, 4, 4)
    detail[0, 0, 0, 0] = 0.5  # the earring: half of one cell
    share[0, 0, 0, 0] = 1.0
    detail[0, 0, 2:4, :] = 1.0  # the glasses: eight cells filled
    share[0, 0, 2:4, :] = 1 / 8
    plain = sr_weights(y, ref, detail, share, 0.0, 0.0)
    assert torch.allclose(plain, torch.ones_like(plain))  # nothing moves, no feature weight: the plain loss
    extra_d = sr_weights(y, ref, detail, share, 4.0, 0.0) - plain
    assert float(extra_d[0, 0, 0, 0]) == pytest.approx(2.0) and float(extra_d[0, 0, 2:].sum()) == pytest.approx(32.0)
    extra_f = sr_weights(y, ref, detail, share, 0.0, 16.0) - plain
    assert float(extra_f[0, 0, 0, 0]) == pytest.approx(16.0) and float(extra_f[0, 0, 2:].sum()) == pytest.approx(16.0)
    assert float(extra_f[0, 0, 1].abs().sum()) == 0.0  # no feature, no weight


def test_pixel_loss_decodes_a_window_on_a_feature() -> None:
    """feature_crops centres the window on the frame's feature, kept inside the latent (uniform where a
    frame shows none); pixel_loss is zero for the target itself, counts an error on the feature more
    than the same error off it, sends gradients to the SR's output, and decodes the whole latent when
    it is smaller than the window."""
    p = small_preset()
    vae = CausalVAE(p.vae).eval().requires_grad_(False)
    H = W = 16
    share = torch.zeros(3, 1, H, W)
    share[0, 0, 7, 9] = 1.0  # a feature inside: centred
    share[1, 0, 15, 0] = 1.0  # in a corner: the window stays inside
    origin = feature_crops(share, torch.Generator().manual_seed(0), 8)
    assert origin[0].tolist() == [3, 5] and origin[1].tolist() == [8, 0]
    assert ((origin[2] >= 0) & (origin[2] <= 8)).all()  # no feature: anywhere inside
    y = torch.randn(3, p.latent_channels, 1, H, W)
    assert float(pixel_loss(vae, y, y, share, torch.Generator().manual_seed(0))) == 0.0
    on, off = y.clone(), y.clone()
    on[0, :, 0, 7, 9] += 1.0  # the error on the feature's cell
    off[0, :, 0, 4, 6] += 1.0  # the same error in the window, off the feature
    loss_on = pixel_loss(vae, on[:1], y[:1], share[:1], torch.Generator().manual_seed(0))
    loss_off = pixel_loss(vae, off[:1], y[:1], share[:1], torch.Generator().manual_seed(0))
    assert float(loss_on) > 2 * float(loss_off) > 0.0
    pred = y.clone().requires_grad_(True)
    pixel_loss(vae, pred + 0.1, y, share, torch.Generator().manual_seed(0)).backward()
    assert pred.grad is not None and float(pred.grad.abs().sum()) > 0.0
    small = y[..., :4, :4]  # a 4x4 latent, the window 8: the whole of it
    assert float(pixel_loss(vae, small + 0.1, small, share[..., :4, :4], torch.Generator().manual_seed(0))) > 0.0


def test_sr_pixel_weight_trains_through_the_caches_vae(cache: Path, tmp_path: Path) -> None:
    """--pixel-weight decodes through the VAE beside the latent cache (refused, naming the field and the
    fix, for latents without one); with it the SR trains and the weight is recorded for the assembled
    checkpoint (sr_pixel_weight)."""
    p = small_preset()
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "latents").symlink_to(cache / "latents", target_is_directory=True)
    with pytest.raises(ValueError, match=r"pixel_weight=1.0: needs the VAE the latents .* --pixel-weight 0"):
        train_sr(p, bare / "latents", tmp_path / "sr_state.pt", minutes=0.01, pixel_weight=1.0)
    out = train_sr(p, cache / "latents", tmp_path / "sr_state.pt", minutes=0.02, batch=4, detail_weight=1.0,
                   feature_weight=8.0, pixel_weight=1.0)
    assert out["steps"] >= 1 and out["pixel_weight"] == 1.0 and math.isfinite(out["eval_l1"])


def test_sr_batch_reference_share_is_the_reference_frame(cache: Path) -> None:
    """reference_share 1: every row is its clip's reference (target, low-res input, maps); 0: none is,
    and the batch is the one drawn without the option (same generator, same frames)."""
    p = small_preset()
    clips = LatentClips(cache / "latents")
    lr_all = lowres(clips.hr, p.lowres_factor)
    ref_lr = lowres(clips.ref[:, None], p.lowres_factor)[:, 0]
    lr, hr, ref, detail, share = sr_batch(clips, lr_all, step_generator(0, 1), 6, 0.0, reference_share=1.0,
                                          ref_lr=ref_lr)
    assert clips.ref_detail is not None and clips.ref_share is not None and detail is not None and share is not None
    for b in range(6):
        i = int((clips.ref == ref[b]).flatten(1).all(dim=1).nonzero()[0])
        assert torch.equal(hr[b, :, 0], clips.ref[i]) and torch.equal(lr[b, :, 0], ref_lr[i])
        assert torch.equal(detail[b, 0], clips.ref_detail[i]) and torch.equal(share[b, 0], clips.ref_share[i])
    plain = sr_batch(clips, lr_all, step_generator(0, 1), 6, 0.1)
    none = sr_batch(clips, lr_all, step_generator(0, 1), 6, 0.1, reference_share=1e-9, ref_lr=ref_lr)
    assert torch.equal(plain[1], none[1])  # the same frames; the option's draw only moves the noise


def test_a2v_and_sr_train_resume_and_assemble(cache: Path) -> None:
    p = small_preset()
    a1 = train_a2v(p, cache / "latents", cache / "a2v_state.pt", minutes=0.05, batch_n=2, batch_i=4, log_every=2)
    a2 = train_a2v(p, cache / "latents", cache / "a2v_state.pt", minutes=0.1, batch_n=2, batch_i=4, log_every=2)
    assert a2["steps"] > a1["steps"] >= 2
    # the mouth weight: step 1's loss differs from the plain run's (same seed, batch and init), and is recorded
    for w in (0.0, 6.0):
        train_a2v(p, cache / "latents", cache / f"a2v_mouth{w:g}_state.pt", minutes=0.02, batch_n=2, batch_i=4,
                  log_every=1, mouth_weight=w)
    assert _first_logged_loss(cache / "a2v_mouth0_state.pt") != pytest.approx(
        _first_logged_loss(cache / "a2v_mouth6_state.pt"), rel=1e-3)
    assert torch.load(cache / "a2v_mouth6_state.pt", weights_only=False)["state"]["extra"]["mouth_weight"] == 6.0
    s1 = train_sr(p, cache / "latents", cache / "sr_state.pt", minutes=0.05, batch=8, log_every=1)
    assert s1["eval_l1"] < s1["bilinear_l1"]  # SR beats its bilinear starting point after a few steps
    sd = train_sr(p, cache / "latents", cache / "sr_detail_state.pt", minutes=0.02, batch=8, log_every=1,
                  detail_weight=8.0, lr=5e-4)
    assert sd["steps"] >= 1 and sd["detail_weight"] == 8.0 and sd["lr"] == 5e-4
    # step 1's loss comes before any update (the learning rate follows wall time, later steps do not
    # repeat): same seed, batch and init as the plain run, so the weight alone can change it
    assert _first_logged_loss(cache / "sr_state.pt") != pytest.approx(_first_logged_loss(cache / "sr_detail_state.pt"),
                                                                        rel=1e-3)
    sf = train_sr(p, cache / "latents", cache / "sr_feature_state.pt", minutes=0.02, batch=8, log_every=1,
                  feature_weight=32.0)
    assert sf["feature_weight"] == 32.0 and sd["feature_weight"] == 0.0
    assert _first_logged_loss(cache / "sr_state.pt") != pytest.approx(
        _first_logged_loss(cache / "sr_feature_state.pt"), rel=1e-3)
    sr_ref = train_sr(p, cache / "latents", cache / "sr_ref_state.pt", minutes=0.02, batch=8, log_every=1,
                      reference_share=0.5)
    assert sr_ref["reference_share"] == 0.5 and sf["reference_share"] == 0.0
    assert _first_logged_loss(cache / "sr_state.pt") != pytest.approx(_first_logged_loss(cache / "sr_ref_state.pt"),
                                                                        rel=1e-3)
    old = cache / "old_latents"  # a cache written before the detail maps were kept
    old.mkdir()
    blob = torch.load(cache / "latents" / "shard_0000.pt")
    del blob["detail"], blob["mouth_box"], blob["detail_share"], blob["ref_detail"], blob["ref_share"]
    torch.save(blob, old / "shard_0000.pt")
    with pytest.raises(ValueError, match="no detail maps.*build it again"):
        train_sr(p, old, cache / "sr_old_state.pt", minutes=0.01, detail_weight=8.0)
    with pytest.raises(ValueError, match="feature_weight=32.0: .*no feature shares.*build it again"):
        train_sr(p, old, cache / "sr_old_state.pt", minutes=0.01, feature_weight=32.0)
    with pytest.raises(ValueError, match="reference_share=0.5: .*no reference feature maps.*build it again"):
        train_sr(p, old, cache / "sr_old_state.pt", minutes=0.01, reference_share=0.5)
    with pytest.raises(ValueError, match="feature_blur=0.5.*no detail maps or mouth boxes.*build it again"):
        train_sr(p, old, cache / "sr_old_state.pt", minutes=0.01, feature_blur=0.5)
    sb = train_sr(p, cache / "latents", cache / "sr_blur_state.pt", minutes=0.02, batch=8, log_every=1,
                  feature_blur=1.0)
    assert sb["feature_blur"] == 1.0  # same seed, batch and init as the plain run: only the input differs
    assert _first_logged_loss(cache / "sr_state.pt") != pytest.approx(_first_logged_loss(cache / "sr_blur_state.pt"),
                                                                        rel=1e-3)
    with pytest.raises(ValueError, match="mouth_weight=6.0.*no mouth boxes.*--stage cache"):
        train_a2v(p, old, cache / "a2v_old_state.pt", minutes=0.01, mouth_weight=6.0)
    # the VAE state the checkpoint reads (normally written by train_vae)
    mods = {"vae": CausalVAE(p.vae)}
    mods["vae"].load_state_dict(torch.load(cache / "vae_final.pt")["vae"])
    from models.training.common import TrainState, save_state
    save_state(cache / "vae_state.pt", mods, torch.optim.SGD(mods["vae"].parameters(), lr=0.1), TrainState(step=1))
    final_vae(p, cache)
    out = cache / "ckpt.safetensors"
    meta = assemble_checkpoint(p, cache, out, seed=0)
    fresh = build_modules(p, seed=5)
    loaded = load_checkpoint(fresh, out)  # strict: every prefix present and complete
    assert loaded["a2v_steps"] == meta["a2v_steps"] == str(a2["steps"])
    blob = torch.load(cache / "a2v_state.pt", weights_only=False)
    assert torch.equal(fresh["a2v"].state_dict()["head.weight"], blob["modules"]["ema_a2v"]["head.weight"])
    assert load_state(cache / "sr_state.pt", {"sr": build_modules(p)["sr"]}).step == s1["steps"]
    # last stage: the decoder on SR outputs; the checkpoint then takes its VAE from there
    c = chain_decoder(p, cache, minutes=0.03, seed=0)
    assert c["steps"] >= 1 and 0 < c["heldout_psnr_db"] < 60
    meta = assemble_checkpoint(p, cache, out, seed=0)
    assert meta["vae_chain_steps"] == str(c["steps"]) and meta["sr_detail_weight"] == "0" and meta["sr_lr"] == "0.001"
    assert meta["sr_feature_weight"] == "0" and meta["sr_reference_share"] == "0" and meta["sr_pixel_weight"] == "0"
    assert meta["a2v_mouth_weight"] == "0"
    assert meta["a2v_lr"] == "0.001"  # what the A2V state recorded (no default is written)
    assert meta["sr_batch"] == "8" and meta["a2v_batch_n"] == "2" and meta["a2v_batch_i"] == "4"
    chained = torch.load(cache / "vae_chain_state.pt", weights_only=False)["modules"]["vae"]
    fresh = build_modules(p, seed=5)
    load_checkpoint(fresh, out)
    assert all(torch.equal(v, chained[k]) for k, v in fresh["vae"].state_dict().items())


def test_export_vae_is_what_reuse_vae_reads_elsewhere(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """export-vae writes the cache's trained, rescaled VAE alone with its figures; reuse-vae in another
    cache dir gets exactly those weights (so the same latents) and carries the figures."""
    from models.training.train_all import export_vae, main, reuse_vae

    p = small_preset()
    run = tmp_path / "run"
    trained = train_vae(p, run / "vae_state.pt", minutes=0.02, batch=2, crop=32, eval_frames=2, log_every=1,
                        scale_equivariance=0.25)
    meta = export_vae(p, run, tmp_path / "vae.safetensors", seed=0)
    assert meta["vae_steps"] == str(trained["steps"]) and meta["vae_scale_equivariance"] == "0.25"
    assert meta["preset"] == "tiny"
    reuse_vae(p, tmp_path / "elsewhere", tmp_path / "vae.safetensors")
    got = torch.load(tmp_path / "elsewhere" / "vae_final.pt")["vae"]
    want = final_vae(p, run).state_dict()  # rescaled: the latents the exporting machine's cache holds
    assert set(got) == set(want) and all(torch.equal(v, got[k]) for k, v in want.items())
    carried = json.loads((tmp_path / "elsewhere" / "vae_reused.json").read_text())
    assert carried["vae_scale_equivariance"] == "0.25" and carried["vae_steps"] == meta["vae_steps"]
    with pytest.raises(FileNotFoundError, match="vae_state.pt does not exist: export-vae writes a VAE trained"):
        export_vae(p, tmp_path / "elsewhere", tmp_path / "again.safetensors", seed=0)
    (tmp_path / "elsewhere" / "vae_state.pt").write_bytes((run / "vae_state.pt").read_bytes())  # trained there later
    with pytest.raises(ValueError, match="a VAE reused from a checkpoint .*not the one trained here"):
        export_vae(p, tmp_path / "elsewhere", tmp_path / "again.safetensors", seed=0)
    assert not (tmp_path / "again.safetensors").exists()
    with pytest.raises(SystemExit):  # never the shipped checkpoint's default path
        main(["--stage", "export-vae", "--cache-dir", str(run)])
    assert "--stage export-vae needs --out FILE" in capsys.readouterr().err


def test_final_vae_of_an_older_vae_state_is_refused(tmp_path: Path) -> None:
    """vae_final.pt records the vae_state.pt step it was rescaled from: once the VAE trains on, the
    final file (and the latents cached with it) is refused with the fix, by the stages and by
    export-vae, instead of being read as this VAE; a final rescaled again records the new step."""
    from models.training.train_all import export_vae

    p = small_preset()
    run = tmp_path / "run"
    train_vae(p, run / "vae_state.pt", minutes=0.01, batch=2, crop=32, eval_frames=2, log_every=1)
    first = final_vae(p, run).state_dict()
    blob = torch.load(run / "vae_state.pt", weights_only=False)
    step = blob["state"]["step"]
    assert torch.load(run / "vae_final.pt")["from_state_step"] == step
    assert all(torch.equal(v, first[k]) for k, v in final_vae(p, run).state_dict().items())  # read back
    blob["state"]["step"] = step + 5  # the VAE trained on in this cache dir
    with torch.no_grad():
        next(iter(blob["modules"]["vae"].values())).add_(1.0)
    torch.save(blob, run / "vae_state.pt")
    stale = f"rescaled from step {step} of .*now at step {step + 5}.*Delete vae_final.pt, latents/ and heldout_latents/"
    with pytest.raises(RuntimeError, match=stale):
        final_vae(p, run)
    with pytest.raises(RuntimeError, match=stale):
        export_vae(p, run, tmp_path / "vae.safetensors", seed=0)
    assert not (tmp_path / "vae.safetensors").exists()
    (run / "vae_final.pt").unlink()
    again = final_vae(p, run).state_dict()
    assert torch.load(run / "vae_final.pt")["from_state_step"] == step + 5
    assert not all(torch.equal(v, first[k]) for k, v in again.items())
    torch.save(again, run / "vae_final.pt")  # the bare state dict earlier versions wrote
    with pytest.raises(ValueError, match="bare state dict.*delete it and .*latents"):
        final_vae(p, run)


def test_reuse_vae_takes_weights_and_metadata_of_an_earlier_checkpoint(tmp_path: Path) -> None:
    from models.checkpoint import save_checkpoint
    from models.training.train_all import reuse_vae

    p = small_preset()
    mods = build_modules(p, seed=3)
    save_checkpoint(mods, tmp_path / "old.safetensors",
                    metadata={"preset": "tiny", "git_commit": "abc", "vae_steps": "7", "vae_chain_steps": "2"})
    reuse_vae(p, tmp_path / "cache", tmp_path / "old.safetensors")
    got = torch.load(tmp_path / "cache" / "vae_final.pt")["vae"]
    assert all(torch.equal(v, got[k]) for k, v in mods["vae"].state_dict().items())
    import json
    carried = json.loads((tmp_path / "cache" / "vae_reused.json").read_text())
    assert carried["vae_steps"] == "7" and carried["vae_chain_steps"] == "2"  # the decoder reused is that one
    assert carried["vae_reused_from"] == f"old.safetensors (git abc, sha256 {_sha12(tmp_path / 'old.safetensors')})"
    save_checkpoint(mods, tmp_path / "other.safetensors", metadata={"preset": "14b"})
    with pytest.raises(CheckpointError, match="preset '14b', not 'tiny'"):
        reuse_vae(p, tmp_path / "cache2", tmp_path / "other.safetensors")


def test_decoder_fine_tune_on_a_shipped_checkpoint_keeps_its_other_modules(tmp_path: Path) -> None:
    """reuse-vae + chain --from + assemble --from: the decoder of a checkpoint fine-tuned on that
    checkpoint's SR; the new checkpoint holds the new decoder and every other module of the base,
    unchanged (the encoder too, so its A2V and SR stay valid), with the base's metadata for them."""
    from models.checkpoint import save_checkpoint
    from models.training.train_all import reuse_vae

    p = small_preset()
    base_mods = build_modules(p, seed=3)
    base = tmp_path / "base.safetensors"
    save_checkpoint(base_mods, base, metadata={"preset": "tiny", "git_commit": "abc", "vae_steps": "7",
                                               "a2v_steps": "11", "sr_steps": "5", "sr_eval_l1": "0.1",
                                               "vae_decoder_steps": "4", "vae_chain_steps": "2"})
    cache = tmp_path / "cache"
    reuse_vae(p, cache, base)
    with pytest.raises(FileNotFoundError, match="--from"):
        chain_decoder(p, cache, minutes=0.01, seed=0)
    c = chain_decoder(p, cache, minutes=0.02, seed=0, detail_weight=8.0, base=base, lr=1e-4, sr_noise=0.25)
    assert c["steps"] >= 1 and c["detail_weight"] == 8.0 and c["lr"] == 1e-4 and c["sr_noise"] == 0.25
    with pytest.raises(FileNotFoundError, match="a2v_state.pt"):
        assemble_checkpoint(p, cache, tmp_path / "x.safetensors", seed=0)
    meta = assemble_checkpoint(p, cache, tmp_path / "new.safetensors", seed=0, base=base)
    assert meta["a2v_steps"] == "11" and meta["sr_steps"] == "5" and meta["vae_chain_detail_weight"] == "8"
    assert meta["base_checkpoint"] == f"base.safetensors (git abc, sha256 {_sha12(base)})"
    # the base's decoder figures went with its decoder; the VAE's own stay (its encoder is kept)
    assert "vae_decoder_steps" not in meta and meta["vae_chain_steps"] == str(c["steps"]) and meta["vae_steps"] == "7"
    # the chain decoder was trained on from the base's: the metadata says so, with what it had had
    assert meta["vae_chain_init_from"] == (f"base.safetensors (git abc, sha256 {_sha12(base)}): its chain decoder, "
                                           "2 steps, ? min, held-out PSNR ? dB")
    assert meta["vae_chain_lr"] == "0.0001" and meta["vae_chain_sr_noise"] == "0.25"
    assert meta["vae_chain_motion_weight"] == "0"  # a plain decoder: no warp to teach
    # after a decoder stage of its own, the chain starts from that, not from the base's chain decoder
    cache2 = tmp_path / "cache2"
    reuse_vae(p, cache2, base)
    train_decoder(p, final_vae(p, cache2), cache2 / "vae_decoder_state.pt", minutes=0.01, seed=0, lr=2e-4)
    chain_decoder(p, cache2, minutes=0.01, seed=0, base=base)
    meta2 = assemble_checkpoint(p, cache2, tmp_path / "new2.safetensors", seed=0, base=base)
    assert "vae_chain_init_from" not in meta2 and meta2["vae_decoder_lr"] == "0.0002"
    assert meta2["vae_chain_lr"] == "0.0015" and "vae_decoder_sr_noise" not in meta2
    fresh = build_modules(p, seed=5)
    load_checkpoint(fresh, tmp_path / "new.safetensors")
    for name in ("a2v", "audio", "sr", "text"):
        assert all(torch.equal(v, base_mods[name].state_dict()[k]) for k, v in fresh[name].state_dict().items())
    new_vae, old_vae = fresh["vae"].state_dict(), base_mods["vae"].state_dict()
    assert all(torch.equal(new_vae[k], v) for k, v in old_vae.items() if k.startswith("encoder."))
    assert any(not torch.equal(new_vae[k], v) for k, v in old_vae.items() if k.startswith("decoder."))


def _first_matrix(sd: dict[str, torch.Tensor]) -> torch.Tensor:
    return next(v for v in sd.values() if v.dim() == 2)


def _same_weights(sd: dict[str, torch.Tensor], module: torch.nn.Module) -> bool:
    want = module.state_dict()
    return sd.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in sd.items())


def test_a2v_and_sr_warm_start_from_a_shipped_checkpoint(cache: Path, tmp_path: Path) -> None:
    """--from: a fresh A2V / SR run begins at the checkpoint's weights (not the seeded init), says so in
    its state and in the assembled checkpoint; a resumed state that began elsewhere is refused."""
    from models.checkpoint import save_checkpoint
    from models.training.train_all import reuse_vae

    p = small_preset()
    base_mods = build_modules(p, seed=3)
    base = tmp_path / "base.safetensors"
    save_checkpoint(base_mods, base, metadata={"preset": "tiny", "git_commit": "abc", "vae_steps": "7",
                                               "vae_chain_steps": "2", "a2v_steps": "11", "sr_steps": "5"})
    run = tmp_path / "run"
    reuse_vae(p, run, base)
    (run / "latents").symlink_to(cache / "latents")
    # a zero budget takes no step: what is saved is exactly what the warm start put in, averages included
    train_a2v(p, run / "latents", tmp_path / "a2v_zero.pt", minutes=0.0, init_from=base)
    zero = torch.load(tmp_path / "a2v_zero.pt", weights_only=False)["modules"]
    for name in ("a2v", "audio"):
        assert _same_weights(zero[name], base_mods[name]) and _same_weights(zero[f"ema_{name}"], base_mods[name])
    train_sr(p, run / "latents", tmp_path / "sr_zero.pt", minutes=0.0, init_from=base)
    assert _same_weights(torch.load(tmp_path / "sr_zero.pt", weights_only=False)["modules"]["ema_sr"], base_mods["sr"])
    a = train_a2v(p, run / "latents", run / "a2v_state.pt", minutes=0.03, batch_n=2, batch_i=4, log_every=1,
                  init_from=base)
    assert a["steps"] >= 1
    blob = torch.load(run / "a2v_state.pt", weights_only=False)
    assert blob["state"]["init_from"] == f"base.safetensors (git abc, sha256 {_sha12(base)}, a2v_steps 11)"
    seeded = build_modules(p, seed=0)
    for name in ("a2v", "audio"):  # the EMA (what ships) is at the base, far from the seeded init
        got, want, init = (_first_matrix(sd) for sd in (blob["modules"][f"ema_{name}"], base_mods[name].state_dict(),
                                                     seeded[name].state_dict()))
        assert (got - want).norm() < 0.3 * (init - want).norm()
    again = train_a2v(p, run / "latents", run / "a2v_state.pt", minutes=0.05, batch_n=2, batch_i=4, init_from=base)
    assert again["steps"] > a["steps"]  # the same --from resumes
    save_checkpoint(base_mods, tmp_path / "other.safetensors", metadata={"preset": "tiny"})
    with pytest.raises(ValueError, match="began from base.safetensors.*drop --from"):
        train_a2v(p, run / "latents", run / "a2v_state.pt", minutes=0.06, init_from=tmp_path / "other.safetensors")
    save_checkpoint(base_mods, tmp_path / "wan.safetensors", metadata={"preset": "14b"})
    with pytest.raises(CheckpointError, match="preset '14b', not 'tiny'"):
        train_sr(p, run / "latents", run / "sr_x_state.pt", minutes=0.01, init_from=tmp_path / "wan.safetensors")
    with pytest.raises(CheckpointError, match="missing.safetensors.*does not exist"):
        train_sr(p, run / "latents", run / "sr_x_state.pt", minutes=0.01, init_from=tmp_path / "missing.safetensors")
    s = train_sr(p, run / "latents", run / "sr_state.pt", minutes=0.02, batch=8, log_every=1, init_from=base)
    assert s["init_l1"] != pytest.approx(s["bilinear_l1"])  # the base's SR, not bilinear upsampling
    meta = assemble_checkpoint(p, run, tmp_path / "new.safetensors", seed=0, base=base)
    assert meta["a2v_init_from"] == f"base.safetensors (git abc, sha256 {_sha12(base)}, a2v_steps 11)"
    assert meta["sr_init_from"] == f"base.safetensors (git abc, sha256 {_sha12(base)}, sr_steps 5)"
    assert meta["a2v_steps"] == str(again["steps"]) and meta["sr_steps"] == str(s["steps"])
    assert meta["vae_chain_steps"] == "2"  # no decoder stage ran: the reused decoder's figures stay


def test_warm_start_across_a_latent_channel_change(cache: Path, tmp_path: Path) -> None:
    """--reinit-reshaped: a checkpoint of the preset with other latent channels warm-starts the A2V and
    the SR. The tensors that read or write latents keep the seeded init (A2V head at zero, SR exactly
    bilinear at start: its head at zero, its reference windows no-ops), every other tensor is the file's,
    and the state names what was reinitialised. Without the flag the mismatch is an error."""
    from models.checkpoint import save_checkpoint

    p = small_preset()
    c = p.latent_channels // 2
    other = dataclasses.replace(p, latent_channels=c, dit=dataclasses.replace(p.dit, in_channels=c, ref_channels=c),
                                sr=dataclasses.replace(p.sr, channels=c), vae=dataclasses.replace(p.vae, latent_channels=c))
    base_mods = build_modules(other, seed=3)
    base = tmp_path / "c4.safetensors"
    save_checkpoint(base_mods, base, metadata={"preset": "tiny", "git_commit": "abc", "a2v_steps": "11"})
    with pytest.raises(CheckpointError, match=r"shape mismatch.*a2v\.patch_embed\.weight"):
        train_a2v(p, cache / "latents", tmp_path / "no.pt", minutes=0.0, init_from=base)
    train_a2v(p, cache / "latents", tmp_path / "a2v.pt", minutes=0.0, init_from=base, reinit_reshaped=True)
    blob = torch.load(tmp_path / "a2v.pt", weights_only=False)
    want = ["a2v.head.bias", "a2v.head.weight", "a2v.patch_embed.weight", "a2v.ref_embed.weight"]  # file order
    assert blob["state"]["init_from"] == (f"c4.safetensors (git abc, sha256 {_sha12(base)}, a2v_steps 11); seeded "
                                          "init kept for 4 reshaped tensors: " + ", ".join(want))
    got, seeded, filed = blob["modules"]["ema_a2v"], build_modules(p, seed=0)["a2v"].state_dict(), base_mods["a2v"].state_dict()
    for k, v in got.items():
        if f"a2v.{k}" in want:
            assert v.shape != filed[k].shape
            assert torch.equal(v, torch.zeros_like(v) if k.startswith("head.") else seeded[k])
        else:
            assert torch.equal(v, filed[k]), k
    assert _same_weights(blob["modules"]["ema_audio"], base_mods["audio"])
    s = train_sr(p, cache / "latents", tmp_path / "sr.pt", minutes=0.0, init_from=base, reinit_reshaped=True)
    assert s["init_l1"] == pytest.approx(s["bilinear_l1"], rel=1e-5)  # starts exactly as bilinear upsampling
    sr_blob = torch.load(tmp_path / "sr.pt", weights_only=False)
    assert "sr.ref_window.out.weight" in sr_blob["state"]["init_from"]
    assert torch.equal(sr_blob["modules"]["ema_sr"]["blocks.0.attn.qkv.weight"],
                       base_mods["sr"].state_dict()["blocks.0.attn.qkv.weight"])


def test_sr_warm_starts_from_a_checkpoint_written_before_its_reference_window(cache: Path, tmp_path: Path) -> None:
    """A file without ``sr.ref_window.*`` / ``sr.ref_window_more.*`` (the fourth checkpoint) warm-starts the
    SR and serves as an assembly base: the window steps start as no-ops, so the SR computes what the
    file's SR computed."""
    from safetensors.torch import load_file, save_file

    from models.checkpoint import save_checkpoint
    from models.training.train_all import reuse_vae

    p = small_preset()
    base_mods = build_modules(p, seed=3)
    full = tmp_path / "full.safetensors"
    save_checkpoint(base_mods, full, metadata={"preset": "tiny"})
    old = tmp_path / "old.safetensors"
    save_file({k: v for k, v in load_file(str(full)).items() if not k.startswith("sr.ref_window")}, str(old),
              metadata={"preset": "tiny"})
    with pytest.raises(CheckpointError, match=r"missing key.*sr\.ref_window\."):
        load_checkpoint(build_modules(p), old)  # inference loads stay strict
    run = tmp_path / "run"
    reuse_vae(p, run, old)
    (run / "latents").symlink_to(cache / "latents")
    train_sr(p, run / "latents", run / "sr_state.pt", minutes=0.0, init_from=old)
    sr = build_modules(p, seed=0)["sr"].eval()
    sr.load_state_dict(torch.load(run / "sr_state.pt", weights_only=False)["modules"]["ema_sr"])
    without = dataclasses.replace(p.sr, ref_window_radius=0)
    from models.sr import SRDiT

    plain = SRDiT(without).eval()
    plain.load_state_dict({k: v for k, v in base_mods["sr"].state_dict().items() if not k.startswith("ref_window")})
    lr, ref = torch.randn(2, p.latent_channels, 3, *p.lr_latent_hw), torch.randn(2, p.latent_channels, *p.hr_latent_hw)
    with torch.no_grad():
        assert torch.equal(sr(lr, ref), plain(lr, ref))
    (run / "sr_state.pt").unlink()  # no SR trained: assembly keeps the base's, window at its no-op init
    assemble_checkpoint(p, run, tmp_path / "new.safetensors", seed=0, base=old)
    again = build_modules(p, seed=5)["sr"].eval()
    load_checkpoint({"sr": again}, tmp_path / "new.safetensors")
    with torch.no_grad():
        assert torch.equal(again(lr, ref), plain(lr, ref))


def test_the_scored_pipeline_follows_the_chunk_plan(tmp_path: Path) -> None:
    """What ``bench.quality`` scores is the real pipeline (one renderer): with and without I chunks it
    renders the same N chunks, and I_k replaces exactly N_{k+1}[0:e]."""
    from PIL import Image

    from bench.quality import write_wav
    from pipeline.families import FAMILIES
    from pipeline.family_runtime import FamilyRuntime
    from pipeline.render import RenderRequest, render

    p = small_preset()
    runtime = FamilyRuntime(FAMILIES.get("tiny"), p, None)  # seeded random init, 64x64
    zero_past_taps(runtime.modules["vae"].get())  # per-frame decoder (as trained): frames compare position by position
    L, e = p.chunk_frames, p.interp_frames
    n = 2 * L + 5  # N0, N1, a short N2 (and I0, I1)
    Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)).save(tmp_path / "ref.png")
    write_wav(tmp_path / "audio.wav", np.random.default_rng(1).standard_normal(n * 640).astype(np.float32) * 0.1)

    def frames(use_i: bool) -> list[np.ndarray]:
        parts: list[np.ndarray] = []
        request = RenderRequest(image=tmp_path / "ref.png", audio=tmp_path / "audio.wav", use_i_chunks=use_i)
        render(request, [], family=runtime, frame_tap=lambda f0, fr: parts.append(fr.copy()))
        return list(np.concatenate(parts))

    with_i, without = frames(True), frames(False)
    assert len(with_i) == len(without) == n and with_i[0].shape == (64, 64, 3) and with_i[0].dtype == np.uint8
    same = [bool(np.array_equal(a, b)) for a, b in zip(with_i, without, strict=True)]
    # I_0 replaces N_1[0:e], I_1 replaces N_2[0:e]; everything else comes from the same N chunks
    assert same == [not (L <= t < L + e or 2 * L <= t < 2 * L + e) for t in range(n)]
    assert all(np.array_equal(a, b) for a, b in zip(with_i, frames(True), strict=True))  # seeded noise


def test_a_budget_is_training_time_not_the_start_of_run_scoring(cache: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each trainer scores its weights before the first step (A2V held-out loss, SR bilinear L1, decoder
    PSNR); that scoring is not spent from ``minutes``. Made slower here than the whole budget, it still
    leaves every run its steps (it took the A2V's 1.8-s budget once on a loaded machine: zero steps)."""
    import time

    import models.training.train_a2v as a2v_mod
    import models.training.train_sr as sr_mod
    import models.training.train_vae as vae_mod

    def slow(fn):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(0.6)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(a2v_mod, "heldout_loss", slow(a2v_mod.heldout_loss))
    monkeypatch.setattr(sr_mod, "sr_eval", slow(sr_mod.sr_eval))
    monkeypatch.setattr(vae_mod, "heldout_psnr", slow(vae_mod.heldout_psnr))
    p, minutes = small_preset(), 0.005  # 0.3 s, half the scoring's sleep
    held = cache / "latents"
    out = train_a2v(p, held, tmp_path / "a2v.pt", minutes=minutes, batch_n=2, batch_i=4, heldout_dir=held)
    assert out["steps"] >= 1 and out["heldout_loss"] != out["heldout_loss_start"]
    assert train_sr(p, held, tmp_path / "sr.pt", minutes=minutes, batch=4)["steps"] >= 1
    d = train_decoder(p, build_modules(p, seed=0)["vae"], tmp_path / "dec.pt", minutes=minutes, eval_frames=2)
    assert d["steps"] >= 1 and d["heldout_psnr_db"] != d["start_psnr_db"]


def test_heldout_loss_is_logged_recorded_and_is_the_shipped_weights(cache: Path, tmp_path: Path) -> None:
    """train_a2v --heldout-cache scores the EMA on fixed held-out windows at the start and the end; the
    figure is a pure function of the weights (scoring a checkpoint of the final EMA gives it back exactly),
    and train_all --stage heldout-cache writes held-out identities only."""
    from models.checkpoint import save_checkpoint
    from models.training.train_a2v import main as a2v_main
    from models.training.train_a2v import score_checkpoints
    from models.training.train_all import main as all_main

    p = small_preset()
    held = cache / "latents"  # any latent cache scores; in practice one of held-out identities (below)
    out = train_a2v(p, held, tmp_path / "a2v_state.pt", minutes=0.03, batch_n=2, batch_i=4, heldout_dir=held)
    assert math.isfinite(out["heldout_loss_start"]) and out["heldout_loss"] != out["heldout_loss_start"]
    assert set(out) >= {f"heldout_loss_{k}" for k in ("N", "I", "R")}
    blob = torch.load(tmp_path / "a2v_state.pt", weights_only=False)
    assert blob["state"]["extra"]["heldout_loss"] == out["heldout_loss"]
    mods = build_modules(p, seed=9)
    mods["a2v"].load_state_dict(blob["modules"]["ema_a2v"])
    mods["audio"].load_state_dict(blob["modules"]["ema_audio"])
    ckpt = tmp_path / "ema.safetensors"
    save_checkpoint(mods, ckpt, metadata={"preset": "tiny"})
    assert score_checkpoints(p, held, [ckpt])[str(ckpt)]["heldout_loss"] == pytest.approx(out["heldout_loss"], rel=1e-6)
    with pytest.raises(SystemExit):  # --score without a held-out cache: argparse names the fix
        a2v_main(["--score", str(ckpt)])
    # the held-out cache stage (the real preset, two 3-frame clips): identities of the held-out split
    run = tmp_path / "run"
    run.mkdir()
    save_final_vae(run / "vae_final.pt", build_modules(get_preset("tiny"), seed=0)["vae"].state_dict(), None)
    assert all_main(["--stage", "heldout-cache", "--clips", "2", "--clip-frames", "3", "--threads", "1",
                     "--cache-dir", str(run)]) == 0
    clips = LatentClips(run / "heldout_latents")
    assert clips.num_clips == 2 and bool((clips.identity >= 1_000_000).all()) and not (run / "latents").exists()


def test_a_decoder_that_reads_the_reference_trains_on_each_frames_identity(tmp_path: Path) -> None:
    """train_decoder on a preset whose decoder reads the reference (window and warp): it starts from a
    plain decoder's weights (the window and gate no-ops, so the start's PSNR is the plain decoder's on the
    same frames), passes each frame's identity's reference (never the frame), and the fit moves the window
    and the gate. train_vae trains such a preset's autoencoder plain, the window growing on it as a no-op."""
    p = small_preset()
    reads = dataclasses.replace(p, vae=dataclasses.replace(p.vae, ref_window_radius=1, ref_warp=True))
    torch.manual_seed(0)
    plain = CausalVAE(p.vae).eval()
    vae = CausalVAE(reads.vae)
    vae.load_state_dict(plain.state_dict(), strict=False)
    frames, refs = heldout_frames_with_reference(2, 64)
    assert not torch.equal(frames, refs)  # a pose of the identity, not its neutral reference
    with torch.no_grad():
        start = heldout_psnr(plain, frames)
        assert heldout_psnr(vae.eval(), frames, references=refs) == start
        with pytest.raises(ValueError, match="reads the reference"):
            heldout_psnr(vae, frames)
    gate = vae.decoder.ref_gate.weight.clone()  # type: ignore[union-attr]
    d = train_decoder(reads, vae, tmp_path / "dec.pt", minutes=0.05, eval_frames=2)
    assert d["steps"] >= 2 and d["start_psnr_db"] == pytest.approx(start) and 0 < d["heldout_psnr_db"] < 60
    assert not torch.equal(vae.decoder.ref_gate.weight, gate)  # type: ignore[union-attr]
    # train_vae trains such a preset's autoencoder plain (its crops cannot be given the reference); the
    # window and gate grow on its weights as no-ops, and nothing else may be missing
    train_vae(reads, tmp_path / "vae.pt", minutes=0.01, eval_frames=0)
    trained = torch.load(tmp_path / "vae.pt", weights_only=False)["modules"]["vae"]
    assert not any(".ref_" in k for k in trained)
    grown = vae_from_state(reads.vae, trained)
    assert torch.equal(grown.decoder.ref_gate.weight, torch.zeros_like(grown.decoder.ref_gate.weight))  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"missing or unexpected \['decoder.conv_in.conv.weight'\]"):
        vae_from_state(reads.vae, {k: v for k, v in trained.items() if k != "decoder.conv_in.conv.weight"})
    # the plain path (train_sr's pixel loss: no reference pixels in the cache): the trained decoder's
    # weights without the window and the gate, frozen
    assert plain_decoder(plain) is plain
    path, own = plain_decoder(vae), vae.state_dict()
    assert path.decoder.ref_window is None and not any(t.requires_grad for t in path.parameters())
    assert all(torch.equal(v, own[k]) for k, v in path.state_dict().items())
    assert {k.split(".")[1] for k in set(own) - set(path.state_dict())} == {"ref_window", "ref_gate"}
    with pytest.raises(ValueError, match="scale_equivariance > 0 decodes pooled latents"):
        vae_loss(vae, frames, torch.Generator(), 1e-5, None, 0.25, reference=vae.reference_features(refs[:, :, 0]))


def test_the_motion_loss_teaches_the_warp_where_the_head_came_from(tmp_path: Path) -> None:
    """draw(motion_cell=) adds, to the same frames, where each cell's head came from in the reference
    (the generator's pose) and the cells the head covers whole; motion_loss is the mean distance in
    cells there (zero at the truth); steps on it move the warp's read towards the truth. train_decoder
    records the weight, logs the part, and refuses it for a decoder without the warp."""
    p = small_preset()
    # the free read (a rigid read of a random decoder's is all in place: nothing there for the loss to move)
    reads = dataclasses.replace(p, vae=dataclasses.replace(p.vae, ref_window_radius=1, ref_warp=True,
                                                               ref_warp_rigid=False))
    cell = reads.vae.factor // 2
    sampler = FrameSampler("train", 64)
    d = sampler.draw(step_generator(0, 2), 4, motion_cell=cell)
    assert torch.equal(d.frames, sampler.draw(step_generator(0, 2), 4).frames)
    assert d.shift is not None and d.head is not None
    assert d.shift.shape == (4, 2, 16, 16) and d.head.shape == (4, 1, 16, 16)
    assert 0.1 < float(d.head.mean()) < 0.6 and float(d.head[..., 0, :].sum()) == 0.0  # the top row: background
    assert float(d.shift.abs().max()) > 0.5  # the heads are posed
    with pytest.raises(ValueError, match="motion_cell=4 with crop=32"):
        sampler.draw(step_generator(0, 2), 4, crop=32, motion_cell=cell)
    truth = d.shift / cell
    assert float(motion_loss(truth, d.shift, d.head, cell)) == pytest.approx(0.0, abs=1e-2)
    away = truth + torch.tensor([0.0, 1.0]).view(1, 2, 1, 1)  # every read one cell right of the truth
    assert float(motion_loss(away, d.shift, d.head, cell)) == pytest.approx(1.0, abs=1e-3)
    assert float(motion_loss(away, d.shift, torch.zeros_like(d.head), cell)) == 0.0
    # steps with the motion loss weighted far above the reconstruction move the read towards the truth;
    # the same steps without it (weight 0: the loss still measured) leave it where it was
    def fit(weight: float) -> list[float]:
        torch.manual_seed(0)
        vae = CausalVAE(reads.vae)
        opt = torch.optim.Adam(vae.decoder.parameters(), lr=3e-3)
        with torch.no_grad():
            z, ref_z = vae.encode(d.frames), vae.encode(d.refs)
        seen = []
        for _ in range(30):
            ref = vae.reference_features(d.refs[:, :, 0], ref_z)
            _, parts = decoder_step(vae, opt, z, d.frames, None, reference=ref, motion=(d.shift, d.head, weight))
            seen.append(parts["motion"])
        return seen

    taught, control = fit(20.0), fit(0.0)
    assert taught[0] == control[0] and taught[-1] < 0.6 * control[-1], (taught, control)
    vae, z = CausalVAE(reads.vae), torch.zeros(4, p.vae.latent_channels, 1, 8, 8)
    plain = CausalVAE(p.vae)
    with pytest.raises(ValueError, match="needs a decoder whose warp copies the reference"):
        decoder_step(plain, torch.optim.Adam(plain.decoder.parameters()), z, d.frames, None,
                     motion=(d.shift, d.head, 1.0))
    with pytest.raises(ValueError, match="motion_weight=0.5: this decoder does not warp the reference"):
        train_decoder(p, plain, tmp_path / "plain.pt", minutes=0.01, eval_frames=0, motion_weight=0.5)
    out = train_decoder(reads, vae, tmp_path / "dec.pt", minutes=0.02, eval_frames=0, motion_weight=0.25,
                        log_every=1)  # a line per step: a loaded machine may make fewer than 10
    assert out["steps"] >= 1 and out["motion_weight"] == 0.25
    assert all("motion" in json.loads(line) for line in (tmp_path / "dec.jsonl").read_text().splitlines())
