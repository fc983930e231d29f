"""Contract tests of the model family on the tiny preset (CPU, one thread).

Oracles: chunked == whole (audio), per-frame independence (SR), translation invariance of absolute
frame indices (DiT), exact recovery by the sampler on a known flow, checkpoint round trips and errors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import Tensor

from models.audio import AudioEncoder
from models.checkpoint import GROWN_PARTS, CheckpointError, build_modules, load_checkpoint, save_checkpoint
from models.dit import A2VDiT
from models.layers import ReferenceWindowAttention, count_parameters
from models.presets import PRESETS, ModelPreset, get_preset
from models.sampler import FlowMatchEulerSampler
from models.sr import SRDiT
from models.text import TextEncoder


@pytest.fixture(scope="module")
def preset() -> ModelPreset:
    torch.set_num_threads(1)
    return get_preset("tiny")


@pytest.fixture(scope="module")
def mods(preset: ModelPreset) -> dict[str, torch.nn.Module]:
    return {k: m.eval() for k, m in build_modules(preset, seed=0).items()}


# ---------------------------------------------------------------- presets


def test_tiny_sizes(preset: ModelPreset) -> None:
    assert (preset.height, preset.width, preset.fps) == (256, 256, 25)
    assert preset.hr_latent_hw == (32, 32) and preset.lr_latent_hw == (16, 16)
    assert 0 < preset.interp_frames < preset.chunk_frames
    assert set(PRESETS) == {"tiny", "1.3b", "14b"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_fit_the_chunk_plan(name: str) -> None:
    from pipeline.schedule import ChunkPlan

    p = get_preset(name)
    plan = ChunkPlan(
        num_frames=10 * p.chunk_frames + 3,
        chunk_frames=p.chunk_frames,
        context_frames=p.context_frames,
        interp_frames=p.interp_frames,
    )
    assert plan.num_n_chunks == 11
    assert p.audio.sample_rate == p.sample_rate and p.audio.fps == p.fps
    assert p.dit.in_channels == p.sr.channels == p.vae.latent_channels == p.latent_channels


def test_unknown_preset_names_choices() -> None:
    with pytest.raises(ValueError, match=r"'huge'.*1\.3b.*14b.*tiny"):
        get_preset("huge")


@pytest.mark.parametrize(("name", "lo", "hi"), [("1.3b", 1.0e9, 1.8e9), ("14b", 1.1e10, 1.7e10)])
def test_large_preset_parameter_counts_on_meta(name: str, lo: float, hi: float) -> None:
    p = get_preset(name)
    with torch.device("meta"):
        dit = A2VDiT(p.dit)
        mods = build_modules(p)
    assert lo <= count_parameters(dit) <= hi
    assert all(t.is_meta for m in mods.values() for t in m.parameters())
    assert p.hr_latent_hw[0] % p.lowres_factor == 0


# ---------------------------------------------------------------- audio


def test_audio_chunked_equals_whole(mods: dict[str, torch.nn.Module]) -> None:
    enc = mods["audio"]
    assert isinstance(enc, AudioEncoder)
    c, spf, n = enc.context_frames, enc.samples_per_frame, 23
    torch.manual_seed(3)
    wave = torch.randn(1, (n + 2 * c) * spf) * 0.1
    with torch.no_grad():
        whole = enc(wave, n)
        a = enc(wave[:, : (9 + 2 * c) * spf], 9)  # frames 0..8
        b = enc(wave[:, 9 * spf :], n - 9)  # frames 9..22
    assert whole.shape == (1, n, enc.cfg.out_dim)
    torch.testing.assert_close(torch.cat([a, b], dim=1), whole, atol=1e-5, rtol=0)
    # a frame's feature changes when audio inside its window changes, not when audio outside does
    w2 = wave.clone()
    w2[:, (5 + 2 * c + 1) * spf :] += 1.0  # after frame 5's window
    with torch.no_grad():
        f2 = enc(w2, n)
    torch.testing.assert_close(f2[:, :6], whole[:, :6], atol=1e-5, rtol=0)
    assert (f2[:, 6:] - whole[:, 6:]).abs().max() > 1e-3


def test_audio_wrong_length_is_rejected(mods: dict[str, torch.nn.Module]) -> None:
    with pytest.raises(ValueError, match="expected"):
        mods["audio"](torch.zeros(1, 1000), 4)


# ---------------------------------------------------------------- text


def test_text_encoder_masks_and_truncates(mods: dict[str, torch.nn.Module], preset: ModelPreset) -> None:
    enc = mods["text"]
    assert isinstance(enc, TextEncoder) and preset.text is not None
    with torch.no_grad():
        tokens, mask = enc(["héllo", "", "x" * 500])
    assert tokens.shape == (3, preset.text.max_length, preset.text.dim)
    assert mask[0].sum() == 1 + len("héllo".encode()) and mask[1].sum() == 1 and mask[2].all()
    assert torch.isfinite(tokens).all() and (tokens[~mask] == 0).all()
    with torch.no_grad():
        alone, _ = enc(["héllo"])
    torch.testing.assert_close(alone[0], tokens[0], atol=1e-5, rtol=0)  # padding does not leak


# ---------------------------------------------------------------- SR


def test_sr_frames_are_independent(mods: dict[str, torch.nn.Module], preset: ModelPreset) -> None:
    sr = mods["sr"]
    assert isinstance(sr, SRDiT)
    torch.manual_seed(4)
    lr = torch.randn(2, preset.latent_channels, 5, *preset.lr_latent_hw)
    ref = torch.randn(2, preset.latent_channels, *preset.hr_latent_hw)
    with torch.no_grad():
        out = sr(lr, ref)
        one = sr(lr[1:, :, 3:4], ref[1:])
        two = sr(lr[:, :, 1:3], ref)
    assert out.shape == (2, preset.latent_channels, 5, *preset.hr_latent_hw)
    torch.testing.assert_close(one, out[1:, :, 3:4], atol=1e-5, rtol=0)
    torch.testing.assert_close(two, out[:, :, 1:3], atol=1e-5, rtol=0)
    with torch.no_grad():  # the reference matters (identity-aware)
        other = sr(lr[1:, :, 3:4], ref[:1])
    assert (other - one).abs().max() > 1e-4


def _window_attention_weights(win: ReferenceWindowAttention, z: Tensor, ref: Tensor) -> Tensor:
    """The window's attention written cell by cell ``(N, heads, K, H, W)``: softmax over the window's
    cells inside the latent only, zero on the offsets outside it."""
    N, C, H, W = z.shape
    B, r, heads, hd = ref.shape[0], win.radius, win.num_heads, win.HEAD_DIM
    q, k = win.q(z) / hd**0.5, win.kv(ref).chunk(2, dim=1)[0]
    out = torch.zeros(N, heads, (2 * r + 1) ** 2, H, W)
    for n in range(N):
        b = n // (N // B)
        for y in range(H):
            for x in range(W):
                cells = [(i, y + dy - r, x + dx - r) for i, (dy, dx) in
                         enumerate((dy, dx) for dy in range(2 * r + 1) for dx in range(2 * r + 1))
                         if 0 <= y + dy - r < H and 0 <= x + dx - r < W]
                for h in range(heads):
                    sl = slice(h * hd, (h + 1) * hd)
                    logits = torch.stack([(q[n, sl, y, x] * k[b, sl, yy, xx]).sum() + win.pos_bias[h, i]
                                          for i, yy, xx in cells])
                    out[n, h, [i for i, _, _ in cells], y, x] = logits.softmax(0)
    return out


def _window_attention_by_hand(win: ReferenceWindowAttention, z: Tensor, ref: Tensor) -> Tensor:
    """The window step written cell by cell, from :func:`_window_attention_weights`."""
    N, C, H, W = z.shape
    B, r, hd = ref.shape[0], win.radius, win.HEAD_DIM
    attn = _window_attention_weights(win, z, ref)
    v = torch.nn.functional.pad(win.kv(ref).chunk(2, dim=1)[1], (r, r, r, r))  # zero outside: its weights are zero there
    read = torch.zeros(N, win.dim, H, W)
    for n in range(N):
        b = n // (N // B)
        for i, (dy, dx) in enumerate((dy, dx) for dy in range(2 * r + 1) for dx in range(2 * r + 1)):
            a = attn[n, :, i].repeat_interleave(hd, dim=0)  # (dim, H, W): each head's weight on its channels
            read[n] += a * v[b, :, dy:dy + H, dx:dx + W]
    return z + win.out(torch.nn.functional.gelu(win.out_in(torch.cat([read, z], dim=1))))


def test_sr_reference_window_reads_the_reference_near_each_cell(preset: ModelPreset) -> None:
    cfg = preset.sr
    assert cfg.ref_window_radius == 2  # the tiny preset's SR reads the reference at full latent resolution
    torch.manual_seed(5)
    win = ReferenceWindowAttention(cfg.channels, 32, 16, radius=2).eval()
    C = cfg.channels
    z, ref = torch.randn(4, C, 7, 6), torch.randn(2, C, 7, 6)  # 2 references x 2 frames each
    with torch.no_grad():
        assert torch.equal(win(z, ref), z)  # starts as a no-op (its last conv is zero)
        torch.nn.init.normal_(win.out.weight, std=0.1)
        torch.nn.init.normal_(win.pos_bias, std=2.0)
        out = win(z, ref)
        torch.testing.assert_close(out, _window_attention_by_hand(win, z, ref), atol=1e-5, rtol=0)
        # its other form, the keys gathered per cell once (the decoder's in a render), computes the same,
        # on channels-last frames too (the decoder's), and so does the expected offset it reads from
        keys = win.read(ref)
        torch.testing.assert_close(win(z, keys), out, atol=1e-5, rtol=0)
        torch.testing.assert_close(win(z.contiguous(memory_format=torch.channels_last), keys), out, atol=1e-5, rtol=0)
        (_, slid, slid_spread), (_, gathered, spread) = win.forward_with_offset(z, ref), win.forward_with_offset(z, keys)
        torch.testing.assert_close(gathered, slid, atol=1e-5, rtol=0)
        torch.testing.assert_close(spread, slid_spread, atol=1e-4, rtol=0)
        assert slid.shape == (4, 2, 7, 6) and float(slid.abs().max()) > 0.1
        # the spread is the attention's variance over the window's offsets, averaged over the heads
        attn = _window_attention_weights(win, z, ref)  # (N, heads, K, H, W)
        shifts = win._shifts(attn)
        mean = torch.einsum("nhkyx,kc->nhcyx", attn, shifts)
        var = torch.einsum("nhkyx,k->nhyx", attn, shifts.pow(2).sum(dim=1)) - mean.pow(2).sum(dim=2)
        torch.testing.assert_close(spread[:, 0], var.mean(dim=1), atol=1e-4, rtol=0)
        assert float(spread.min()) >= 0.0 and float(spread.max()) > 0.1
        with pytest.raises(ValueError, match="pass one reference per T frames, at the frames' resolution"):
            win(z[:, :, :6], keys)
        # a reference cell reaches an output cell only within radius + 3 (the k/v conv, the two out convs)
        ref2 = ref.clone()
        ref2[:, :, 0, 0] += 5.0
        moved = (win(z, ref2) - out).abs().amax(dim=(0, 1))  # (H, W)
    assert float(moved[:6, :6].max()) > 1e-3
    assert float(moved[6:].max()) == 0.0  # rows 6.. are more than 5 cells from (0, 0)
    # a reference map wider than the frames' (the VAE decoder's: its features and the reference's pixels)
    wide = ReferenceWindowAttention(C, 32, 16, radius=1, ref_channels=C + 5).eval()
    ref_wide = torch.randn(2, C + 5, 7, 6)
    with torch.no_grad():
        torch.nn.init.normal_(wide.out.weight, std=0.1)
        torch.testing.assert_close(wide(z, ref_wide), _window_attention_by_hand(wide, z, ref_wide), atol=1e-5, rtol=0)


def test_sr_more_reference_window_steps_grow_from_a_one_step_checkpoint(tmp_path: Path, preset: ModelPreset) -> None:
    """``ref_window_layers`` 2: a second window step after the first. A one-step checkpoint loads into it
    with ``allow_missing=GROWN_PARTS`` and computes exactly what it computed (the new step starts as a
    no-op); strict loads still name the missing step; trained, the second step changes the output."""
    one = SRDiT(dataclasses.replace(preset.sr, ref_window_layers=1)).eval()
    torch.manual_seed(2)
    with torch.no_grad():  # a trained-looking first step (its out conv is not zero)
        for t in one.parameters():
            t.add_(0.05 * torch.randn_like(t))
    path = tmp_path / "one.safetensors"
    save_checkpoint({"sr": one}, path)
    two = SRDiT(dataclasses.replace(preset.sr, ref_window_layers=2)).eval()
    assert len(two.ref_window_more) == 1 and preset.sr.ref_window_layers == 2  # tiny's since the seventh
    with pytest.raises(CheckpointError, match=r"missing key.*sr\.ref_window_more\.0\."):
        load_checkpoint({"sr": two}, path)
    load_checkpoint({"sr": two}, path, allow_missing=GROWN_PARTS)
    g = torch.Generator().manual_seed(3)
    lr = torch.randn(2, preset.sr.channels, 3, *preset.lr_latent_hw, generator=g)
    ref = torch.randn(2, preset.sr.channels, *preset.hr_latent_hw, generator=g)
    with torch.no_grad():
        assert torch.equal(two(lr, ref), one(lr, ref))
        torch.nn.init.normal_(two.ref_window_more[0].out.weight, std=0.1)
        assert float((two(lr, ref) - one(lr, ref)).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="ref_window_layers=0"):
        SRDiT(dataclasses.replace(preset.sr, ref_window_layers=0))


# ---------------------------------------------------------------- DiT


def _dit_inputs(preset: ModelPreset, T: int, seed: int = 5) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    assert preset.text is not None
    known = torch.zeros(1, T, dtype=torch.bool)
    known[:, : preset.context_frames] = True
    text_mask = torch.zeros(1, 12, dtype=torch.bool)
    text_mask[:, :7] = True
    return {
        "x_BCThw": torch.randn(1, preset.latent_channels, T, *preset.lr_latent_hw, generator=g),
        "t_B": torch.tensor([0.6]),
        "known_BT": known,
        "frame_index_BT": torch.arange(T)[None] + 32,
        "ref_BCHW": torch.randn(1, preset.latent_channels, *preset.hr_latent_hw, generator=g),
        "audio_BTD": torch.randn(1, T, preset.dit.audio_dim, generator=g),
        "text_BND": torch.randn(1, 12, preset.text.dim, generator=g),
        "text_mask_BN": text_mask,
    }


def test_dit_shape_and_translation_invariance(mods: dict[str, torch.nn.Module], preset: ModelPreset) -> None:
    dit = mods["a2v"]
    inp = _dit_inputs(preset, T=8)
    with torch.no_grad():
        v = dit(**inp)
        shifted = dit(**{**inp, "frame_index_BT": inp["frame_index_BT"] + 15_000})  # ten minutes later
        gapped = dit(**{**inp, "frame_index_BT": inp["frame_index_BT"] * 2})  # different offsets
    assert v.shape == inp["x_BCThw"].shape and torch.isfinite(v).all()
    torch.testing.assert_close(shifted, v, atol=1e-5, rtol=0)
    assert (gapped - v).abs().max() > 1e-4  # relative offsets do matter


def test_dit_known_mask_and_conditioning_matter(
    mods: dict[str, torch.nn.Module], preset: ModelPreset
) -> None:
    dit = mods["a2v"]
    inp = _dit_inputs(preset, T=6)
    with torch.no_grad():
        v = dit(**inp)
        none_known = dit(**{**inp, "known_BT": torch.zeros_like(inp["known_BT"])})
        other_audio = dit(**{**inp, "audio_BTD": inp["audio_BTD"].roll(1, dims=1)})
        no_text = dit(**{**inp, "text_BND": None, "text_mask_BN": None})
        padded = inp["text_BND"].clone()
        padded[:, 7:] = 100.0  # masked text tokens must not matter
        masked_text = dit(**{**inp, "text_BND": padded})
    for other in (none_known, other_audio, no_text):
        assert (other - v).abs().max() > 1e-4
    torch.testing.assert_close(masked_text, v, atol=1e-5, rtol=0)


def test_dit_rejects_mismatched_audio(mods: dict[str, torch.nn.Module], preset: ModelPreset) -> None:
    inp = _dit_inputs(preset, T=4)
    with pytest.raises(ValueError, match="audio_BTD"):
        mods["a2v"](**{**inp, "audio_BTD": inp["audio_BTD"][:, :3]})


# ---------------------------------------------------------------- sampler


def test_sampler_schedule() -> None:
    ts = FlowMatchEulerSampler(6, 3.0).timesteps()
    assert ts.shape == (7,) and ts[0] == 1.0 and ts[-1] == 0.0
    assert (ts[1:] < ts[:-1]).all()
    plain = FlowMatchEulerSampler(6, 1.0).timesteps()
    torch.testing.assert_close(plain, torch.linspace(1, 0, 7))
    assert (ts[1:-1] > plain[1:-1]).all()  # shift > 1 stays longer near noise
    with pytest.raises(ValueError, match="num_steps"):
        FlowMatchEulerSampler(0, 1.0)


def test_sampler_recovers_x0_and_keeps_known_frames() -> None:
    g = torch.Generator().manual_seed(6)
    x0 = torch.randn(2, 4, 5, 3, 3, generator=g)
    noise = torch.randn(2, 4, 5, 3, 3, generator=g)
    clean = torch.randn(2, 4, 5, 3, 3, generator=g)
    known = torch.zeros(2, 5, dtype=torch.bool)
    known[0, :2] = True
    known[1, 4] = True
    calls: list[Tensor] = []

    def velocity(x: Tensor, t_B: Tensor) -> Tensor:
        # exact field of the flow whose data distribution is the point x0: v = (x_t - x0) / t
        calls.append(t_B)
        assert t_B.shape == (2,)
        return (x - x0) / t_B[:, None, None, None, None]

    out = FlowMatchEulerSampler(4, 5.0).sample(velocity, noise, clean, known)
    assert len(calls) == 4
    keep = known[:, None, :, None, None].expand_as(out)
    assert torch.equal(out[keep], clean[keep])
    torch.testing.assert_close(out[~keep], x0[~keep], atol=1e-5, rtol=0)


def test_sampler_from_a_prior_starts_on_its_line_to_the_noise() -> None:
    s = FlowMatchEulerSampler(5, 3.0)
    assert torch.equal(s.timesteps(1.0), s.timesteps())  # start 1: the plain schedule, bit for bit
    ts = s.timesteps(0.6)
    assert ts.shape == (6,) and ts[-1] == 0.0 and (ts[1:] < ts[:-1]).all()
    torch.testing.assert_close(ts[0], torch.tensor(0.6))
    # the same shifted curve, cut at 0.6: every time of the cut schedule solves t' = 3t / (1 + 2t)
    # for a t on a uniform grid from the t of 0.6
    u = ts.double() / (3.0 - 2.0 * ts.double())
    torch.testing.assert_close(u[1:] - u[:-1], torch.full((5,), -float(u[0]) / 5, dtype=torch.float64))
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="start="):
            s.timesteps(bad)

    g = torch.Generator().manual_seed(7)
    x0, noise, prior, clean = (torch.randn(1, 3, 4, 2, 2, generator=g) for _ in range(4))
    known = torch.tensor([[True, False, False, False]])
    first: list[Tensor] = []

    def velocity(x: Tensor, t_B: Tensor) -> Tensor:  # the exact velocity towards x0
        if not first:
            first.append(x.clone())
        return (x - x0) / t_B[:, None, None, None, None]

    out = s.sample(velocity, noise, clean, known, prior, 0.6)
    start = 0.4 * prior + 0.6 * noise
    torch.testing.assert_close(first[0][:, :, 1:], start[:, :, 1:])  # unknown frames: on the line
    assert torch.equal(first[0][:, :, :1], clean[:, :, :1]) and torch.equal(out[:, :, :1], clean[:, :, :1])
    torch.testing.assert_close(out[:, :, 1:], x0[:, :, 1:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="needs prior_BCThw"):
        s.sample(velocity, noise, clean, known, None, 0.6)
    with pytest.raises(ValueError, match="needs prior_BCThw"):
        s.sample(velocity, noise, clean, known, prior[:, :, :2], 0.6)
    # start 1 ignores the prior: the plain sampler's result
    assert torch.equal(s.sample(velocity, noise, clean, known, prior, 1.0), s.sample(velocity, noise, clean, known))


def test_sampler_per_frame_starts_equal_each_window_sampled_alone() -> None:
    # the A2V's packed N and I windows from their kinds' starts: one sampling of the same steps, each
    # frame on its own start's schedule, bit for bit what its window's own sampling gives
    s = FlowMatchEulerSampler(5, 3.0)
    g = torch.Generator().manual_seed(8)
    x0, noise, prior, clean = (torch.randn(1, 3, 7, 2, 2, generator=g) for _ in range(4))
    known = torch.tensor([[True, False, False, True, False, False, False]])
    seen: list[Tensor] = []

    def velocity(x: Tensor, t: Tensor) -> Tensor:  # the exact velocity towards x0, times per frame
        seen.append(t)
        tt = t[:, None, :, None, None] if t.dim() == 2 else t[:, None, None, None, None]
        return (x - x0) / tt

    per_frame = [0.15] * 3 + [0.6] * 4  # window a: frames 0-2 (start 0.15), window b: 3-6 (0.6)
    packed = s.sample(velocity, noise, clean, known, prior, per_frame)
    assert [tuple(t.shape) for t in seen] == [(1, 7)] * 5
    assert all(torch.equal(t[0, :3], s.timesteps(0.15)[i].expand(3)) and torch.equal(t[0, 3:], s.timesteps(0.6)[i].expand(4))
               for i, t in enumerate(seen))

    def alone(lo: int, hi: int, start: float) -> Tensor:
        def v(x: Tensor, t: Tensor) -> Tensor:
            return (x - x0[:, :, lo:hi]) / t[:, None, None, None, None]
        return s.sample(v, noise[:, :, lo:hi], clean[:, :, lo:hi], known[:, lo:hi], prior[:, :, lo:hi], start)

    assert torch.equal(packed[:, :, :3], alone(0, 3, 0.15)) and torch.equal(packed[:, :, 3:], alone(3, 7, 0.6))
    # a window from pure noise beside one from a guess: its frames start on the noise, its guess unused
    mixed = s.sample(velocity, noise, clean, known, prior, [1.0] * 3 + [0.6] * 4)
    assert torch.equal(mixed[:, :, :3], s.sample(lambda x, t: (x - x0[:, :, :3]) / t[:, None, None, None, None],
                                                   noise[:, :, :3], clean[:, :, :3], known[:, :3]))
    with pytest.raises(ValueError, match="7 frames"):
        s.sample(velocity, noise, clean, known, prior, [0.6] * 6)
    with pytest.raises(ValueError, match="start="):
        s.sample(velocity, noise, clean, known, prior, [0.6] * 6 + [0.0])


# ---------------------------------------------------------------- checkpoint


def test_build_modules_is_deterministic(preset: ModelPreset) -> None:
    state = torch.random.get_rng_state()
    a, b, c = build_modules(preset, seed=1), build_modules(preset, seed=1), build_modules(preset, seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert set(a) == {"a2v", "sr", "vae", "audio", "text"}
    for name in a:
        for (k, x), y in zip(a[name].state_dict().items(), b[name].state_dict().values(), strict=True):
            assert torch.equal(x, y), k
    assert not torch.equal(a["a2v"].head.weight, c["a2v"].head.weight)


def test_checkpoint_round_trip(tmp_path: Path, preset: ModelPreset, mods: dict[str, torch.nn.Module]) -> None:
    path = tmp_path / "ck" / "tiny.safetensors"
    save_checkpoint(mods, path, metadata={"preset": "tiny", "step": "7"})
    fresh = build_modules(preset, seed=9)
    meta = load_checkpoint(fresh, path)
    assert meta["preset"] == "tiny" and meta["step"] == "7"
    for name in mods:
        for (k, x), y in zip(mods[name].state_dict().items(), fresh[name].state_dict().values(), strict=True):
            assert torch.equal(x, y), f"{name}.{k}"
    # a subset loads; key_map renames keys of a foreign file
    sub = {"sr": build_modules(preset, seed=9)["sr"]}
    load_checkpoint(sub, path)
    assert torch.equal(sub["sr"].head.weight, mods["sr"].head.weight)
    from safetensors.torch import load_file, save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"model." + k: v for k, v in load_file(str(path)).items() if k.startswith("sr.")}, str(foreign))
    sub = {"sr": build_modules(preset, seed=9)["sr"]}
    load_checkpoint(sub, foreign, key_map=lambda k: k.removeprefix("model."))
    assert torch.equal(sub["sr"].head.weight, mods["sr"].head.weight)


def test_checkpoint_errors(tmp_path: Path, preset: ModelPreset, mods: dict[str, torch.nn.Module]) -> None:
    from safetensors.torch import load_file, save_file

    missing_file = tmp_path / "nope.safetensors"
    with pytest.raises(CheckpointError, match="nope.safetensors.*does not exist"):
        load_checkpoint(mods, missing_file)
    path = tmp_path / "full.safetensors"
    save_checkpoint(mods, path)
    tensors = load_file(str(path))

    def write(name: str, t: dict[str, Tensor]) -> Path:
        p = tmp_path / name
        save_file(t, str(p))
        return p

    no_head = write("missing.safetensors", {k: v for k, v in tensors.items() if k != "a2v.head.weight"})
    with pytest.raises(CheckpointError, match=r"missing key.*a2v\.head\.weight"):
        load_checkpoint(mods, no_head)
    load_checkpoint({"sr": build_modules(preset)["sr"]}, no_head)  # not asked for: fine
    load_checkpoint(build_modules(preset), no_head, strict=False)
    # allow_missing: a file from before a module grew a part (the SR's reference window) warm-starts
    # it; the part keeps its init, every other key stays strict
    no_window = write("no_window.safetensors", {k: v for k, v in tensors.items() if not k.startswith("sr.ref_window.")})
    grown = build_modules(preset, seed=3)
    init_window = grown["sr"].state_dict()["ref_window.q.weight"].clone()
    load_checkpoint(grown, no_window, allow_missing=("sr.ref_window.",))
    assert torch.equal(grown["sr"].state_dict()["ref_window.q.weight"], init_window)
    assert torch.equal(grown["sr"].head.weight, mods["sr"].head.weight)
    with pytest.raises(CheckpointError, match=r"missing key.*sr\.ref_window\."):
        load_checkpoint(grown, no_window)
    with pytest.raises(CheckpointError, match=r"missing key.*a2v\.head\.weight"):
        load_checkpoint(mods, no_head, allow_missing=("sr.ref_window.",))

    extra = write("extra.safetensors", {**tensors, "vae.decoder.bogus": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected key.*vae\.decoder\.bogus"):
        load_checkpoint(mods, extra)

    bad = dict(tensors)
    bad["sr.head.weight"] = torch.zeros(3, 3)
    bad_shape = write("shape.safetensors", bad)
    target = build_modules(preset, seed=5)
    before = target["a2v"].head.weight.clone()
    with pytest.raises(CheckpointError, match=r"shape mismatch.*sr\.head\.weight.*\(3, 3\)"):
        load_checkpoint(target, bad_shape, strict=False)
    assert torch.equal(target["a2v"].head.weight, before)  # nothing loaded half-way

    # preset=: the file must say it was saved for that preset, checked before any tensor is read
    tiny = tmp_path / "tiny.safetensors"
    save_checkpoint(mods, tiny, metadata={"preset": "tiny"})
    assert load_checkpoint(build_modules(preset), tiny, preset="tiny")["preset"] == "tiny"
    for wrong, found in ((tiny, "'tiny'"), (path, "None")):  # another preset; no preset in the metadata
        with pytest.raises(CheckpointError, match=f"is of preset {found}, not '14b'.*14b.safetensors"):
            load_checkpoint(build_modules(preset), wrong, preset="14b")

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="junk.safetensors"):
        load_checkpoint(mods, junk)


def test_large_preset_layout_runs_when_shrunk() -> None:
    """The 1.3b preset's layout (16 channels, lowres factor 2, non-square 480p latents) runs end to end
    with widths shrunk so the test stays small: catches shape bugs the tiny square preset cannot."""
    p = get_preset("1.3b")
    dit_cfg = dataclasses.replace(
        p.dit, dim=48, num_layers=1, num_heads=2, ffn_dim=64, audio_token_dim=16, freq_dim=32
    )
    sr_cfg = dataclasses.replace(p.sr, dim=48, num_layers=1, num_heads=2, ffn_dim=64)
    torch.manual_seed(0)
    dit, sr = A2VDiT(dit_cfg).eval(), SRDiT(sr_cfg).eval()
    h, w = 6, 10  # a crop of the 30x52 low-res latent
    T = 3
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, p.latent_channels, h * p.lowres_factor, w * p.lowres_factor, generator=g)
    with torch.no_grad():
        v = dit(
            torch.randn(1, p.latent_channels, T, h, w, generator=g),
            torch.tensor([0.3]),
            torch.tensor([[True, False, False]]),
            torch.arange(T)[None],
            ref,
            torch.randn(1, T, p.dit.audio_dim, generator=g),
        )
        hr = sr(torch.randn(1, p.latent_channels, T, h, w, generator=g), ref)
    assert v.shape == (1, p.latent_channels, T, h, w)
    assert hr.shape == (1, p.latent_channels, T, h * p.lowres_factor, w * p.lowres_factor)


def test_modules_run_in_bfloat16(preset: ModelPreset) -> None:
    """GPUs run these in bf16: every module must accept its own dtype end to end (DSP stays fp32)."""
    m = {k: v.eval().to(torch.bfloat16) for k, v in build_modules(preset, seed=0).items()}
    bf = torch.bfloat16
    T, c = 3, preset.latent_channels
    with torch.no_grad():
        feats = m["audio"](torch.randn(1, m["audio"].num_samples(T)).to(bf), T)
        text, mask = m["text"](["hi"])
        ref = torch.randn(1, c, *preset.hr_latent_hw, dtype=bf)
        known = torch.tensor([[True, False, False]])
        v = m["a2v"](
            torch.randn(1, c, T, *preset.lr_latent_hw, dtype=bf),
            torch.tensor([0.5], dtype=bf),
            known,
            torch.arange(T)[None],
            ref,
            feats,
            text,
            mask,
        )
        hr = m["sr"](torch.randn(1, c, T, *preset.lr_latent_hw, dtype=bf), ref)
        # a decoder that reads the reference (the tiny preset's, if it does) is given it
        dec_ref = m["vae"].reference_features(torch.rand(1, 3, 32, 32, dtype=bf) * 2 - 1)
        rgb, cache = m["vae"].decode(torch.randn(1, c, 2, 4, 4, dtype=bf), reference=dec_ref)
    for out in (feats, text, v, hr, rgb, *cache):
        assert out.dtype == bf and torch.isfinite(out.float()).all()


@torch.no_grad()
def test_dit_packed_windows_equal_each_window_alone(mods: dict[str, torch.nn.Module], preset: ModelPreset) -> None:
    # the pipeline's batched steps (I_{k-1} with N_{k+1}): two windows packed along T, each attending
    # only to itself, with positions from its own start; each window's velocity is its own forward's
    dit = mods["a2v"]
    cfg = preset.dit
    h, w = preset.lr_latent_hw
    g = torch.Generator().manual_seed(4)
    ref = torch.randn(2, cfg.ref_channels, 2 * h, 2 * w, generator=g)
    ctx = dit.embed_context(ref)  # type: ignore[operator]

    def window(T: int, start: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        known = torch.zeros(2, T, dtype=torch.bool)
        known[:, :2] = True
        return (torch.randn(2, cfg.in_channels, T, h, w, generator=g), known,
                torch.arange(start, start + T)[None].expand(2, -1), torch.randn(2, T, cfg.audio_dim, generator=g))

    a, b = window(6, 4000), window(21, 31)  # positions far apart: only offsets inside a window count
    t = torch.tensor([0.7, 0.3])
    alone = [dit(x, t, k, i, ref, au, context=ctx) for x, k, i, au in (a, b)]
    packed = dit(torch.cat([a[0], b[0]], 2), t, torch.cat([a[1], b[1]], 1), torch.cat([a[2], b[2]], 1), ref,
                 torch.cat([a[3], b[3]], 1), context=ctx, windows=(6, 21))
    assert torch.equal(packed[:, :, :6], alone[0]) and torch.equal(packed[:, :, 6:], alone[1])
    # without windows the two would attend to each other: not the same thing
    mixed = dit(torch.cat([a[0], b[0]], 2), t, torch.cat([a[1], b[1]], 1), torch.cat([a[2], b[2]], 1), ref,
                torch.cat([a[3], b[3]], 1), context=ctx)
    assert not torch.allclose(mixed[:, :, :6], alone[0], atol=1e-3)
    with pytest.raises(ValueError, match="summing to T"):
        dit(a[0], t, a[1], a[2], ref, a[3], context=ctx, windows=(3, 2))
    # a time per frame: each packed window at its own time (windows sampled from different starts)
    t_a, t_b = torch.tensor([0.15, 0.4]), torch.tensor([0.6, 0.9])
    alone = [dit(x, tw, k, i, ref, au, context=ctx) for (x, k, i, au), tw in ((a, t_a), (b, t_b))]
    per_frame = torch.cat([t_a[:, None].expand(2, 6), t_b[:, None].expand(2, 21)], 1)
    packed = dit(torch.cat([a[0], b[0]], 2), per_frame, torch.cat([a[1], b[1]], 1), torch.cat([a[2], b[2]], 1), ref,
                 torch.cat([a[3], b[3]], 1), context=ctx, windows=(6, 21))
    assert torch.equal(packed[:, :, :6], alone[0]) and torch.equal(packed[:, :, 6:], alone[1])
    same = dit(a[0], t_a[:, None].expand(2, 6), a[1], a[2], ref, a[3], context=ctx)  # (B, T) of one time = (B,)
    assert torch.equal(same, alone[0])
    with pytest.raises(ValueError, match="t_B"):
        dit(a[0], per_frame, a[1], a[2], ref, a[3], context=ctx)
