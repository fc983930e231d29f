"""Facts about the host a render runs on (no torch import: the worker's parent process uses them)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
from collections.abc import Callable


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


def peak_rss_bytes(pid: int | None = None) -> int:
    """Peak resident memory of this process (or of ``pid``; 0 when it is gone). Linux: ``VmHWM`` of
    the current address space — ``ru_maxrss`` survives ``exec`` and would report the parent's size
    for a process started by a large one (a test runner, a worker); it is the fallback for this
    process only."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if pid is None else 0


def reset_peak_rss(pid: int | None = None) -> bool:
    """Start ``VmHWM`` of this process (or of ``pid``) over from its current RSS (Linux >= 4.0,
    ``/proc/<pid>/clear_refs``); False where that is not possible."""
    try:
        with open(f"/proc/{pid or 'self'}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        trim: Callable[[int], int] = libc.malloc_trim  # glibc only; musl and macOS have none
    except (OSError, AttributeError):
        return None
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def release_free_heap() -> None:
    """Give the pages of free heap memory back to the kernel (glibc ``malloc_trim(0)``: every arena,
    every whole free page, not only the top of the heap); a no-op without glibc.

    Who calls it: ``Pipeline._emit``, once per emission after the frames are published, in every
    render (CLI, worker ranks, benchmarks). Why: each emission frees tens of MB of activations in
    the lanes' arenas; glibc keeps the freed pages resident and the resident set wandered by +-25 MB
    from one emission to the next, so the peak of a long render climbed with its number of
    emissions. Trimmed after each emission, RSS follows live memory (docs/benchmarks.md, "Memory as
    users run it", with its measured speed cost).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
