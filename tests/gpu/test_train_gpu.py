"""GPU-only: the A2V and SR trainers run with ``device="cuda"`` (skipped without CUDA by the root
conftest). Batches and noise are drawn on the CPU from the step's generator either way, so step 1's
loss (logged before any update) on the GPU is the CPU's within float rounding (TF32 convolutions,
other kernels); the state files a GPU run writes resume on the CPU and assemble into a checkpoint
that loads strictly there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.checkpoint import build_modules, load_checkpoint
from models.training.common import TrainState, load_state, save_state
from models.training.train_a2v import train_a2v
from models.training.train_all import assemble_checkpoint, final_vae
from models.training.train_sr import train_sr
from tests.unit.test_training import _first_logged_loss, small_preset

pytestmark = pytest.mark.gpu

# the cache fixture of the CPU trainer tests (a 64x64 variant of the tiny preset, three clips)
from tests.unit.test_training import cache  # noqa: E402,F401  (a pytest fixture, used by name)


def test_a2v_and_sr_train_on_cuda_like_on_the_cpu(cache: Path) -> None:  # noqa: F811
    p = small_preset()
    lat = cache / "latents"
    # the CUDA run writes the state files assembly reads (a2v_state.pt, sr_state.pt)
    states = {"cpu": ("a2v_cpu_state.pt", "sr_cpu_state.pt"), "cuda": ("a2v_state.pt", "sr_state.pt")}
    for dev, (a2v_file, sr_file) in states.items():
        a = train_a2v(p, lat, cache / a2v_file, minutes=0.1, batch_n=2, batch_i=4, log_every=1, mouth_weight=4.0,
                      device=dev)
        s = train_sr(p, lat, cache / sr_file, minutes=0.1, batch=8, log_every=1, detail_weight=4.0,
                     feature_blur=0.5, device=dev)
        print(f"{dev}: a2v {a['steps']} steps, sr {s['steps']} steps, sr eval L1 {s['eval_l1']:.4f} "
              f"(bilinear {s['bilinear_l1']:.4f})")
        assert a["steps"] >= 2 and s["steps"] >= 2
        assert s["eval_l1"] < s["bilinear_l1"]  # it learns there too
    for cpu_file, gpu_file in zip(states["cpu"], states["cuda"], strict=True):
        # it trained on the GPU (the saved weights are CUDA tensors), and step 1 computed what the CPU did
        saved = torch.load(cache / gpu_file, weights_only=False)["modules"]
        assert {t.device.type for m in saved.values() for t in m.values()} == {"cuda"}, gpu_file
        assert _first_logged_loss(cache / gpu_file) == pytest.approx(_first_logged_loss(cache / cpu_file), rel=1e-2)
    # the GPU run's state resumes on the CPU (the optimiser's moments too) and assembles there
    on_gpu = load_state(cache / "sr_state.pt", {"sr": build_modules(p)["sr"]}).step
    s2 = train_sr(p, lat, cache / "sr_state.pt", minutes=0.15, batch=8, log_every=1, detail_weight=4.0,
                  feature_blur=0.5, device="cpu")
    assert s2["steps"] > on_gpu
    vae = final_vae(p, cache)  # the VAE state assembly reads (train_vae writes it)
    save_state(cache / "vae_state.pt", {"vae": vae}, torch.optim.SGD(vae.parameters(), lr=0.1), TrainState(step=1))
    out = cache / "cuda.safetensors"
    meta = assemble_checkpoint(p, cache, out, seed=0)
    assert meta["sr_batch"] == "8" and meta["a2v_batch_n"] == "2" and meta["a2v_batch_i"] == "4"
    fresh = build_modules(p, seed=5)
    load_checkpoint(fresh, out)  # strict, on the CPU
    blob = torch.load(cache / "a2v_state.pt", map_location="cpu", weights_only=False)
    assert torch.equal(fresh["a2v"].state_dict()["head.weight"], blob["modules"]["ema_a2v"]["head.weight"])
