"""Streaming vs batch render benchmark.

    python -m bench.stream --preset tiny --seconds 10 --mode streaming --json

Prints one JSON object: ttff_s, frames, video_s, wall_s, realtime_factor (video seconds per wall
second), peak_rss_bytes, rss_per_minute_mb (the peak RSS of each minute of video: ``VmHWM``,
reset through ``/proc/self/clear_refs`` when a minute ends; ``peak_rss_bytes`` is the highest of them),
rss_slope_mb_per_10min (least-squares slope of the whole minutes' peaks, the first one left out: the
warm-up), stage_s, model_s (per model and total), encode_s and overhead_ratio
(wall / (model + encode); below 1 where lanes overlap). Run each mode in its own process (peak RSS
is a process high-water mark); ``--compare`` does that for both modes side by side and prints the
ratios. ``--no-overlap`` runs SR + decode on the render loop instead of the emission lane (the
sequential loop, to measure what the overlap buys). ``--no-batch-steps`` gives every step its own
A2V forwards instead of sampling ``I_{k-1}`` and ``N_{k+1}`` together (``a2v_forwards`` and
``a2v_forwards_per_video_s`` count the DiT's forward calls); ``--compare-batch-steps --repeat N``
runs the two side by side, alternating (ABBA), each in its own process, and prints the median ratios.
The input WAV is written block by block
(``bench.inputs.speech_wav``), so an hour of input does not show in the renderer's peak RSS.

A long run (the soak): ``python -m bench.stream --seconds 3600 --json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.inputs import DEMO_IMAGE, speech_wav
from bench.machine import machine
from bench.memprofile import slope_per_10min
from pipeline.host import reset_peak_rss


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_once(preset: str, seconds: float, mode: str, threads: int | None, image: Path | None,
             checkpoint: Path | None, seed: int, overlap: bool = True, batch_steps: bool = True,
             family_name: str = "tiny") -> dict[str, object]:
    from pipeline.families import FAMILIES
    from pipeline.family_runtime import WARM_FAMILIES
    from pipeline.host import default_threads, peak_rss_bytes
    from pipeline.render import RenderProgress, RenderRequest, render
    from pipeline.sinks import FileSink

    torch.set_num_threads(threads or default_threads())
    cpu0 = process_cpu_s()
    with tempfile.TemporaryDirectory(prefix="longtake-bench-") as tmp:
        audio = speech_wav(Path(tmp) / "speech.wav", seconds, seed=seed)
        out = Path(tmp) / "out.mp4"
        request = RenderRequest(image=image or DEMO_IMAGE, audio=audio, seed=seed, family=family_name,
                                preset=preset, checkpoint=checkpoint)
        family = WARM_FAMILIES.get(FAMILIES.get(request.family), preset, checkpoint)
        family.overlap_emissions = overlap
        family.batch_steps = batch_steps
        forwards = [0]
        hooks = [m.get().register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))  # type: ignore[attr-defined]
                 for stage in family.pipeline.step_stages if stage.name == "a2v" for m in stage.modules()]
        per_minute: dict[int, int] = {}  # minute of video -> peak RSS over it
        minute = 0

        def sample_rss(p: RenderProgress) -> None:
            nonlocal minute
            now = int(p.frames_done / family.preset.fps // 60)
            if now != minute and reset_possible:
                per_minute[minute] = peak_rss_bytes()  # the emission that crossed the minute counts to it
                reset_peak_rss()
                minute = now

        reset_possible = reset_peak_rss()
        r = render(request, [FileSink(out)], mode=mode, family=family,  # type: ignore[arg-type]
                   on_progress=sample_rss)
        for hook in hooks:
            hook.remove()
        per_minute[minute] = r.peak_rss_bytes
        whole = [m for m in sorted(per_minute) if (m + 1) * 60 <= r.duration_s][1:]
        out_bytes = out.stat().st_size
        digest = hashlib.sha256()
        with out.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    model_total = sum(r.model_s.values())
    return {
        "family": family_name,
        "preset": preset,
        "mode": mode,
        "threads": torch.get_num_threads(),
        "machine": machine(),
        "overlap_emissions": overlap and mode == "streaming",
        "batch_steps": batch_steps and family.pipeline.batched_stage is not None,
        "a2v_forwards": forwards[0],
        "a2v_forwards_per_video_s": forwards[0] / r.duration_s,
        "ttff_s": r.ttff_s,
        "frames": r.num_frames,
        "video_s": r.duration_s,
        "wall_s": r.wall_s,
        "cpu_s": process_cpu_s() - cpu0,  # every thread's CPU time: steadier than wall on a shared machine
        "realtime_factor": r.duration_s / r.wall_s,
        "fps": r.num_frames / r.wall_s,
        "peak_rss_bytes": max([r.peak_rss_bytes, *per_minute.values()]),
        "rss_per_minute_mb": [per_minute[m] / 2**20 for m in sorted(per_minute)],
        "rss_slope_mb_per_10min": slope_per_10min([60.0 * m for m in whole], [per_minute[m] / 2**20 for m in whole]),
        "stage_s": r.stage_s,
        "model_s": {**r.model_s, "total": model_total},
        "encode_s": r.encode_s,
        "overhead_ratio": r.wall_s / max(model_total + r.encode_s, 1e-9),
        "fragments": r.num_fragments,
        "output_bytes": out_bytes,
        "output_sha256": digest.hexdigest(),
        "random_init": r.random_init,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="tiny", help="model family (tiny; wan: --preset tiny runs seeded random "
                   "weights at the tiny Wan shape, a release needs --checkpoint DIR)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--mode", choices=["streaming", "batch"], default="streaming")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: cores - 1, see pipeline.host.default_threads)")
    p.add_argument("--image", type=Path, default=None)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-overlap", action="store_true",
                   help="streaming: run SR + decode on the render loop, not on the emission lane")
    p.add_argument("--no-batch-steps", action="store_true",
                   help="one A2V sampling per step (not I_{k-1} with N_{k+1} in one batch)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--compare", action="store_true",
                   help="run streaming and batch in separate processes and print both plus ratios")
    p.add_argument("--compare-batch-steps", action="store_true",
                   help="run batched and unbatched steps side by side (--repeat pairs, ABBA order, one "
                        "process each) and print every run plus the median ratios")
    p.add_argument("--repeat", type=int, default=2, help="--compare-batch-steps: pairs of runs (default 2)")
    args = p.parse_args(argv)
    if args.compare_batch_steps:
        return _compare_batch_steps(args)
    if args.compare:
        results = {}
        for mode in ("streaming", "batch"):
            results[mode] = _run_child(args, mode=mode, batch_steps=not args.no_batch_steps)
        s, b = results["streaming"], results["batch"]
        results["ratios"] = {
            "ttff_batch_over_streaming": b["ttff_s"] / s["ttff_s"],
            "wall_batch_over_streaming": b["wall_s"] / s["wall_s"],
            "peak_rss_batch_over_streaming": b["peak_rss_bytes"] / s["peak_rss_bytes"],
        }
        print(json.dumps(results, indent=None if args.json else 2))
        return 0
    result = run_once(args.preset, args.seconds, args.mode, args.threads, args.image, args.checkpoint, args.seed,
                      overlap=not args.no_overlap, batch_steps=not args.no_batch_steps, family_name=args.family)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>16}: {v}")
    return 0


def _run_child(args: argparse.Namespace, *, mode: str, batch_steps: bool) -> dict[str, object]:
    """One render in a process of its own (peak RSS is a process high-water mark): its JSON result."""
    cmd = [sys.executable, "-m", "bench.stream", "--family", args.family, "--preset", args.preset,
           "--seconds", str(args.seconds),
           "--mode", mode, "--seed", str(args.seed), "--json"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    for flag, value in (("--image", args.image), ("--checkpoint", args.checkpoint)):
        if value is not None:
            cmd += [flag, str(value)]
    if args.no_overlap:
        cmd.append("--no-overlap")
    if not batch_steps:
        cmd.append("--no-batch-steps")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def _compare_batch_steps(args: argparse.Namespace) -> int:
    import statistics

    runs: dict[str, list[dict[str, object]]] = {"batched": [], "sequential": []}
    order = [("batched", "sequential")[(i + i // 2) % 2] for i in range(2 * args.repeat)]  # B S S B B S …
    for name in order:
        runs[name].append(_run_child(args, mode=args.mode, batch_steps=name == "batched"))

    def median(name: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in runs[name])  # type: ignore[arg-type]

    keys = ("wall_s", "cpu_s", "ttff_s", "realtime_factor", "a2v_forwards_per_video_s", "peak_rss_bytes")
    summary = {name: {k: median(name, k) for k in keys} for name in runs}
    summary["ratios_batched_over_sequential"] = {
        k: median("batched", k) / median("sequential", k) for k in keys}  # type: ignore[dict-item]
    summary["same_output"] = len({r["output_sha256"] for rs in runs.values() for r in rs}) == 1  # type: ignore[assignment]
    summary["runs"] = runs  # type: ignore[assignment]
    print(json.dumps(summary, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
