"""The machine a benchmark's figures come from, recorded in its JSON as ``"machine"``.

The same code, weights and inputs do not render the same bits on every machine: torch picks its CPU
kernels by the instruction set it finds (``torch.backends.cpu.get_cpu_capability()``: DEFAULT, AVX2,
AVX512; ``ATEN_CPU_CAPABILITY`` overrides it), a sum taken in another order moves a float's last bit,
and the sampler carries that difference through every step. ``make demo``'s MP4 is byte-identical
run after run on one machine and differs between machines; figures built on renders (lip sync, the
seam jump, every fidelity ratio) move with it. docs/quality.md "Figures are per machine" has the
measurements. So a figure is compared only with one measured beside it, on the machine this record
names.

Who calls it: ``bench.quality`` (every mode), ``bench.reconstruction``, ``bench.stream`` and
``bench.live``, into the JSON they print.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``), else what :mod:`platform` knows, else
    ``"unknown"``."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict[str, str | int]:
    """``{"cpu", "cores", "torch", "torch_cpu_capability"}``: what decides the bits a render comes out
    with (the thread count does not here: a render with 1 thread is byte-identical to one with 2)."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "torch": str(torch.__version__),
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
    }
