"""Facts about the host a render runs on (no torch import: the worker's parent process uses them)."""

from __future__ import annotations

import os
import resource


def default_threads(processes: int = 1) -> int:
    """Torch threads for one of ``processes`` render processes sharing this machine's cores: all of
    its share but one core, which the publisher thread (encoding, uploads) needs. On a 2-core
    machine that is one thread — measured 5-8x faster than two when anything else is running,
    because a parallel region waits for its slowest (descheduled) thread."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, processes) - 1)


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux: ``VmHWM`` of the current address space —
    ``ru_maxrss`` survives ``exec`` and would report the parent's size for a process started by a
    large one (a test runner, a worker)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
