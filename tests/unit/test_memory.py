"""Constant memory: peak RSS of a 4N-chunk render stays within the run-to-run noise of an N-chunk
render (streaming), while the batch baseline grows. Each render runs in a fresh process (peak RSS is
a high-water mark).

The renders run in the default configuration, as ``longtake render`` and the worker run them: no
allocator or thread settings in the environment. What keeps them flat is in the code: the audio
tracks are read without being mapped (``pipeline.inputs.AudioSource``) and the free heap is given
back after every emission (``pipeline.host.release_free_heap``); docs/benchmarks.md has the profile
that found both.

A streaming render's peak is the moment the three lanes' activations coincide, which depends on how
the threads are scheduled: fresh processes of the same length differ by +-2-3% on a loaded machine
(458-502 MB for 7.68 s), while a leak shows in every run. So each length takes the lower of two
runs, at lengths past the lanes' warm-up; the batch baseline, which holds every latent, must still
grow.

The bound is 10%, not the 2% the benchmark shows (60 s vs 600 s: 1.005, docs/benchmarks.md): with
glibc's default arenas the heap that is free but kept swings by ~50 MB between runs, and measured
ratios of this very test were 1.0045, 1.035 and 1.058 on one machine. 10% of a ~500 MB peak still
fails a render that keeps ~0.8 MB per second of video, and the batch control grows 1.8x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHUNK_S = 16 / 25  # one N chunk of the tiny preset


def peak_rss(mode: str, chunks: float) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # the default configuration
    out = subprocess.run(
        [sys.executable, "-m", "bench.stream", "--preset", "tiny", "--seconds", str(chunks * CHUNK_S),
         "--mode", mode, "--json"],
        cwd=REPO, check=True, capture_output=True, text=True, timeout=900, env=env,
    ).stdout
    return int(json.loads(out.strip().splitlines()[-1])["peak_rss_bytes"])


@pytest.mark.slow
def test_streaming_peak_memory_is_flat_and_batch_grows() -> None:
    # Streaming: 24 chunks (15.4 s) against 96 (61 s). Shorter renders have not reached the lanes'
    # steady overlap: 3 vs 12 chunks read 1.04-1.05, 6 vs 24 read 1.024, 60 s vs 600 s 1.005.
    s_small = min(peak_rss("streaming", 24) for _ in range(2))
    s_large = min(peak_rss("streaming", 96) for _ in range(2))
    n = 3  # the batch control: it holds every latent, so 4x the chunks is ~2x the peak already
    b_small, b_large = peak_rss("batch", n), peak_rss("batch", 4 * n)
    print(f"streaming 24: {s_small}  96: {s_large}  ratio {s_large / s_small:.4f}")
    print(f"batch     {n}: {b_small}  {4 * n}: {b_large}  ratio {b_large / b_small:.4f}")
    assert s_large <= s_small * 1.10, (s_small, s_large)
    assert b_large > b_small * 1.05, (b_small, b_large)
