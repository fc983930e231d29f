"""The causal VAE streams exactly: chunked decode == whole decode, for any split."""

from __future__ import annotations

import pytest
import torch

from models.presets import get_preset
from models.vae import CausalVAE

SPLITS = [
    [7],
    [1, 1, 1, 1, 1, 1, 1],
    [1, 2, 4],
    [3, 4],
    [2, 1, 1, 3],
]


@pytest.fixture(scope="module")
def vae() -> CausalVAE:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return CausalVAE(get_preset("tiny").vae).eval()


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
