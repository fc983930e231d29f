"""Micro-benchmark of the model chain for one emission of the steady state (random weights).

One emission of L output frames costs: audio features for the N window (C+L frames) and the I window
(e+2 frames); ``num_steps`` A2V forwards over the N window and over the I window; SR of L frames;
VAE decode of L frames (with the rolling cache). The script prints milliseconds per output frame for
each module and the resulting output frames per second (real time = fps of the preset).

    python bench/models_speed.py --threads 2            # the real-time check on this machine
    python bench/models_speed.py --threads 1 --repeats 5
    python bench/models_speed.py --preset 1.3b --device cuda --dtype bfloat16   # on a GPU machine

On CUDA the modules are built directly on the device (random init; the 14b A2V needs ~67 GB in
float32 before the cast) and the peak allocated memory is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch

from models.audio import AudioEncoder
from models.checkpoint import build_modules
from models.dit import A2VDiT
from models.presets import get_preset
from models.sampler import FlowMatchEulerSampler
from models.sr import SRDiT
from models.vae import CausalVAE


def _time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> tuple[float, float]:
    """(min wall seconds, min process CPU seconds) over ``repeats`` runs after one warm-up.

    The minimum, not the median: on a shared machine the other processes only ever add time.
    """
    fn()  # warm-up (allocator, oneDNN primitive cache, CUDA kernels)
    sync()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        sync()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, help="override num_steps")
    ap.add_argument("--chunk", type=int, help="override chunk_frames (L)")
    ap.add_argument("--layers", type=int, help="override the A2V DiT's num_layers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    p = get_preset(args.preset)
    if args.steps:
        p = dataclasses.replace(p, num_steps=args.steps)
    if args.chunk:
        p = dataclasses.replace(p, chunk_frames=args.chunk)
    if args.layers:
        p = dataclasses.replace(p, dit=dataclasses.replace(p.dit, num_layers=args.layers))
    with device:
        mods = {k: m.eval().to(dtype) for k, m in build_modules(p, seed=0).items()}
    dit, sr, vae, audio = mods["a2v"], mods["sr"], mods["vae"], mods["audio"]
    assert isinstance(dit, A2VDiT) and isinstance(sr, SRDiT) and isinstance(vae, CausalVAE)
    assert isinstance(audio, AudioEncoder)
    L, C, e, c = p.chunk_frames, p.context_frames, p.interp_frames, p.latent_channels
    sampler = FlowMatchEulerSampler(p.num_steps, p.shift)
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    ref = randn(1, c, *p.hr_latent_hw)
    text_tokens = text_mask = None
    if "text" in mods:
        with torch.inference_mode():
            text_tokens, text_mask = mods["text"](["a friendly presenter in a bright studio"])

    def a2v(T: int) -> Callable[[], object]:
        x = randn(1, c, T, *p.lr_latent_hw)
        known = torch.zeros(1, T, dtype=torch.bool, device=device)
        known[:, : min(C, T - 1)] = True
        fi = torch.arange(T, device=device)[None] + 1000
        feats = randn(1, T, p.dit.audio_dim)

        def run() -> object:
            with torch.inference_mode():
                ctx = dit.embed_context(ref, text_tokens, text_mask)
                return sampler.sample(
                    lambda xt, t: dit(xt, t, known, fi, ref, feats, context=ctx), x, x, known
                )

        return run

    def audio_feats(T: int) -> Callable[[], object]:
        wave = randn(1, audio.num_samples(T)) * 0.1

        def run() -> object:
            with torch.inference_mode():
                return audio(wave, T)

        return run

    lr = randn(1, c, L, *p.lr_latent_hw)
    z = randn(1, c, L, *p.hr_latent_hw)
    with torch.inference_mode():
        # what a decoder that reads the reference reads of it (None for a plain one), once per job as the
        # pipeline computes it: not timed per emission
        dec_ref = vae.reference_features(randn(1, 3, p.height, p.width).clamp(-1, 1))
        _, cache = vae.decode(z, reference=dec_ref)
        sr_tokens = sr.embed_reference(ref)

    def run_sr() -> object:
        with torch.inference_mode():
            return sr(lr, ref, ref_tokens=sr_tokens)

    def run_decode() -> object:
        with torch.inference_mode():
            return vae.decode(z, cache, reference=dec_ref)

    timed = {
        "audio (N+I windows)": [
            _time(audio_feats(C + L), args.repeats, sync),
            _time(audio_feats(e + 2), args.repeats, sync),
        ],
        f"a2v N chunk ({p.num_steps} steps x {C + L} frames)": [_time(a2v(C + L), args.repeats, sync)],
        f"a2v I chunk ({p.num_steps} steps x {e + 2} frames)": [_time(a2v(e + 2), args.repeats, sync)],
        f"sr ({L} frames)": [_time(run_sr, args.repeats, sync)],
        f"vae decode ({L} frames)": [_time(run_decode, args.repeats, sync)],
    }
    wall = {k: sum(w for w, _ in v) for k, v in timed.items()}
    cpu = {k: sum(c for _, c in v) for k, v in timed.items()}
    total, total_cpu = sum(wall.values()), sum(cpu.values())
    print(
        f"preset={p.name} {p.width}x{p.height}@{p.fps} device={device} dtype={args.dtype} "
        f"threads={args.threads} L={L} C={C} e={e} "
        f"steps={p.num_steps} repeats={args.repeats} (min over repeats)"
    )
    print(f"  {'module (per emission of L frames)':<42s} {'wall ms/frame':>14s} {'cpu ms/frame':>13s}")
    for name in timed:
        print(
            f"  {name:<42s} {1000 * wall[name] / L:14.2f} {1000 * cpu[name] / L:13.2f}  "
            f"({100 * wall[name] / total:4.1f}% of wall)"
        )
    fps = L / total
    print(
        f"  {'total':<42s} {1000 * total / L:14.2f} {1000 * total_cpu / L:13.2f}  -> {fps:.1f} frames/s "
        f"({fps / p.fps:.2f}x real time)"
    )

    if device.type == "cuda":
        print(f"  peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
