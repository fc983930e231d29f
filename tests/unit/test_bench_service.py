"""bench.service's memory sampling of a worker's process tree (its per-minute peaks)."""

from __future__ import annotations

import subprocess
import sys

from bench.service import _peak_since_reset, _tree_peaks


def test_peaks_per_minute_see_a_spike_between_samples_and_then_reset() -> None:
    # a child that allocates 200 MB, frees it, then waits: a single RSS sample after the spike sees
    # nothing; the peak since the last reset does, once, and not after the reset
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nb = bytearray(200 << 20)\nb[::4096] = b'x' * "
                              "len(b[::4096])\ndel b\nprint('freed', flush=True)\ntime.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "freed"
        peaks = _tree_peaks(child.pid)  # the child is the "worker" of its own tree: no descendants
        assert peaks["worker_peak"] > 200 << 20 and peaks["rank_peak"] == 0
        again = _peak_since_reset(child.pid)
        assert 0 < again < 100 << 20  # reset to its current resident set, far below the spike
    finally:
        child.kill()
        child.wait()
    assert _peak_since_reset(child.pid) == 0  # gone
