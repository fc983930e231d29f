"""Peak host memory of a strict DiT load, on the 1.3b shape (random bf16 weights in the public layout).

Usage: ``PYTHONPATH=. python tests/wan/measure_load_memory.py /tmp/wan13 [write|load]`` — ``write``
writes a Wan2.1-I2V-style sharded folder + an InfiniteTalk-style overlay; ``load`` (run in a fresh
process) loads it through :func:`models.wan.release.load_infinitetalk_dit` and prints the peak RSS above
the post-import baseline next to the weights' size. Not collected by pytest (minutes, GBs of disk).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.wan.config import dit_preset
from models.wan.dit import WanAvatarDiT


def write(folder: Path, num_shards: int = 4) -> None:
    cfg = dit_preset("1.3b")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in WanAvatarDiT(cfg).state_dict().items()}
    audio = {k for k in shapes if "audio" in k or ".norm_x." in k}
    base = sorted(set(shapes) - audio)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in range(num_shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {k: torch.full(shapes[k], 0.01, dtype=torch.bfloat16) for k in base[i::num_shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        del part
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    raw = {"model_type": "i2v", "dim": cfg.dim, "ffn_dim": cfg.ffn_dim, "num_heads": cfg.num_heads,
           "num_layers": cfg.num_layers, "in_dim": 36, "out_dim": 16, "freq_dim": 256, "text_len": 512, "eps": 1e-6}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(raw))
    save_file({k: torch.full(shapes[k], 0.01, dtype=torch.bfloat16) for k in sorted(audio)},
              str(folder / "infinitetalk.safetensors"), metadata={"format": "pt"})  # fmt: skip


def load(folder: Path) -> None:
    from models.wan.release import load_infinitetalk_dit, parameter_bytes

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.time()
    dit = load_infinitetalk_dit(folder, folder / "infinitetalk.safetensors", dtype=torch.bfloat16)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    size = parameter_bytes(dit)
    print(f"weights {size / 2**30:.2f} GiB, peak RSS above baseline {peak / 2**30:.2f} GiB "
          f"= {peak / size:.3f}x, {time.time() - t0:.0f} s")  # fmt: skip


if __name__ == "__main__":
    {"write": write, "load": load}[sys.argv[2]](Path(sys.argv[1]))
