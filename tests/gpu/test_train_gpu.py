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
    for dev in ("cpu", "cuda"):
        a = train_a2v(p, lat, cache / f"a2v_{dev}_state.pt", minutes=0.1, batch_n=2, batch_i=4, log_every=1,
                      mouth_weight=4.0, device=dev)
        s = train_sr(p, lat, cache / f"sr_{dev}_state.pt", minutes=0.1, batch=8, log_every=1, detail_weight=4.0,
                     feature_blur=0.5, device=dev)
        print(f"{dev}: a2v {a['steps']} steps, sr {s['steps']} steps, sr eval L1 {s['eval_l1']:.4f} "
              f"(bilinear {s['bilinear_l1']:.4f})")
        assert a["steps"] >= 2 and s["steps"] >= 2
        assert s["eval_l1"] < s["bilinear_l1"]  # it learns there too
    for name in ("a2v", "sr"):
        cpu, gpu = _first_logged_loss(cache / f"{name}_cpu_state.pt"), _first_logged_loss(cache / f"{name}_cuda_state.pt")
        assert gpu == pytest.approx(cpu, rel=1e-2), name
    # the GPU run's state resumes on the CPU (the optimiser's moments too) and assembles there
    on_gpu = load_state(cache / "sr_cuda_state.pt", {"sr": build_modules(p)["sr"]}).step
    s2 = train_sr(p, lat, cache / "sr_cuda_state.pt", minutes=0.15, batch=8, log_every=1, detail_weight=4.0,
                  feature_blur=0.5, device="cpu")
    assert s2["steps"] > on_gpu
    for name in ("a2v", "sr"):
        (cache / f"{name}_state.pt").unlink(missing_ok=True)
        (cache / f"{name}_state.pt").symlink_to(cache / f"{name}_cuda_state.pt")
    mods = {"vae": final_vae(p, cache).requires_grad_(True)}  # the VAE state assembly reads (train_vae writes it)
    save_state(cache / "vae_state.pt", mods, torch.optim.SGD(mods["vae"].parameters(), lr=0.1), TrainState(step=1))
    out = cache / "cuda.safetensors"
    meta = assemble_checkpoint(p, cache, out, seed=0)
    assert meta["sr_batch"] == "8" and meta["a2v_batch_n"] == "2" and meta["a2v_batch_i"] == "4"
    fresh = build_modules(p, seed=5)
    load_checkpoint(fresh, out)  # strict, on the CPU
    blob = torch.load(cache / "a2v_cuda_state.pt", map_location="cpu", weights_only=False)
    assert torch.equal(fresh["a2v"].state_dict()["head.weight"], blob["modules"]["ema_a2v"]["head.weight"])
