"""Where a long render's memory goes: RSS split into its parts, sampled per emission.

    python -m bench.memprofile --seconds 600 --json > profile.json

Renders the tiny preset (default configuration: the shipped checkpoint, default threads, streaming
with the emission lane) of a generated speech WAV and, from ``on_progress`` (the caller's thread,
once per published emission), records:

* ``rss`` (``VmRSS``), ``anon`` / ``file`` (``/proc/self/smaps_rollup``: anonymous and file-backed
  resident pages: the shared libraries, and the audio tracks while they were memory-mapped);
* glibc malloc (``mallinfo2``): ``heap_in_use`` (``uordblks``, live small/medium blocks in all
  arenas), ``heap_free`` (``fordblks``, free bytes the arenas keep, resident or not), ``mmapped``
  (``hblkhd``, live blocks served by mmap) and ``arenas`` (from ``malloc_info``);
* ``python_heap`` (``tracemalloc``: Python objects and numpy buffers; off with ``--no-tracemalloc``);
* ``tensors`` (bytes of the distinct storages of every live ``torch.Tensor`` the GC knows);
* the Python object counts by type (the types whose count grows are listed in ``grown_types``).

The summary gives, per component, the value after warm-up, at the end, and the least-squares slope
in MB per 10 minutes of video (samples of the first ``--warmup-s`` video seconds are skipped).
Profiling costs time (tracemalloc, a GC walk per sample): its timings are not the renderer's.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections import Counter
from pathlib import Path

from bench.inputs import DEMO_IMAGE, speech_wav

MB = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


_libc = ctypes.CDLL(None)
_libc.mallinfo2.restype = _Mallinfo2
_libc.fopen.restype = ctypes.c_void_p
_libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
_libc.fclose.argtypes = [ctypes.c_void_p]
_libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]


def malloc_stats() -> dict[str, int]:
    """glibc's totals over all arenas, and how many arenas there are."""
    m = _libc.mallinfo2()
    with tempfile.NamedTemporaryFile(prefix="longtake-malloc-info-", suffix=".xml") as tmp:
        fp = _libc.fopen(tmp.name.encode(), b"w")
        _libc.malloc_info(0, fp)
        _libc.fclose(fp)
        arenas = len(re.findall(r"<heap nr=", Path(tmp.name).read_text()))
    return {"heap_in_use": m.uordblks, "heap_free": m.fordblks, "mmapped": m.hblkhd, "arenas": arenas}


def smaps_rollup() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {"rss": out["Rss"], "anon": out["Anonymous"], "file": out["Rss"] - out["Anonymous"]}


def tensor_bytes() -> tuple[int, Counter[str]]:
    import torch

    storages: dict[int, int] = {}
    types: Counter[str] = Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch.distributed aliases
        objects = gc.get_objects()
    for obj in objects:
        types[type(obj).__qualname__] += 1
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            try:
                s = obj.untyped_storage()
            except RuntimeError:
                continue
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values()), types


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs, in y units per x unit (0 for fewer than two distinct xs)."""
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def slope_per_10min(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (video seconds), as units per 600 s."""
    return 600.0 * least_squares_slope(xs, ys)


COMPONENTS = ("rss", "anon", "file", "heap_in_use", "heap_free", "mmapped", "python_heap", "tensors")


def profile(seconds: float, *, seed: int = 0, every: int = 1, use_tracemalloc: bool = True,
            warmup_s: float = 30.0) -> dict[str, object]:
    import torch

    from pipeline.host import default_threads, peak_rss_bytes
    from pipeline.render import RenderProgress, RenderRequest, render
    from pipeline.sinks import FileSink

    torch.set_num_threads(default_threads())
    samples: list[dict[str, float]] = []
    first_types: Counter[str] | None = None
    last_types: Counter[str] = Counter()
    if use_tracemalloc:
        tracemalloc.start()

    with tempfile.TemporaryDirectory(prefix="longtake-memprofile-") as tmp:
        audio = speech_wav(Path(tmp) / "speech.wav", seconds, seed=seed)
        t0 = time.perf_counter()

        def sample(p: RenderProgress) -> None:
            nonlocal first_types, last_types
            if p.emission_index % every and p.emission_index != p.num_emissions - 1:
                return
            nbytes, types = tensor_bytes()
            row: dict[str, float] = {"emission": p.emission_index, "video_s": p.frames_done / 25.0,
                                     "wall_s": time.perf_counter() - t0, **smaps_rollup(), **malloc_stats(),
                                     "python_heap": tracemalloc.get_traced_memory()[0] if use_tracemalloc else 0,
                                     "tensors": nbytes}
            samples.append(row)
            if first_types is None and row["video_s"] >= warmup_s:
                first_types = types
            last_types = types

        request = RenderRequest(image=DEMO_IMAGE, audio=audio, seed=seed)
        result = render(request, [FileSink(Path(tmp) / "out.mp4")], on_progress=sample)
    steady = [s for s in samples if s["video_s"] >= warmup_s] or samples
    xs = [s["video_s"] for s in steady]
    summary = {name: {"after_warmup_mb": steady[0][name] / MB, "end_mb": steady[-1][name] / MB,
                      "slope_mb_per_10min": slope_per_10min(xs, [s[name] / MB for s in steady])}
               for name in COMPONENTS}
    grown = {k: last_types[k] - (first_types or Counter())[k] for k in last_types}
    return {
        "seconds": seconds,
        "wall_s": result.wall_s,
        "peak_rss_mb": peak_rss_bytes() / MB,
        "arenas_end": samples[-1]["arenas"] if samples else 0,
        "summary": summary,
        "grown_types": dict(sorted(((k, v) for k, v in grown.items() if v > 0), key=lambda kv: -kv[1])[:15]),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memprofile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=1, help="sample every N-th emission (and the last)")
    p.add_argument("--warmup-s", type=float, default=30.0, help="video seconds left out of the slopes")
    p.add_argument("--no-tracemalloc", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object (with every sample)")
    args = p.parse_args(argv)
    r = profile(args.seconds, seed=args.seed, every=args.every, use_tracemalloc=not args.no_tracemalloc,
                warmup_s=args.warmup_s)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{args.seconds:.0f} s of video in {r['wall_s']:.0f} s, peak RSS {r['peak_rss_mb']:.1f} MB, "
          f"{r['arenas_end']} malloc arenas")
    print(f"{'component':>12} {'after warm-up':>14} {'end':>10} {'MB / 10 min':>12}")
    for name, s in r["summary"].items():  # type: ignore[attr-defined]
        print(f"{name:>12} {s['after_warmup_mb']:>14.1f} {s['end_mb']:>10.1f} {s['slope_mb_per_10min']:>12.2f}")
    print("grown types:", r["grown_types"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
