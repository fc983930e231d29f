"""NUMA binding: topology parsing from a fake sysfs tree, the fallbacks, and real CPU/memory binding
applied in a child process (so this test process keeps its affinity and policy)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from pipeline.placement.numa import (
    MPOL_BIND,
    MPOL_PREFERRED,
    bind_numa,
    current_mempolicy,
    numa_node_of_pci,
    parse_cpulist,
    set_mempolicy,
)

ADDR = "0000:dc:00.0"


def fake_sysfs(root: Path, gpu_node: str, node_cpus: dict[int, str]) -> Path:
    pci = root / "bus" / "pci" / "devices" / ADDR
    pci.mkdir(parents=True)
    (pci / "numa_node").write_text(gpu_node + "\n")
    nodes = root / "devices" / "system" / "node"
    for node, cpus in node_cpus.items():
        (nodes / f"node{node}").mkdir(parents=True)
        (nodes / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (nodes / "online").write_text(",".join(str(n) for n in node_cpus) + "\n")
    return root


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]
    assert parse_cpulist("") == []


def test_pci_numa_node(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path, "1", {0: "0", 1: "1"})
    assert numa_node_of_pci(ADDR.upper(), sysfs) == 1
    assert numa_node_of_pci("0000:00:01.0", sysfs) is None
    unknown = fake_sysfs(tmp_path / "b", "-1", {0: "0", 1: "1"})
    assert numa_node_of_pci(ADDR, unknown) is None


def test_fallbacks_bind_nothing(tmp_path: Path) -> None:
    affinity = os.sched_getaffinity(0)
    assert bind_numa(None).node is None
    one_node = fake_sysfs(tmp_path / "one", "0", {0: "0-1"})
    result = bind_numa(0, sysfs=one_node, pci_address=ADDR)
    assert (result.node, result.cpus_bound) == (None, False) and "one NUMA node" in result.reason
    unknown = fake_sysfs(tmp_path / "unknown", "-1", {0: "0", 1: "1"})
    result = bind_numa(0, sysfs=unknown, pci_address=ADDR)
    assert result.node is None and "no NUMA node for GPU 0" in result.reason
    assert os.sched_getaffinity(0) == affinity


def _bind_in_child(sysfs: str, strict: bool, use_libnuma: bool, out: mp.Queue) -> None:  # type: ignore[type-arg]
    if use_libnuma:
        result = bind_numa(0, sysfs=Path(sysfs), pci_address=ADDR, strict_memory=strict)
        out.put(
            (
                result.node,
                result.cpus,
                result.memory_method,
                sorted(os.sched_getaffinity(0)),
                current_mempolicy(),
            )
        )
    else:
        method = set_mempolicy(0, MPOL_BIND, use_libnuma=False)
        out.put((method, current_mempolicy()))


@pytest.mark.parametrize("strict", [False, True])
def test_binds_cpus_and_memory_in_child(tmp_path: Path, strict: bool) -> None:
    cpu = min(os.sched_getaffinity(0))
    # a fake two-node topology with the GPU on node 0, which holds only this machine's first CPU
    # (memory binding then targets real node 0, the one node a test machine surely has)
    sysfs = fake_sysfs(tmp_path, "0", {0: str(cpu), 1: "999"})
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_bind_in_child, args=(str(sysfs), strict, True, out))
    proc.start()
    node, cpus, method, affinity, (mode, mask) = out.get(timeout=60)
    proc.join(30)
    assert node == 0 and cpus == (cpu,) and affinity == [cpu]
    assert method in ("libnuma", "syscall")
    assert mode == (MPOL_BIND if strict else MPOL_PREFERRED) and mask == 1


def test_set_mempolicy_syscall_without_libnuma() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_bind_in_child, args=("/sys", True, False, out))
    proc.start()
    method, (mode, mask) = out.get(timeout=60)
    proc.join(30)
    assert method == "syscall" and mode == MPOL_BIND and mask == 1
