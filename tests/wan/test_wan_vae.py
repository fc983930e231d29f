"""The streaming Wan VAE: chunked decode == whole decode == diffusers ``AutoencoderKLWan.decode``;
encode == diffusers ``encode(...).latent_dist.mode()``; ``Wan2.1_VAE.pth`` (original keys) loads strictly;
the CPU convs in strips under a column budget compute the same and unfold no more than the budget."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from torch import Tensor

from models.wan.checkpoint import WanCheckpointError
from models.wan.tiny_release import vae_original_key
from models.wan.vae import (
    WanStreamingVAE,
    conv_column_budget,
    install_strip_conv3d,
    load_wan_vae,
    strip_conv3d,
    strip_tiles,
)

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


# -- convs in strips under a column budget (models.wan.vae.strip_conv3d) ---------------------------------
STRIP_BUDGET = 64 << 10  # the tiny VAE's plain convs unfold up to ~330 KiB: several strips each


@pytest.fixture
def conv_columns(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The column buffer (bytes) each ``F.conv3d`` call unfolds on CPU (torch's ``Slow3d``: N · C_in / groups
    · kernel volume · output positions floats; every conv of these tiny shapes takes that path)."""
    calls: list[int] = []
    real = F.conv3d

    def spy(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # type: ignore[no-untyped-def]
        out = real(x, weight, bias, stride, padding, dilation, groups)
        calls.append(x.shape[0] * math.prod(weight.shape[1:]) * math.prod(out.shape[2:]) * x.element_size())
        return out

    monkeypatch.setattr(F, "conv3d", spy)
    return calls


@torch.no_grad()
def test_strip_decode_and_encode_equal_plain(vae_pair, conv_columns) -> None:  # type: ignore[no-untyped-def]
    _, ours, _ = vae_pair
    plain, strips = WanStreamingVAE(ours.vae, conv_budget_bytes=None), WanStreamingVAE(ours.vae, STRIP_BUDGET)
    lat = _latents(5, seed=3)
    whole = plain.decode_chunk(lat, plain.new_cache())
    n_plain, plain_max = len(conv_columns), max(conv_columns)
    conv_columns.clear()
    cache = strips.new_cache()  # chunked: the causal cache crosses the strips' chunk boundaries too
    got = torch.cat([strips.decode_chunk(lat[:, :, :2], cache), strips.decode_chunk(lat[:, :, 2:], cache)], 2)
    assert plain_max > 4 * STRIP_BUDGET and max(conv_columns) <= STRIP_BUDGET
    assert len(conv_columns) > 3 * n_plain  # split into strips, not merely under the budget
    # Bit-equal with this torch's MKL (measured); the tolerance leaves room for an sgemm that picks
    # another kernel for a narrower strip (MKL's kernels for < 12 columns sum in another order).
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    frames = torch.rand(1, 3, 9, 16, 24, generator=torch.Generator().manual_seed(4)) * 2 - 1
    encoded, largest = [], []
    for vae in (plain, strips):  # in two pieces, the encoder's cache carried
        cache = vae.new_cache(encoder=True)
        conv_columns.clear()
        encoded.append(torch.cat([vae.encode(frames[:, :, :5], cache), vae.encode(frames[:, :, 5:], cache)], 2))
        largest.append(max(conv_columns))
    assert largest[0] > 4 * STRIP_BUDGET >= 4 * largest[1]
    torch.testing.assert_close(encoded[1], encoded[0], rtol=1e-5, atol=1e-5)
    conv_columns.clear()
    ours.vae.decode(ours.denormalize(lat))  # the wrapped VAE used directly (diffusers' decode): plain convs
    assert max(conv_columns) == plain_max and len(conv_columns) == n_plain


@pytest.mark.parametrize(
    "kw",
    [
        {},  # WanCausalConv3d's case: padding already applied, stride 1
        {"stride": 2},
        {"stride": (1, 2, 3), "dilation": (1, 2, 1)},  # dilated: torch's SlowDilated3d, also an unfold
        {"padding": 1},
        {"padding": "same", "dilation": 2},
        {"padding": (0, 2, 1), "padding_mode": "replicate"},
        {"padding": (1, 1, 2), "padding_mode": "circular"},
    ],
)
@torch.no_grad()
def test_strip_conv3d_is_the_conv_within_budget(kw, conv_columns) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(5)
    conv = torch.nn.Conv3d(4, 6, 3, **kw)
    x = torch.randn(1, 4, 6, 13, 17)
    want = conv(x)
    unit = 4 * 27 * 4  # column bytes of one output position: C_in · kernel volume floats
    out_thw = tuple(want.shape[2:])
    full = unit * math.prod(out_thw)
    # budgets: strips of rows, rows of fewer frames, pieces of one row, below one position (the floor)
    for budget in (full // 3, unit * out_thw[2] + 1, unit * 5, 1):
        conv_columns.clear()
        got = strip_conv3d(conv, x, conv.weight, conv.bias, budget)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # MKL: < 12 columns sum in another order
        tile = strip_tiles(unit, out_thw, budget)  # type: ignore[arg-type]
        tiles = math.prod(-(-o // k) for o, k in zip(out_thw, tile, strict=True))
        assert len(conv_columns) == tiles > 1 and max(conv_columns) <= max(budget, unit)
    conv_columns.clear()
    torch.testing.assert_close(strip_conv3d(conv, x, conv.weight, conv.bias, full), want, rtol=0, atol=0)
    assert conv_columns == [full]  # at the budget: the plain conv, one call


@torch.no_grad()
def test_strip_conv3d_leaves_what_torch_does_not_unfold(conv_columns) -> None:  # type: ignore[no-untyped-def]
    """Grouped convs and batches > 1 go to oneDNN on CPU (no column buffer; the real Wan shapes' wide
    convs too), and a 1×1×1 kernel at stride 1 multiplies its input as it is: one plain call whatever
    the budget."""
    for conv, x in ((torch.nn.Conv3d(4, 6, 3, groups=2), torch.randn(1, 4, 6, 13, 17)),
                    (torch.nn.Conv3d(4, 6, 3), torch.randn(2, 4, 6, 13, 17)),
                    (torch.nn.Conv3d(4, 6, 1), torch.randn(1, 4, 6, 13, 17))):
        conv_columns.clear()
        torch.testing.assert_close(strip_conv3d(conv, x, conv.weight, conv.bias, 1), conv(x), rtol=0, atol=0)
        assert len(conv_columns) == 2  # the strip_conv3d call and conv(x)


def test_strip_tiles_and_installation(conv_columns) -> None:  # type: ignore[no-untyped-def]
    assert strip_tiles(10, (4, 7, 5), 10 * 4 * 5 * 6) == (4, 4, 5)  # 6 rows fit: balanced 4 + 3, not 6 + 1
    assert strip_tiles(10, (4, 7, 5), 10 * 5 * 2) == (2, 1, 5)  # one row of 2 frames
    assert strip_tiles(10, (4, 7, 5), 10 * 3) == (1, 1, 3)  # 3 positions of a row (5 → 3 + 2)
    assert strip_tiles(10, (4, 7, 5), 1) == (1, 1, 1)  # the floor: one output position
    model = torch.nn.Sequential(torch.nn.Conv3d(2, 2, 3), torch.nn.Conv2d(2, 2, 1))
    assert install_strip_conv3d(model) == install_strip_conv3d(model) == 1  # idempotent; Conv3d only
    x, spy = torch.randn(1, 2, 3, 5, 5), conv_columns
    with conv_column_budget(1):  # one output position a call
        torch.testing.assert_close(model[0](x), F.conv3d(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-6)
    assert len(spy) == 9 + 1
    spy.clear()
    model[0](x)  # outside any budget: plain
    assert len(spy) == 1

    class Custom(torch.nn.Conv3d):
        def _conv_forward(self, input, weight, bias):  # type: ignore[no-untyped-def]
            return super()._conv_forward(input, weight * 2, bias)

    with pytest.raises(TypeError, match="overrides _conv_forward"):
        install_strip_conv3d(Custom(2, 2, 1))
