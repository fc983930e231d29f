"""The tiny family's per-request options (``RenderRequest.options``): ``audio_guidance``,
``audio_guidance_peak``, ``steps``, ``start_noise`` and ``interp_start_noise``,
checked by ``TinyFamily.options`` (the bound check wan uses, ``pipeline.model_family.check_option``)
and read by the context and A2V stages at run time, so one warm pipeline serves every request."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from bench.inputs import DEMO_IMAGE
from models.presets import ModelPreset, get_preset
from pipeline.errors import InvalidInputError
from pipeline.families import FAMILIES
from pipeline.families.tiny import OPTION_BOUNDS
from pipeline.families.tiny import ports as P
from pipeline.family_runtime import WARM_FAMILIES, FamilyRuntime
from pipeline.render import render
from pipeline.request import RenderRequest

TINY = FAMILIES.get("tiny")
# the tiny preset's start_noise, interp_start_noise and guidance (models/checkpoints/MODEL_CARD.md); its
# guidance has no peak (the same on every cell); PEAK is the peak measured beside it
START = 0.6
INTERP_START = 0.1
GUIDANCE = 2.0
PEAK = 7.0


def test_defaults_are_the_presets_values() -> None:
    p = get_preset("tiny")
    assert p.audio_guidance_peak is None and p.audio_guidance_focus == 4.0
    assert TINY.options(p, {}) == {"audio_guidance": p.audio_guidance, "audio_guidance_peak": p.audio_guidance,
                                   "steps": p.num_steps, "start_noise": p.start_noise,
                                   "interp_start_noise": p.interp_start_noise} == {
        "audio_guidance": GUIDANCE, "audio_guidance_peak": GUIDANCE, "steps": 5, "start_noise": START,
        "interp_start_noise": INTERP_START}
    # the default follows the preset (a preset patched to guidance 1 / 8 steps / noise defaults to them)
    patched = dataclasses.replace(p, audio_guidance=1.0, audio_guidance_peak=2.0, num_steps=8, start_noise=1.0,
                                  interp_start_noise=0.5)
    assert TINY.options(patched, {}) == {"audio_guidance": 1.0, "audio_guidance_peak": 2.0, "steps": 8,
                                         "start_noise": 1.0, "interp_start_noise": 0.5}
    # without a peak in the preset the peak is the request's guidance, the same guidance on every cell;
    # a preset's peak stays the peak whatever the request's guidance
    assert TINY.options(p, {"audio_guidance": 2})["audio_guidance_peak"] == 2.0
    assert TINY.options(p, {"audio_guidance": 2, "audio_guidance_peak": 6})["audio_guidance_peak"] == 6.0
    peaked = dataclasses.replace(p, audio_guidance_peak=PEAK)
    assert TINY.options(peaked, {"audio_guidance": 2})["audio_guidance_peak"] == PEAK
    # values within the bounds, each as its option's type (an int option takes an integral float)
    opts = TINY.options(p, {"audio_guidance": 2, "audio_guidance_peak": 4, "steps": 3.0, "start_noise": 1,
                            "interp_start_noise": 1})
    assert opts == {"audio_guidance": 2.0, "audio_guidance_peak": 4.0, "steps": 3, "start_noise": 1.0,
                    "interp_start_noise": 1.0}
    assert type(opts["audio_guidance"]) is float and type(opts["steps"]) is int and type(opts["start_noise"]) is float
    assert type(opts["interp_start_noise"]) is float and type(opts["audio_guidance_peak"]) is float
    assert TINY.options(p, {"audio_guidance": 10, "audio_guidance_peak": 1, "steps": 50, "start_noise": 0.1,
                            "interp_start_noise": 0.1}) == {
        "audio_guidance": 10.0, "audio_guidance_peak": 1.0, "steps": 50, "start_noise": 0.1, "interp_start_noise": 0.1}
    assert TINY.options(p, {"audio_guidance": 1.0, "steps": 1}) == {"audio_guidance": 1.0, "audio_guidance_peak": 1.0,
                                                                     "steps": 1, "start_noise": START,
                                                                     "interp_start_noise": INTERP_START}
    assert OPTION_BOUNDS == {"audio_guidance": (float, 1.0, 10.0), "audio_guidance_peak": (float, 1.0, 10.0),
                             "steps": (int, 1, 50), "start_noise": (float, 0.1, 1.0),
                             "interp_start_noise": (float, 0.1, 1.0)}
    with pytest.raises(ValueError, match="audio_guidance_focus=0.0 must be > 0"):
        dataclasses.replace(p, audio_guidance_focus=0.0)


@pytest.mark.parametrize(("key", "value"), [
    ("audio_guidance", 0.5), ("audio_guidance", 10.5), ("audio_guidance", "2"), ("audio_guidance", True),
    ("audio_guidance", math.nan), ("audio_guidance", math.inf), ("audio_guidance", None),
    ("steps", 0), ("steps", 51), ("steps", 2.5), ("steps", "5"), ("steps", True), ("steps", 10**400),
    ("start_noise", 0.0), ("start_noise", 0.05), ("start_noise", 1.5), ("start_noise", math.nan), ("start_noise", "1"),
    ("interp_start_noise", 0.0), ("interp_start_noise", 1.01), ("interp_start_noise", None),
    ("audio_guidance_peak", 0.9), ("audio_guidance_peak", 11), ("audio_guidance_peak", "7"),
])
def test_a_bad_value_names_the_key_value_bounds_and_default(key: str, value: object) -> None:
    with pytest.raises(InvalidInputError) as err:
        TINY.options(get_preset("tiny"), {key: value})  # type: ignore[dict-item]
    assert err.value.field == f"options.{key}"
    bounds, default = {"audio_guidance": ("float in [1, 10]", repr(GUIDANCE)), "steps": ("int in [1, 50]", "5"),
                       "audio_guidance_peak": ("float in [1, 10]", repr(GUIDANCE)),
                       "start_noise": ("float in [0.1, 1]", repr(START)),
                       "interp_start_noise": ("float in [0.1, 1]", repr(INTERP_START))}[key]
    assert str(err.value) == f"options.{key}={value!r}: must be {bounds} (preset 'tiny' default {default})"


def test_an_unknown_key_names_the_keys_tiny_takes() -> None:
    with pytest.raises(InvalidInputError) as err:  # wan's keys are not tiny's
        TINY.options(get_preset("tiny"), {"steps": 3, "text_guidance": 5.0})
    assert err.value.field == "options.text_guidance"
    assert str(err.value) == "options.text_guidance: the tiny family takes ['audio_guidance', 'audio_guidance_peak', 'interp_start_noise', 'start_noise', 'steps']"


def test_wan_refuses_through_the_same_check() -> None:
    from pipeline.families.wan.presets import PRESETS

    wan = FAMILIES.get("wan")
    with pytest.raises(InvalidInputError) as err:
        wan.options(PRESETS["infinitetalk"], {"audio_guidance": True})
    assert err.value.field == "options.audio_guidance"
    assert str(err.value) == "options.audio_guidance=True: must be float in [1, 20] (preset 'infinitetalk' default 4.0)"
    with pytest.raises(InvalidInputError, match=r"the wan family takes \['audio_guidance', 'conditioning'"):
        wan.options(PRESETS["infinitetalk"], {"cfg": 1})


class _Spy:
    """What the tiny pipeline's A2V sees: the silence features the context stage produced per step,
    and the batch size of every DiT forward (2: audio + silence; 1: no guidance)."""

    def __init__(self, runtime: FamilyRuntime) -> None:
        self.silent: list[object] = []
        self.forwards: list[int] = []
        self.a2v = runtime.pipeline.step_stages[1]
        self.dit = runtime.modules["a2v"].get()

    def __enter__(self) -> _Spy:
        prepare = self.a2v.prepare  # type: ignore[attr-defined]

        def spy(values):  # type: ignore[no-untyped-def]
            self.silent.append(values.get_optional(P.AUDIO_FEATS_SILENT))
            return prepare(values)

        self.a2v.prepare = spy  # type: ignore[attr-defined]
        self.hook = self.dit.register_forward_pre_hook(lambda m, args: self.forwards.append(args[0].shape[0]))
        return self

    def __exit__(self, *exc: object) -> None:
        self.hook.remove()
        del self.a2v.prepare  # type: ignore[attr-defined]  # the class's method again


def _render(request: RenderRequest, runtime: FamilyRuntime) -> tuple[np.ndarray, _Spy]:
    parts: list[tuple[int, np.ndarray]] = []
    with _Spy(runtime) as spy:
        render(request, [], family=runtime, frame_tap=lambda f0, fr: parts.append((f0, fr.copy())))
    parts.sort(key=lambda p: p[0])
    return np.concatenate([p[1] for p in parts]), spy


def _runtime(preset: ModelPreset | None = None) -> FamilyRuntime:
    if preset is None:  # what render() uses for a default request
        return WARM_FAMILIES.get(TINY, "tiny")
    return FamilyRuntime(TINY, preset, TINY.default_checkpoint(get_preset("tiny")))


def test_audio_guidance_reaches_the_context_and_a2v_stages(speech) -> None:  # type: ignore[no-untyped-def]
    audio = speech(0.64)  # 16 frames: N0 only
    request = RenderRequest(image=DEMO_IMAGE, audio=audio, seed=2)
    warm = _runtime()
    default, d = _render(request, warm)
    assert d.forwards and set(d.forwards) == {2}  # guided: audio and silence in one forward
    assert d.silent and all(isinstance(s, torch.Tensor) for s in d.silent)
    explicit, _ = _render(dataclasses.replace(request, options={"audio_guidance": GUIDANCE, "steps": 5}), warm)
    assert np.array_equal(explicit, default)  # the defaults are the preset's: the same frames

    # guidance 1 by request on the guided preset: no silent half, one forward per sampler step, and the
    # frames of a preset whose guidance is 1
    off, o = _render(dataclasses.replace(request, options={"audio_guidance": 1.0}), warm)
    assert o.silent and all(s is None for s in o.silent)
    assert set(o.forwards) == {1} and len(o.forwards) == len(d.forwards)
    assert off.shape == default.shape and not np.array_equal(off, default)
    unguided_preset = _runtime(dataclasses.replace(get_preset("tiny"), audio_guidance=1.0))
    preset_off, p = _render(request, unguided_preset)
    assert np.array_equal(off, preset_off) and set(p.forwards) == {1}

    # the preset's guidance by request on a preset with 1: the silence features are computed all the same
    on, n = _render(dataclasses.replace(request, options={"audio_guidance": GUIDANCE}), unguided_preset)
    assert n.silent and all(isinstance(s, torch.Tensor) for s in n.silent) and set(n.forwards) == {2}
    assert np.array_equal(on, default)


def test_steps_reach_the_sampler_with_batched_steps(speech) -> None:  # type: ignore[no-untyped-def]
    # 2.6 s: N0 N1 I0 N2 I1 N3 I2 N4 -> 5 groups of batched steps (I0+N2, I1+N3, I2+N4 packed)
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(2.6), seed=11, options={"steps": 3})
    warm = _runtime()
    assert warm.batch_steps
    three, t = _render(request, warm)
    assert len(t.forwards) == 5 * 3  # one DiT forward per sampler step per group
    warm.batch_steps = False
    try:
        sequential, s = _render(request, warm)
    finally:
        warm.batch_steps = True
    assert len(s.forwards) == 8 * 3 and np.array_equal(three, sequential)
    default, d = _render(dataclasses.replace(request, options={}), warm)
    assert len(d.forwards) == 5 * 5 and three.shape == default.shape and not np.array_equal(three, default)
    # the same frames as a preset whose own steps are 3
    preset_three, _ = _render(dataclasses.replace(request, options={}),
                              _runtime(dataclasses.replace(get_preset("tiny"), num_steps=3)))
    assert np.array_equal(three, preset_three)


def test_start_noise_reaches_the_sampler_and_1_is_the_plain_sampler(speech) -> None:  # type: ignore[no-untyped-def]
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(1.0), seed=4)  # N0 N1 I0 (batched: N0, N1, I0)
    warm = _runtime()
    default, d = _render(request, warm)
    plain_options = {"start_noise": 1.0, "interp_start_noise": 1.0}
    plain, q = _render(dataclasses.replace(request, options=plain_options), warm)
    assert len(q.forwards) == len(d.forwards)  # the same steps, from another time: the same cost
    assert plain.shape == default.shape and not np.array_equal(plain, default)
    # by request or by the preset: the same frames
    preset_plain, _ = _render(request, _runtime(dataclasses.replace(get_preset("tiny"), **plain_options)))
    assert np.array_equal(plain, preset_plain)
    explicit, _ = _render(dataclasses.replace(
        request, options={"start_noise": START, "interp_start_noise": INTERP_START}), warm)
    assert np.array_equal(explicit, default)


def test_interp_start_noise_reaches_the_i_chunks_only(speech) -> None:  # type: ignore[no-untyped-def]
    # 2.6 s: N0 N1 I0 N2 I1 N3 I2 N4, I_{k-1} packed with N_{k+1}: each window from its own start
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(2.6), seed=5)
    warm = _runtime()
    a2v = warm.pipeline.step_stages[1]
    latents: list[tuple[str, float, torch.Tensor]] = []
    run_batch = a2v.run_batch  # type: ignore[attr-defined]

    def spy(prepared):  # type: ignore[no-untyped-def]
        out = run_batch(prepared)
        latents.extend((w.step.name, w.start, o[P.STEP_LATENTS]) for w, o in zip(prepared, out, strict=True))
        return out

    def sample(options: dict[str, float]) -> dict[str, tuple[float, torch.Tensor]]:
        latents.clear()
        a2v.run_batch = spy  # type: ignore[attr-defined]
        try:
            _, spied = _render(dataclasses.replace(request, options=options), warm)
        finally:
            del a2v.run_batch  # type: ignore[attr-defined]
        assert len(spied.forwards) == 5 * 5  # still five groups, packed: one forward per sampler step
        return {name: (start, x) for name, start, x in latents}

    default = sample({})
    assert {n: s for n, (s, _) in default.items()} == {**{f"N{k}": START for k in range(5)},
                                                      **{f"I{k}": INTERP_START for k in range(3)}}
    other = sample({"interp_start_noise": START})  # I from 0.6, as the N chunks
    for name, (_, x) in default.items():  # the N chunks are the same, bit for bit; the I chunks are not
        assert torch.equal(x, other[name][1]) is name.startswith("N"), name
    # the sequential loop (each window sampled alone, from its one start) gives the same latents
    warm.batch_steps = False
    try:
        latents.clear()
        a2v.run_batch = spy  # type: ignore[attr-defined]
        _render(request, warm)
    finally:
        warm.batch_steps = True
        del a2v.run_batch  # type: ignore[attr-defined]
    assert all(torch.equal(x, default[name][1]) for name, _, x in latents) and len(latents) == 8


def test_the_prior_is_the_reference_for_n_and_the_anchors_line_for_i() -> None:
    from pipeline.families.tiny.stages.a2v import known_latents, step_prior
    from pipeline.schedule import ChunkKind, ChunkPlan
    from pipeline.stage_common import known_positions

    steps = ChunkPlan(40, 16, 4, 4, reference_frame=True).steps
    n1 = next(s for s in steps if s.kind is ChunkKind.N and s.index == 1)
    i0 = next(s for s in steps if s.kind is ChunkKind.I and s.index == 0)
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(1, 8, 1, 4, 4, generator=g)
    last_n = torch.randn(1, 8, 16, 4, 4, generator=g)  # N_1's latents: the right anchor is its frame e
    prev_last = torch.randn(1, 8, 1, 4, 4, generator=g)  # N_0's last frame: the left anchor

    def window(step):  # type: ignore[no-untyped-def]  # the window with its known frames, as A2VStage.prepare builds it
        known = torch.zeros(1, 8, len(step.window), 4, 4)
        known[:, :, known_positions(step, known.device)] = known_latents(step, ref, last_n, prev_last)
        return known

    n_prior = step_prior(n1, ref, window(n1))
    assert n_prior.shape == (1, 8, len(n1.window), 4, 4) and torch.equal(n_prior, ref.expand_as(n_prior))
    i_prior = step_prior(i0, ref, window(i0))
    T = len(i0.window)
    assert T == 4 + 2 and i0.known == (i0.window.start, i0.window.stop - 1)
    assert torch.equal(i_prior[:, :, :1], prev_last) and torch.allclose(i_prior[:, :, -1:], last_n[:, :, 4:5])
    for i in range(T):
        torch.testing.assert_close(i_prior[:, :, i : i + 1], prev_last + i / (T - 1) * (last_n[:, :, 4:5] - prev_last))
    with pytest.raises(RuntimeError, match="anchors"):  # a window whose anchors are not at its ends
        step_prior(dataclasses.replace(i0, known=(i0.window.start + 1, i0.window.stop - 1)), ref, window(i0))


def test_peak_guidance_puts_the_peak_where_the_audio_acts_most() -> None:
    from pipeline.families.tiny.stages.a2v import peak_guidance

    g = torch.Generator().manual_seed(7)
    d = torch.randn(1, 8, 3, 4, 4, generator=g) * 0.01
    d[:, :, 0, 2, 1] = 1.0  # frame 0: one cell moved most, by norm over the channels
    d[:, :, 1, 0, 3] = 0.5  # frame 1: another, with half the change: the map is each frame's own
    d[:, :, 1, 3, 3] = 0.25
    m = peak_guidance(d, 3.5, 7.0, 4.0)
    assert m.shape == (1, 1, 3, 4, 4)
    assert m[0, 0, 0, 2, 1].item() == pytest.approx(7.0) and m[0, 0, 1, 0, 3].item() == pytest.approx(7.0)
    assert m[0, 0, 1, 3, 3].item() == pytest.approx(3.5 + 3.5 * 0.5 ** 4)  # half the frame's largest change
    others = torch.ones_like(m, dtype=torch.bool)
    others[0, 0, 0, 2, 1] = others[0, 0, 1, 0, 3] = others[0, 0, 1, 3, 3] = False
    assert (m[:, :, :2][others[:, :, :2]] < 3.51).all()  # the rest of those frames keep the guidance
    assert m[0, 0, 2].max().item() == pytest.approx(7.0)  # a frame of small changes still has its peak cell
    # frames packed along T get what each gets alone
    assert torch.equal(torch.cat([peak_guidance(d[:, :, t : t + 1], 3.5, 7.0, 4.0) for t in range(3)], 2), m)
    # no change anywhere: the guidance, not a division by zero
    assert torch.equal(peak_guidance(torch.zeros(1, 8, 1, 4, 4), 3.5, 7.0, 4.0), torch.full((1, 1, 1, 4, 4), 3.5))


def test_audio_guidance_peak_reaches_the_a2v(speech) -> None:  # type: ignore[no-untyped-def]
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(1.0), seed=6)  # N0 N1 I0
    warm = _runtime()
    default, d = _render(request, warm)
    peaked, k = _render(dataclasses.replace(request, options={"audio_guidance_peak": PEAK}), warm)
    assert len(k.forwards) == len(d.forwards)  # the same forwards: the map costs no DiT call
    assert peaked.shape == default.shape and not np.array_equal(peaked, default)
    # by request or by the preset: the same frames
    preset_peaked, _ = _render(request, _runtime(dataclasses.replace(get_preset("tiny"), audio_guidance_peak=PEAK)))
    assert np.array_equal(peaked, preset_peaked)
    # a peak equal to the guidance is the uniform guidance, bit for bit
    flat, _ = _render(dataclasses.replace(request, options={"audio_guidance_peak": GUIDANCE}), warm)
    assert np.array_equal(flat, default)


def test_the_shipped_checkpoint_is_the_one_its_model_card_describes() -> None:
    """models/checkpoints/tiny.safetensors, the thirteenth checkpoint (the eleventh, whose SHA-256 its
    base_checkpoint names, with its chain decoder, which reads the reference, trained 40 more minutes on
    the SR's outputs of inputs noised up to 1.0), is what a request without a checkpoint renders with (every other test here renders it,
    strictly loaded), and its metadata records the recipe models/checkpoints/MODEL_CARD.md and
    docs/training.md give."""
    from pathlib import Path

    from safetensors import safe_open

    path = Path(__file__).resolve().parents[2] / "models" / "checkpoints" / "tiny.safetensors"
    assert TINY.default_checkpoint(get_preset("tiny")) == path
    with safe_open(str(path), "pt") as f:
        meta, names = f.metadata(), set(f.keys())
    assert meta["preset"] == "tiny" and meta["sr_feature_weight"] == "512" and meta["sr_reference_share"] == "0.1"
    assert meta["sr_feature_blur"] == "0.8" and meta["vae_scale_equivariance"] == "0.25"
    assert meta["latent_clips"] == "960" and meta["a2v_lr"] == "0.0002" and meta["sr_pixel_weight"] == "6"
    assert meta["sr_steps"] == "6022" and meta["base_checkpoint"] == "eleventh.safetensors (git 9a1f231, sha256 a9271d28eaf1)"
    assert meta["vae_chain_steps"] == "3926" and meta["vae_chain_minutes"] == "40.0" and meta["chain_heldout_psnr_db"] == "32.04"
    assert meta["vae_chain_sr_noise"] == "1" and meta["vae_chain_lr"] == "0.0005"
    assert meta["vae_chain_init_from"].endswith("its chain decoder, 9009 steps, 60.0 min, held-out PSNR 33.11 dB")
    # its decoder reads the reference, as the preset's does: the window and the warp's gate are in the file
    assert get_preset("tiny").vae.ref_window_radius == 3 and get_preset("tiny").vae.ref_warp
    assert {"vae.decoder.ref_window.kv.weight", "vae.decoder.ref_gate.weight"} <= names
