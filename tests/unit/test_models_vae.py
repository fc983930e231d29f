"""The causal VAE streams exactly: chunked decode == whole decode, for any split."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from models.layers import WindowKeys
from models.presets import VAEConfig, get_preset
from models.vae import CausalVAE, rigid_read

SPLITS = [
    [7],
    [1, 1, 1, 1, 1, 1, 1],
    [1, 2, 4],
    [3, 4],
    [2, 1, 1, 3],
]


def plain_cfg() -> VAEConfig:
    """The tiny preset's autoencoder with a decoder that does not read the reference."""
    return dataclasses.replace(get_preset("tiny").vae, ref_window_radius=0, ref_warp=False)


@pytest.fixture(scope="module")
def vae() -> CausalVAE:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return CausalVAE(plain_cfg()).eval()


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_chunked_decode_equals_whole(vae: CausalVAE, split: list[int]) -> None:
    torch.manual_seed(1)
    z = torch.randn(1, vae.cfg.latent_channels, sum(split), 8, 8)  # small latent: any size works
    with torch.no_grad():
        whole, _ = vae.decode(z)
        outs, cache, start = [], None, 0
        for n in split:
            out, cache = vae.decode(z[:, :, start : start + n], cache)
            outs.append(out)
            start += n
    assert whole.shape == (1, 3, sum(split), 64, 64)
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, atol=1e-5, rtol=0)


def test_cache_is_small_plain_and_history_matters(vae: CausalVAE) -> None:
    torch.manual_seed(2)
    z = torch.randn(1, vae.cfg.latent_channels, 5, 8, 8)
    with torch.no_grad():
        _, cache = vae.decode(z[:, :, :4])
        with_cache, _ = vae.decode(z[:, :, 4:], cache)
        without, _ = vae.decode(z[:, :, 4:], None)
    kt = vae.cfg.temporal_kernel
    assert len(cache) == vae.decoder.num_cache
    for c in cache:
        assert type(c) is torch.Tensor and c.shape[1] == kt - 1 and c.shape[-2:] == (8, 8)
        assert c.untyped_storage().nbytes() == c.numel() * c.element_size()  # a copy, not a view of the chunk
    # the decoder is really temporal: the past changes the output (the test above could not fail otherwise)
    assert (with_cache - without).abs().max() > 1e-4


def test_bad_cache_is_rejected(vae: CausalVAE) -> None:
    z = torch.randn(1, vae.cfg.latent_channels, 2, 8, 8)
    with torch.no_grad():
        _, cache = vae.decode(z)
        with pytest.raises(ValueError, match="cache"):
            vae.decode(z, cache[:-1])
        with pytest.raises(ValueError, match="cache"):
            vae.decode(torch.randn(1, vae.cfg.latent_channels, 2, 4, 4), cache)


def test_encode_shapes_and_lowres(vae: CausalVAE) -> None:
    p = get_preset("tiny")
    rgb = torch.rand(1, 3, 2, p.height, p.width) * 2 - 1
    with torch.no_grad():
        z = vae.encode(rgb)
        # per-frame encoder: frame 1 alone gives the same latent
        z1 = vae.encode(rgb[:, :, 1:])
    assert z.shape == (1, p.latent_channels, 2, *p.hr_latent_hw)
    torch.testing.assert_close(z[:, :, 1:], z1, atol=1e-5, rtol=0)
    lr = vae.to_lowres(z)
    assert lr.shape == (1, p.latent_channels, 2, *p.lr_latent_hw)
    f = p.lowres_factor
    torch.testing.assert_close(lr[..., 0, 0], z[..., :f, :f].mean(dim=(-1, -2)))
    with pytest.raises(ValueError, match="divisible"):
        vae.encode(torch.zeros(1, 3, 1, 100, 100))


@pytest.fixture(scope="module")
def reading() -> CausalVAE:
    """A decoder that reads the reference (``ref_window_radius`` 2), its window trained-looking."""
    torch.manual_seed(0)
    vae = CausalVAE(dataclasses.replace(plain_cfg(), ref_window_radius=2)).eval()
    with torch.no_grad():
        torch.nn.init.normal_(vae.decoder.ref_window.out.weight, std=0.05)  # type: ignore[union-attr]
    return vae


def test_a_decoder_that_reads_the_reference_starts_as_the_plain_one(vae: CausalVAE) -> None:
    """Its window starts as a no-op: the plain decoder's weights load into it (the window's keys missing)
    and it decodes exactly what the plain one does; a plain decoder ignores a reference passed to it."""
    grown = CausalVAE(dataclasses.replace(vae.cfg, ref_window_radius=2)).eval()
    missing = grown.load_state_dict(vae.state_dict(), strict=False).missing_keys
    assert missing and all(k.startswith("decoder.ref_window.") for k in missing)
    torch.manual_seed(3)
    z, ref = torch.randn(2, vae.cfg.latent_channels, 3, 8, 8), torch.rand(2, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        feats = grown.reference_features(ref)
        assert feats is not None and torch.equal(feats.rgb, ref)
        # without gradients, the window's keys and values of each of the 16x16 cells at twice the latent
        # resolution, over the 5x5 offsets of radius 2 (one head of 16 per 16 of the window's width)
        heads = grown.cfg.ref_window_dim // 16
        assert isinstance(feats.source, WindowKeys)
        assert feats.source.k.shape == (2, heads, 16 * 16, 16, 25) and feats.source.v.shape == (2, heads, 16 * 16, 25, 16)
        assert torch.equal(grown.decode(z, reference=feats)[0], vae.decode(z)[0])
        assert torch.equal(vae.decode(z, reference=feats)[0], vae.decode(z)[0])
        assert vae.reference_features(ref) is None


def test_a_decoder_that_reads_the_reference_needs_it_reads_its_own_and_streams(reading: CausalVAE) -> None:
    torch.manual_seed(4)
    c = reading.cfg.latent_channels
    z, refs = torch.randn(2, c, 5, 8, 8), torch.rand(2, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"reads the reference \(VAEConfig.ref_window_radius=2\): pass reference="):
            reading.decode(z)
        feats = reading.reference_features(refs)
        assert feats is not None
        # the latent the caller already has gives the same features
        given = reading.reference_features(refs, reading.encode(refs[:, :, None]))
        assert given is not None and all(torch.equal(a, b) for a, b in zip(given.source, feats.source, strict=True))
        both, _ = reading.decode(z, reference=feats)
        # each batch row reads its own reference; another reference changes the frames
        for b in range(2):
            torch.testing.assert_close(reading.decode(z[b : b + 1], reference=reading.reference_features(refs[b : b + 1]))[0],
                                       both[b : b + 1], atol=1e-5, rtol=0)
        # with gradients (training) the features are the window's map itself, slid per offset: the same frames
        with torch.enable_grad():
            slid = reading.reference_features(refs)
        assert slid is not None and isinstance(slid.source, torch.Tensor) and slid.source.requires_grad
        torch.testing.assert_close(reading.decode(z, reference=slid)[0], both, atol=1e-5, rtol=0)
        swapped, _ = reading.decode(z, reference=reading.reference_features(refs.flip(0)))
        assert (swapped - both).abs().max() > 1e-3
        # chunked == whole, the reference passed with every chunk
        outs, cache = [], None
        for s, e in ((0, 1), (1, 3), (3, 5)):
            out, cache = reading.decode(z[:, :, s:e], cache, reference=feats)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), both, atol=1e-5, rtol=0)


def test_the_reference_window_needs_a_level_above_the_latent() -> None:
    cfg = dataclasses.replace(plain_cfg(), factor=2, enc_channels=(32,), dec_channels=(16,), dec_blocks=(),
                              ref_window_radius=1)
    with pytest.raises(ValueError, match="ref_window_radius=1: the reference window runs at twice the latent"):
        CausalVAE(cfg)


def test_the_reference_warp_copies_the_reference_from_where_the_window_read() -> None:
    """``ref_warp``: each output pixel blends, by the decoder's gate, towards the reference's pixels taken
    from where the window's attention read (its expected offset, in cells of twice the latent resolution).
    The gate starts at zero (the decoder's own output); fully open with the attention held on one offset
    the output is the reference moved by that many cells."""
    base = plain_cfg()
    torch.manual_seed(6)
    vae = CausalVAE(dataclasses.replace(base, ref_window_radius=1, ref_warp=True, ref_warp_rigid=False)).eval()
    plain = CausalVAE(dataclasses.replace(base, ref_window_radius=1)).eval()
    plain.load_state_dict(vae.state_dict(), strict=False)
    z, ref = torch.randn(1, base.latent_channels, 2, 8, 8), torch.rand(1, 3, 64, 64) * 2 - 1
    cell = base.factor // 2
    with torch.no_grad():
        feats = vae.reference_features(ref)
        assert torch.equal(vae.decode(z, reference=feats)[0], plain.decode(z, reference=feats)[0])
        win, gate = vae.decoder.ref_window, vae.decoder.ref_gate
        assert win is not None and gate is not None
        win.pos_bias.zero_()
        win.pos_bias[:, 7] = 1e4  # offset index 7 of the 3x3 window: one cell down (dy = +1, dx = 0)
        feats = vae.reference_features(ref)  # gathered keys hold the bias they were gathered with
        _, offset, _ = win.forward_with_offset(torch.randn(2, base.dec_channels[-2], 16, 16), feats.source)
        assert offset.shape == (2, 2, 16, 16)
        torch.testing.assert_close(offset[:, :, :15], torch.tensor([1.0, 0.0]).view(1, 2, 1, 1).expand(2, 2, 15, 16))
        gate.bias.fill_(2.0)  # fully open (the blend is clamped to [0, 1])
        read: list[torch.Tensor] = []
        out, _ = vae.decode(z, reference=feats, clamp=False, offsets=read)
        # decode(offsets=) hands out where it read: (B, T, 2, h, w) in cells, the frames in order
        assert len(read) == 1 and read[0].shape == (1, 2, 2, 16, 16)
        torch.testing.assert_close(read[0][:, :, :, :15], torch.tensor([1.0, 0.0]).view(1, 1, 2, 1, 1).expand(1, 2, 2, 15, 16))
        none: list[torch.Tensor] = []
        plain.decode(z, reference=feats, offsets=none)
        assert none == []  # a decoder without the warp reads nothing to hand out
    # rows above the last cell row take the reference one cell (cell pixels) lower
    torch.testing.assert_close(out[0, :, :, : -2 * cell], ref[:, :, None, cell : -cell].expand(1, 3, 2, -1, -1)[0],
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="ref_warp: the warp follows where the reference window read"):
        CausalVAE(dataclasses.replace(base, ref_warp=True))


def test_the_rigid_read_is_the_heads_motion_fitted_through_jitter_and_outliers() -> None:
    """``ref_warp_rigid`` (``rigid_read``): a frame's read is two layers, a head moved by the similarity
    map fitted to the reads it holds (weighted by how sure each cell's attention is, robust to a mouth
    that moves on its own) and what stands still, read in place; each cell goes with its neighbourhood.
    A head moving over a still background is followed through the jitter, the background stays put,
    and a head that did not move is read in place, whatever the jitter and the mouth."""
    g = torch.Generator().manual_seed(3)
    h = w = 32
    ys, xs = torch.meshgrid(torch.arange(h) - 15.5, torch.arange(w) - 15.5, indexing="ij")
    ang, scale, ty, tx = math.radians(3.0), 1.02, 1.2, -0.7
    a, b = scale * math.cos(ang), scale * math.sin(ang)
    true = torch.stack([a * ys + b * xs + ty - ys, a * xs - b * ys + tx - xs])  # (2, h, w): dy, dx in cells
    r2 = ys.pow(2) + xs.pow(2)
    head = r2 < 13**2  # a third of the map, as tiny's heads
    sure = torch.zeros(h, w, dtype=torch.bool)
    sure[::3, ::3] = True  # a few cells with something to match (features, the background's pattern)
    mouth = torch.zeros(h, w, dtype=torch.bool)
    mouth[23:26, 12:20] = True
    near_mouth = torch.nn.functional.max_pool2d(mouth[None, None].float(), 5, stride=1, padding=2)[0, 0] > 0
    spread = torch.where(sure | mouth, 0.05, 3.0)[None]
    jitter = torch.where(sure, 0.02, 0.8) * torch.randn(2, h, w, generator=g)
    moving = torch.where(head, true, torch.zeros(2, h, w)) + jitter
    moving[:, mouth] = 2.5  # moves on its own, and its attention is sure of it
    still = jitter.clone()  # the same head, not moved
    still[:, mouth] = 0.7
    out = rigid_read(torch.stack([moving, still]), torch.stack([spread, spread]))
    assert out.shape == (2, 2, h, w)
    inside = (r2 < 11**2) & ~near_mouth  # two cells in from the edge, where a neighbourhood is all head
    err = (out[0] - true).pow(2).sum(dim=0).sqrt()[inside]
    raw = (moving - true).pow(2).sum(dim=0).sqrt()[inside & ~sure]
    assert float(err.max()) < 0.25 and float(err.mean()) < 0.15 < 0.8 < float(raw.mean())  # the jitter is gone
    assert float(out[0][:, r2 > 14.5**2].abs().max()) == 0.0  # the background stays put
    assert float(out[1].abs().max()) == 0.0 < 0.5 < float(still[:, ~sure].abs().mean())  # read in place
    assert torch.equal(rigid_read(still[None], spread[None]), torch.zeros(1, 2, h, w))  # alone: its early exit
    # a decoder asked to read rigidly copies from (and decode(offsets=) hands out) the fitted read: with
    # its attention held one cell down, every cell reads one cell down, the last row too (whose window
    # has no cell below: the free read there is elsewhere)
    base = plain_cfg()
    reads = {}
    for rigid in (False, True):
        torch.manual_seed(6)
        vae = CausalVAE(dataclasses.replace(base, ref_window_radius=1, ref_warp=True, ref_warp_rigid=rigid)).eval()
        assert vae.decoder.rigid is rigid
        win = vae.decoder.ref_window
        assert win is not None
        z, ref = torch.randn(1, base.latent_channels, 2, 8, 8), torch.rand(1, 3, 64, 64) * 2 - 1
        with torch.no_grad():
            win.pos_bias.zero_()
            win.pos_bias[:, 7] = 1e4  # offset index 7 of the 3x3 window: one cell down
            got: list[torch.Tensor] = []
            vae.decode(z, reference=vae.reference_features(ref), offsets=got)
        reads[rigid] = got[0][0]  # (T, 2, h, w)
    down = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1).expand_as(reads[True])
    torch.testing.assert_close(reads[False][:, :, :-1], down[:, :, :-1])
    assert float((reads[False][:, :, -1] - down[:, :, -1]).abs().max()) > 0.5
    torch.testing.assert_close(reads[True], down, atol=0.01, rtol=0)
    assert CausalVAE(dataclasses.replace(base, ref_warp_rigid=True)).decoder.rigid is False  # inert without the warp
