"""Smoke tests of the wan benchmarks' code paths on the tiny shapes: ``bench.peer`` (diffusers' Wan I2V
pipeline vs the ``wan`` family on the same tiny release, each side in its own process) and the CPU
fallback of ``bench.gpu_wan``. They check the fields, not speed (speed is measured in docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import av
import pytest

from bench import gpu_wan, peer
from models.wan.tiny_release import write_tiny_infinitetalk
from pipeline.inputs import AudioSource


def test_diffusers_frame_count_covers_the_video() -> None:
    assert [peer.diffusers_frames(s) for s in (0.04, 1.0, 16.0, 60.0)] == [1, 25, 401, 1501]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_infinitetalk(tmp_path_factory.mktemp("peer") / "weights")


def test_peer_runs_both_sides_on_the_same_release(weights: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench.peer", "--weights", str(weights), "--preset", "tiny",
                          "--seconds", "0.5", "--steps", "1", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    case = json.loads(out.stdout.strip().splitlines()[-1])
    lt, df = case["longtake"], case["diffusers"]
    assert (lt["side"], df["side"]) == ("longtake", "diffusers")
    assert lt["frames"] == 13 and df["frames"] == 13  # 0.5 s at 25 fps; diffusers' 4k + 1 = 13
    for side in (lt, df):
        assert 0 < side["ttff_s"] <= side["wall_s"] and side["peak_rss_bytes"] > 100e6 and side["mp4_bytes"] > 1000
    assert case["diffusers_over_longtake"]["wall_s"] == pytest.approx(df["wall_s"] / lt["wall_s"])


def test_diffusers_side_writes_the_video_with_its_audio(weights: Path, tmp_path: Path) -> None:
    r = peer.run_diffusers(weights, "tiny", 0.5, 1, 0, tmp_path)
    assert r["frames"] == 13
    with av.open(str(tmp_path / "diffusers.mp4")) as f:
        assert sum(1 for _ in f.decode(video=0)) == 13
    with AudioSource.open(tmp_path / "speech.wav", model_rate=16000) as a:
        assert a.num_samples(16000) == 8000


def test_gpu_script_cpu_fallback_on_the_tiny_shape() -> None:
    r = gpu_wan.run_case("tiny", "480p", device="cpu", steps=2, branches=1, repeats=1)
    assert (r["preset"], r["height"], r["width"], r["device"]) == ("tiny", 64, 32, "cpu")  # the 768x448 portrait bucket
    parts = ["dit_step_s", "dit_step_n0_s", "dit_step_i_s", "audio_tokens_s", "decode_first_s", "decode_chunk_s", "setup_s"]
    assert all(isinstance(r[k], float) and r[k] > 0 for k in parts)
    assert r["ttff_s"] == pytest.approx(r["setup_s"] + 2 * r["dit_step_n0_s"] + r["audio_tokens_s"] + r["decode_first_s"])
    per_emission = 2 * (r["dit_step_s"] + r["dit_step_i_s"]) + 2 * r["audio_tokens_s"] + r["decode_chunk_s"]
    assert r["fps"] == pytest.approx(16 / per_emission) and r["frames_per_emission"] == 16
    assert gpu_wan.preset_name("14b", "720p") == "14b-720p" and gpu_wan.preset_name("1.3b", "480p") == "1.3b"
    assert json.loads(json.dumps(r)) == r
