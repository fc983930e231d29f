"""Bind a rank process to its GPU's NUMA node: CPUs (sched_setaffinity) and memory (mempolicy).

Who calls this: each rank process of :class:`pipeline.placement.engine.NodeEngine`, first thing after
start, before any pinned host allocation (pinned buffers are placed by the memory policy in force
when they are first touched) and before torch starts its thread pools (new threads inherit the
affinity; existing threads of this process are re-bound too).

Topology comes from sysfs: the GPU's PCI address (``torch.cuda.get_device_properties``: domain, bus,
device) -> ``/sys/bus/pci/devices/<addr>/numa_node`` -> ``/sys/devices/system/node/node<N>/cpulist``.
Memory binding uses libnuma's ``numa_set_membind`` through ctypes when ``libnuma.so.1`` loads, else the
``set_mempolicy`` system call directly (x86_64 / aarch64 numbers). With no GPU, one NUMA node, or a
``numa_node`` of -1 (firmware did not say) nothing is bound and :class:`NumaBinding` says why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MPOL_BIND = 2
MPOL_PREFERRED = 1
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
_SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}


@dataclass(frozen=True)
class NumaBinding:
    """What :func:`bind_numa` did. ``node`` is None when nothing was bound; ``reason`` says why."""

    node: int | None
    cpus: tuple[int, ...]
    cpus_bound: bool
    memory_bound: bool
    memory_method: str  # "libnuma", "syscall", or "" when memory was not bound
    reason: str


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the sysfs cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_pci_address(device_index: int) -> str:
    """The sysfs PCI address (``"0000:dc:00.0"``) of CUDA device ``device_index`` (GPU only)."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    # the PCI fields exist on CUDA builds' device properties but not in torch's type stubs
    domain, bus, dev = (int(getattr(props, f"pci_{k}_id")) for k in ("domain", "bus", "device"))
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def numa_node_of_pci(address: str, sysfs: Path = Path("/sys")) -> int | None:
    """The NUMA node a PCI device is attached to, or None when sysfs does not say (-1 or missing)."""
    path = sysfs / "bus" / "pci" / "devices" / address.lower() / "numa_node"
    try:
        node = int(path.read_text().strip())
    except FileNotFoundError:
        return None
    return node if node >= 0 else None


def online_nodes(sysfs: Path = Path("/sys")) -> list[int]:
    path = sysfs / "devices" / "system" / "node" / "online"
    try:
        return parse_cpulist(path.read_text())
    except FileNotFoundError:
        return [0]


def node_cpus(node: int, sysfs: Path = Path("/sys")) -> list[int]:
    return parse_cpulist((sysfs / "devices" / "system" / "node" / f"node{node}" / "cpulist").read_text())


def bind_numa(
    device_index: int | None,
    *,
    node: int | None = None,
    pci_address: str | None = None,
    bind_memory: bool = True,
    strict_memory: bool = False,
    sysfs: Path = Path("/sys"),
) -> NumaBinding:
    """Bind this process's CPUs (and memory) to the NUMA node of CUDA device ``device_index``.

    Args:
        device_index: the rank's CUDA device, or None on a CPU-only rank (nothing is bound unless
            ``node`` is given).
        node: bind to this node instead of looking the GPU up (tests; explicit deployments).
        pci_address: the GPU's PCI address if already known (else read from CUDA's device properties).
        bind_memory: also set the memory policy, so pinned buffers land on the GPU's node.
        strict_memory: ``MPOL_BIND`` (allocation fails rather than spill to another node) instead of
            ``MPOL_PREFERRED`` (spill when the node is full). Preferred is the default: a parked 14B
            model must not crash a rank because one node is short of free pages.
        sysfs: root of sysfs (tests point it at a fake tree).

    Returns:
        a :class:`NumaBinding` describing what was done. Never raises for a missing topology; raises
        ``OSError`` when the kernel refuses a binding it was asked for.
    """
    nodes = online_nodes(sysfs)
    if node is None:
        if device_index is None:
            return NumaBinding(None, (), False, False, "", "no GPU for this rank: nothing to bind")
        if len(nodes) <= 1:
            return NumaBinding(None, (), False, False, "", f"one NUMA node online ({nodes}): nothing to bind")
        address = pci_address or gpu_pci_address(device_index)
        node = numa_node_of_pci(address, sysfs)
        if node is None:
            return NumaBinding(
                None, (), False, False, "", f"sysfs gives no NUMA node for GPU {device_index} at {address}"
            )
    allowed = os.sched_getaffinity(0)
    cpus = tuple(c for c in node_cpus(node, sysfs) if c in allowed)
    if not cpus:
        return NumaBinding(
            node,
            (),
            False,
            False,
            "",
            f"no CPU of node {node} is in this process's affinity {sorted(allowed)}",
        )
    _bind_all_threads(set(cpus))
    method = ""
    if bind_memory:
        method = set_mempolicy(node, MPOL_BIND if strict_memory else MPOL_PREFERRED)
    binding = NumaBinding(node, cpus, True, bool(method), method, f"bound to NUMA node {node}")
    logger.info("NUMA: %s, cpus=%s, memory=%s", binding.reason, list(cpus), method or "not bound")
    return binding


def _bind_all_threads(cpus: set[int]) -> None:
    """Bind the calling thread and every other thread of the process that still has the default mask."""
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    for tid_text in os.listdir("/proc/self/task"):
        tid = int(tid_text)
        try:
            if os.sched_getaffinity(tid) == original:
                os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread exited meanwhile: nothing to bind
            continue


def set_mempolicy(node: int, mode: int, *, use_libnuma: bool = True) -> str:
    """Set the calling thread's memory policy (inherited by threads it starts) to ``node``.

    Returns the method used: "libnuma", "syscall", or "" when neither is available (logged).
    """
    libnuma = None
    if use_libnuma:
        try:
            libnuma = ctypes.CDLL(ctypes.util.find_library("numa") or "libnuma.so.1", use_errno=True)
        except OSError:  # no libnuma on this machine: the raw system call below does the same
            libnuma = None
    if libnuma is not None and libnuma.numa_available() >= 0:
        libnuma.numa_allocate_nodemask.restype = ctypes.c_void_p
        libnuma.numa_bitmask_setbit.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        libnuma.numa_bitmask_setbit.restype = ctypes.c_void_p
        libnuma.numa_set_membind.argtypes = [ctypes.c_void_p]
        libnuma.numa_bitmask_free.argtypes = [ctypes.c_void_p]
        if mode == MPOL_BIND:
            mask = libnuma.numa_allocate_nodemask()
            libnuma.numa_bitmask_setbit(mask, node)
            libnuma.numa_set_membind(mask)
            libnuma.numa_bitmask_free(mask)
        else:
            libnuma.numa_set_preferred.argtypes = [ctypes.c_int]
            libnuma.numa_set_preferred(node)
        return "libnuma"
    number = _SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        logger.warning(
            "NUMA: no libnuma and no set_mempolicy number for %s: memory not bound", platform.machine()
        )
        return ""
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(1 << node)
    if libc.syscall(number, mode, ctypes.byref(mask), ctypes.c_ulong(node + 2)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy(mode={mode}, node={node}) failed: {os.strerror(err)}")
    return "syscall"


def current_mempolicy() -> tuple[int, int]:
    """(mode, nodemask) of the calling thread, via the get_mempolicy system call (Linux x86_64/aarch64)."""
    number = _SYS_GET_MEMPOLICY[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    mode = ctypes.c_int(0)
    mask = ctypes.c_ulong(0)
    if (
        libc.syscall(
            number, ctypes.byref(mode), ctypes.byref(mask), ctypes.c_ulong(64), None, ctypes.c_ulong(0)
        )
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy failed: {os.strerror(err)}")
    return mode.value, mask.value
