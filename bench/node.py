"""Node benchmark: the A2V -> SR stage switch through the NodeEngine, all-resident vs parked.

    python -m bench.node --preset tiny --ranks 2 --json          # CPU, gloo (parking off by default)
    python -m bench.node --preset 1.3b --ranks 1 --json          # GPU: NCCL, bf16, parking on
    (bench/gpu_node_check.sh is the prepared GPU run)

Each chunk runs stage A (the A2V DiT: ``steps`` sampler forwards over the N window of C+L frames) and
stage B (the SR DiT over L frames), as the pipeline's steady state does; the models are FSDP2-sharded
over the ranks. The same workload runs twice in the same rank processes: once with both models
resident, once with the idle model parked in (pinned) host memory and brought back just in time
(``ModelParker.activate`` at each stage start, ``prefetch`` of the next model's first blocks when the
current stage starts its last forward).

Reported (rank 0's timeline; CUDA events on GPU, perf_counter on CPU):
* ``switch_gap_ms``: from the end of the outgoing model's last block compute to the start of the
  incoming model's first block compute, per switch (A->B and B->A); ``switch_overhead_ms`` is the
  parked run's gap minus the resident run's mean gap of the same direction (target < 10 ms on GPU).
* ``stage_s``: mean seconds per stage per chunk; ``ttff_s``: job start to the first chunk's SR output
  (no VAE decode: it is not a placement concern); ``frames_per_s``: chunks * L / wall.
* ``peak_bytes`` per rank: ``torch.cuda.max_memory_allocated`` on GPU, peak RSS on CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping

import torch
from torch import nn

from pipeline.families import FAMILIES
from pipeline.placement.engine import EngineConfig, NodeEngine
from pipeline.placement.loaders import family_loaders
from pipeline.placement.rank import RankContext


class _Clock:
    """Timestamps on rank 0's compute timeline: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, label: str) -> None:
        if self.cuda:  # GPU-only
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((label, event))
        else:
            self.marks.append((label, time.perf_counter()))

    def seconds(self) -> list[tuple[str, float]]:
        if not self.marks:
            return []
        if self.cuda:  # GPU-only
            torch.cuda.synchronize()
            first = self.marks[0][1]
            return [(k, first.elapsed_time(e) / 1000.0) for k, e in self.marks]  # type: ignore[attr-defined]
        t0 = float(self.marks[0][1])  # type: ignore[arg-type]
        return [(k, float(t) - t0) for k, t in self.marks]  # type: ignore[arg-type]


def _instrument(model: nn.Module, name: str, clock: _Clock) -> list[torch.utils.hooks.RemovableHandle]:
    blocks = model.blocks  # type: ignore[union-attr]
    # appended pre-hook: runs after the parker's and FSDP's pre-hooks, i.e. when compute starts;
    # prepended post-hook: runs right after the last block's compute, before FSDP reshards
    return [
        blocks[0].register_forward_pre_hook(lambda m, a: clock.mark(f"{name}:first_start")),  # type: ignore[index]
        blocks[-1].register_forward_hook(lambda m, a, o: clock.mark(f"{name}:last_end"), prepend=True),  # type: ignore[index]
    ]


def job_stage_switch(ctx: RankContext, payload: Mapping[str, object]) -> dict[str, object]:
    """Every rank: ``chunks`` x (A2V sampling steps, SR); returns rank 0's timeline figures."""
    from models.presets import get_preset

    preset = get_preset(str(payload["preset"]))
    steps, chunks, park = int(payload["steps"]), int(payload["chunks"]), bool(payload["park"])  # type: ignore[call-overload]
    a2v, sr, parker, dev = ctx.modules["a2v"], ctx.modules["sr"], ctx.parker, ctx.device
    dtype = next(p for p in a2v.parameters()).dtype
    L, C, c = preset.chunk_frames, preset.context_frames, preset.latent_channels
    T = C + L
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
    ref, x = rand(1, c, *preset.hr_latent_hw), rand(1, c, T, *preset.lr_latent_hw)
    known = torch.zeros(1, T, dtype=torch.bool, device=dev)
    known[:, :C] = True
    frame_index = torch.arange(T, device=dev)[None]
    audio = rand(1, T, preset.dit.audio_dim)
    if not park:
        for name in ("a2v", "sr"):
            if name in parker.resident_bytes():
                parker.restore(name)
    clock = _Clock(dev)
    handles = _instrument(a2v, "a2v", clock) + _instrument(sr, "sr", clock)
    ttff = 0.0
    start = time.perf_counter()
    try:
        with torch.no_grad():
            for _ in range(chunks):
                clock.mark("a2v:stage_start")
                if park:
                    parker.activate("a2v")
                context = a2v.embed_context(ref)  # type: ignore[operator]
                xt = x
                for step in range(steps):
                    if park and step == steps - 1:
                        parker.prefetch("sr", 2)  # the next stage's first blocks overlap the last step
                    t = torch.full((1,), 1.0 - step / steps, device=dev, dtype=dtype)
                    xt = xt - a2v(xt, t, known, frame_index, ref, audio, context=context) / steps
                clock.mark("sr:stage_start")
                if park:
                    parker.activate("sr")
                tokens = sr.embed_reference(ref)  # type: ignore[operator]
                hr = sr(xt[:, :, C:], ref, ref_tokens=tokens)
                if park:
                    parker.prefetch("a2v", 2)
                clock.mark("chunk_end")
                if not ttff:
                    if dev.type == "cuda":  # GPU-only
                        torch.cuda.synchronize(dev)
                    ttff = time.perf_counter() - start
                del hr
        if dev.type == "cuda":  # GPU-only
            torch.cuda.synchronize(dev)
        wall = time.perf_counter() - start
    finally:
        for h in handles:
            h.remove()
    return _figures(clock.seconds(), wall, ttff, chunks * L) if ctx.is_publisher else {}


def _figures(marks: list[tuple[str, float]], wall: float, ttff: float, frames: int) -> dict[str, object]:
    gaps: dict[str, list[float]] = {"a2v->sr": [], "sr->a2v": []}
    stages: dict[str, list[float]] = {"a2v": [], "sr": []}
    last_end: dict[str, float] = {}
    stage_start: dict[str, float] = {}
    seen_first: set[str] = set()
    for label, t in marks:
        model, _, what = label.partition(":")
        if what == "last_end":
            last_end[model] = t
        elif what == "stage_start":
            stage_start[model] = t
            seen_first.discard(model)
        elif what == "first_start" and model not in seen_first:  # the stage's first block compute
            seen_first.add(model)
            other = "sr" if model == "a2v" else "a2v"
            if other in last_end:
                gaps[f"{other}->{model}"].append(1000.0 * (t - last_end[other]))
        if label == "sr:stage_start" and "a2v" in stage_start:
            stages["a2v"].append(t - stage_start["a2v"])
        if label == "chunk_end" and "sr" in stage_start:
            stages["sr"].append(t - stage_start["sr"])
    return {
        "switch_gap_ms": gaps,
        "stage_s": {k: sum(v) / len(v) for k, v in stages.items() if v},
        "ttff_s": ttff,
        "wall_s": wall,
        "frames_per_s": frames / wall,
    }


def run(
    preset: str, ranks: int, *, steps: int, chunks: int, device: str, park: bool | None, dtype: str
) -> dict[str, object]:
    config = EngineConfig(
        world_size=ranks,
        device_type=device,
        loaders=family_loaders(FAMILIES.get("tiny"), preset, ["a2v", "sr"], random_init=True, dtype=dtype,
                               build_on_device=device == "cuda"),
        park=park,
        threads_per_rank=1 if device == "cpu" else 4,
    )
    out: dict[str, object] = {
        "preset": preset,
        "ranks": ranks,
        "device": device,
        "steps": steps,
        "chunks": chunks,
    }
    with NodeEngine(config) as engine:
        payload = {"preset": preset, "steps": steps, "chunks": 1, "park": False}
        engine.run(job_stage_switch, payload)  # warm-up: kernels, allocator, first all-gathers
        runs = {}
        for mode, do_park in (("resident", False), ("parked", True)):
            result = engine.run(job_stage_switch, dict(payload, chunks=chunks, park=do_park))
            figures = dict(result.value)  # type: ignore[call-overload]
            figures["peak_bytes"] = [r.peak_bytes for r in result.ranks]
            figures["peak_kind"] = result.ranks[0].peak_kind
            runs[mode] = figures
    out["parking_enabled"] = park if park is not None else device == "cuda"
    resident_gaps = runs["resident"]["switch_gap_ms"]
    overhead = {
        direction: [g - sum(resident_gaps[direction]) / len(resident_gaps[direction]) for g in gaps]  # type: ignore[index]
        for direction, gaps in runs["parked"]["switch_gap_ms"].items()  # type: ignore[attr-defined]
        if gaps and resident_gaps[direction]  # type: ignore[index]
    }
    out.update(runs=runs, switch_overhead_ms=overhead)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=["tiny", "1.3b", "14b"])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--steps", type=int, help="sampler forwards per chunk (default: the preset's num_steps)")
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    ap.add_argument(
        "--park",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="park idle models (default: on with CUDA, off on CPU)",
    )
    ap.add_argument("--dtype", default="", help="weight dtype, e.g. bfloat16 (default: bfloat16 on cuda)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from models.presets import get_preset

    steps = args.steps or get_preset(args.preset).num_steps
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "")
    result = run(
        args.preset, args.ranks, steps=steps, chunks=args.chunks, device=device, park=args.park, dtype=dtype
    )
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        for mode, figures in result["runs"].items():  # type: ignore[attr-defined]
            print(f"{mode}: {figures}")
        print(f"switch overhead (ms): {result['switch_overhead_ms']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
