"""The streaming Wan VAE: chunked decode == whole decode == diffusers ``AutoencoderKLWan.decode``;
encode == diffusers ``encode(...).latent_dist.mode()``; ``Wan2.1_VAE.pth`` (original keys) loads strictly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from torch import Tensor

from models.wan.checkpoint import WanCheckpointError
from models.wan.tiny_release import vae_original_key
from models.wan.vae import WanStreamingVAE, load_wan_vae

Z = 4
TINY = {
    "base_dim": 8,
    "z_dim": Z,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,  # diffusers' converter hard-codes the Wan2.1 block indices, so keep 2
    "latents_mean": [0.3, -0.2, 0.1, 0.5],
    "latents_std": [1.5, 0.7, 2.0, 1.1],
}

to_original_keys = vae_original_key  # diffusers key -> original Wan key (round trip checked below)


@pytest.fixture(scope="module")
def vae_pair(tmp_path_factory) -> tuple[AutoencoderKLWan, WanStreamingVAE, Path]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    ref = AutoencoderKLWan(**TINY).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    state = ref.state_dict()
    original = {to_original_keys(k): v.clone() for k, v in state.items()}
    assert set(convert_wan_vae_to_diffusers(dict(original))) == set(state)  # the inverse is exact
    path = tmp_path_factory.mktemp("wan") / "Wan2.1_VAE.pth"
    torch.save(original, path)
    ours = load_wan_vae(path, dtype=torch.float32, config=TINY)
    return ref, ours, path


def _latents(t: int, seed: int = 0) -> Tensor:
    return torch.randn(1, Z, t, 2, 3, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_whole_decode_equals_diffusers(vae_pair) -> None:  # type: ignore[no-untyped-def]
    ref, ours, _ = vae_pair
    lat = _latents(4)
    got = ours.decode_chunk(lat, ours.new_cache())
    want = ref.decode(ours.denormalize(lat)).sample
    assert got.shape == (1, 3, 1 + 4 * 3, 16, 24)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [[1, 1, 1, 1, 1], [2, 3], [1, 4], [3, 2], [4, 1]])
@torch.no_grad()
def test_chunked_decode_equals_whole(vae_pair, split) -> None:  # type: ignore[no-untyped-def]
    _, ours, _ = vae_pair
    lat = _latents(5, seed=1)
    whole = ours.decode_chunk(lat, ours.new_cache())
    cache = ours.new_cache()
    parts, start = [], 0
    for n in split:
        part = ours.decode_chunk(lat[:, :, start : start + n], cache)
        assert part.shape[2] == (1 + 4 * (n - 1) if start == 0 else 4 * n)  # the causal first-frame rule
        parts.append(part)
        start += n
    torch.testing.assert_close(torch.cat(parts, 2), whole, rtol=1e-5, atol=1e-5)
    assert whole.shape[2] == 1 + 4 * (5 - 1)


@torch.no_grad()
def test_encode_equals_diffusers_and_streams(vae_pair) -> None:  # type: ignore[no-untyped-def]
    ref, ours, _ = vae_pair
    frames = torch.rand(1, 3, 9, 16, 24, generator=torch.Generator().manual_seed(2)) * 2 - 1
    got = ours.encode(frames)
    want = ours.normalize(ref.encode(frames).latent_dist.mode())
    assert got.shape == (1, Z, 3, 2, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cache = ours.new_cache(encoder=True)
    pieces = torch.cat([ours.encode(frames[:, :, :5], cache), ours.encode(frames[:, :, 5:], cache)], 2)
    torch.testing.assert_close(pieces, got, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs 1 \\+ 4k"):
        ours.encode(frames[:, :, :4])
    assert ours.encode(frames[:, :, :1]).shape[2] == 1  # the reference image alone


def test_vae_corruptions_are_named(vae_pair, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, _, path = vae_pair
    state = torch.load(path, weights_only=True)
    state.pop("decoder.head.2.weight")
    bad = tmp_path / "Wan2.1_VAE.pth"
    torch.save(state, bad)
    with pytest.raises(WanCheckpointError, match="keys missing: decoder.conv_out.weight"):
        load_wan_vae(bad, config=TINY)
    bad.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(WanCheckpointError, match="not a readable torch checkpoint"):
        load_wan_vae(bad, config=TINY)
    with pytest.raises(WanCheckpointError, match="ships Wan2.1_VAE.pth"):
        load_wan_vae(tmp_path / "nowhere", config=TINY)
