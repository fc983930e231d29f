"""Windowed wav2vec2 features (transformers Wav2Vec2Model, random weights, chinese-wav2vec2-base layout
at tiny width) against the upstream whole-clip computation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import Wav2Vec2Config, Wav2Vec2Model

from models.wan.audio import (
    WanAudioFeatures,
    frame_windows,
    load_wav2vec2,
    num_video_frames,
    whole_clip_features,
)
from models.wan.checkpoint import WanCheckpointError

# chinese-wav2vec2-base's config.json shape (conv stack, group norm, pos-conv 128/16) at tiny width
TINY = {
    "hidden_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "conv_dim": [8] * 7,
    "conv_kernel": [10, 3, 3, 3, 3, 2, 2],
    "conv_stride": [5, 2, 2, 2, 2, 2, 2],
    "feat_extract_norm": "group",
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 2,
    "do_stable_layer_norm": False,
}


@pytest.fixture(scope="module")
def model() -> Wav2Vec2Model:
    torch.manual_seed(0)
    return Wav2Vec2Model(Wav2Vec2Config(**TINY)).eval()


def _wave(seconds: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(seconds * 16000)
    t = torch.arange(n) / 16000
    return 0.3 * torch.sin(2 * torch.pi * 180 * t) + 0.1 * torch.randn(n, generator=g)


@torch.no_grad()
def test_window_covering_the_clip_equals_upstream_whole_clip(model) -> None:  # type: ignore[no-untyped-def]
    wave = _wave(2.0)
    whole = whole_clip_features(model, wave)
    total = num_video_frames(wave.numel())
    assert whole.shape == (total, TINY["num_hidden_layers"], TINY["hidden_size"])
    feats = WanAudioFeatures(model)
    stats = (float(wave.mean()), float(wave.std(unbiased=False)))
    read = lambda a, b: wave[a:b]  # noqa: E731
    for start, end in [(0, 17), (17, 33), (33, total)]:
        got = feats.features(read, wave.numel(), start, end, context=total, stats=stats)
        torch.testing.assert_close(got, whole[start:end], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_cnn_and_resampling_are_exact_per_window() -> None:
    """With a per-frame CNN norm (``feat_extract_norm="layer"``), a window's resampled CNN features equal
    the whole clip's exactly: the 50 Hz → 25 fps positions are the whole clip's, not the window's.
    (With ``"group"`` the first conv's GroupNorm normalises over the window — see docs/wan.md.)"""
    import torch.nn.functional as F

    torch.manual_seed(0)
    m = Wav2Vec2Model(Wav2Vec2Config(**{**TINY, "feat_extract_norm": "layer", "conv_bias": True})).eval()
    wave = _wave(3.0, seed=1)
    n = wave.numel()
    total = num_video_frames(n)
    stats = (float(wave.mean()), float(wave.std(unbiased=False)))
    norm = (wave - stats[0]) / (stats[1] ** 2 + 1e-7) ** 0.5
    cnn = m.feature_extractor(norm[None])
    whole = F.interpolate(cnn, size=total, align_corners=True, mode="linear").transpose(1, 2)[0]
    feats = WanAudioFeatures(m)
    for lo, hi in [(0, 5), (7, 20), (40, 41), (60, total)]:
        got = feats.resampled_cnn(lambda a, b: wave[a:b], n, lo, hi, stats)[0]
        torch.testing.assert_close(got, whole[lo:hi], rtol=1e-5, atol=1e-5)


def test_frame_windows_clamp_at_the_clip_ends() -> None:
    feats = torch.arange(10.0)[:, None, None].expand(10, 1, 1)
    w = frame_windows(feats, 0, 0, 10, 10)
    assert w.shape == (10, 5, 1, 1)
    assert w[0, :, 0, 0].tolist() == [0, 0, 0, 1, 2] and w[9, :, 0, 0].tolist() == [7, 8, 9, 9, 9]
    part = frame_windows(feats[3:9], 3, 5, 7, 10)
    torch.testing.assert_close(part, w[5:7])
    with pytest.raises(ValueError, match="more margin"):
        frame_windows(feats[3:9], 3, 4, 7, 10)


_MEM_SCRIPT = textwrap.dedent(
    """
    import resource, sys, numpy as np, torch
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    from models.wan.audio import WanAudioFeatures, num_video_frames
    torch.set_num_threads(1)
    cfg = Wav2Vec2Config(**__TINY__)
    torch.manual_seed(0)
    feats = WanAudioFeatures(Wav2Vec2Model(cfg).eval())
    path, n = sys.argv[1], int(sys.argv[2])
    wave = np.memmap(path, dtype=np.float32, mode="r", shape=(n,))
    read = lambda a, b: torch.from_numpy(np.array(wave[a:b]))
    total = num_video_frames(n)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for start in range(0, total, 33 * 40):  # every 40th chunk of 33 frames: same work per window
        feats.features(read, n, start, min(total, start + 33), context=16, stats=(0.0, 0.3))
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
    """
)


@pytest.mark.parametrize("unused", [None])
def test_peak_memory_does_not_grow_with_audio_length(tmp_path, unused) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "mem.py"
    script.write_text(_MEM_SCRIPT.replace("__TINY__", repr(TINY)))
    growth = {}
    for seconds in (10, 600):
        n = seconds * 16000
        path = tmp_path / f"a{seconds}.f32"
        rng = torch.Generator().manual_seed(0)
        (0.3 * torch.randn(n, generator=rng)).numpy().tofile(path)
        out = subprocess.run(
            [sys.executable, str(script), str(path), str(n)],
            capture_output=True, text=True, check=False, cwd=Path(__file__).parents[2],
            env={"PYTHONPATH": str(Path(__file__).parents[2]), "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        growth[seconds] = int(out.stdout.split()[-1])  # KiB above the post-import baseline
    print("wav2vec2 window peak RSS growth KiB", growth)
    assert growth[600] < growth[10] + 8 * 1024, growth  # within 8 MiB although the audio is 60× longer


def test_loader_is_strict(tmp_path, model) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "chinese-wav2vec2-base"
    model.save_pretrained(folder)
    loaded = load_wav2vec2(folder)
    torch.testing.assert_close(
        loaded.model.encoder.layers[0].attention.q_proj.weight,
        model.encoder.layers[0].attention.q_proj.weight,
    )
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    state.pop(next(k for k in state if "layers.1.attention.k_proj.weight" in k))
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(WanCheckpointError, match="missing keys: .*layers.1.attention.k_proj.weight"):
        load_wav2vec2(folder)
    with pytest.raises(WanCheckpointError, match="no config.json"):
        load_wav2vec2(tmp_path)


@torch.no_grad()
def test_layer_loop_equals_transformers_hidden_states(model) -> None:  # type: ignore[no-untyped-def]
    from models.wan.audio import layer_states

    wave = _wave(1.0, seed=4)[None]
    want = model(wave, output_hidden_states=True).hidden_states[1:]
    got = layer_states(model, model.feature_extractor(wave).transpose(1, 2))
    torch.testing.assert_close(got, torch.stack(want, dim=2), rtol=1e-5, atol=1e-5)
