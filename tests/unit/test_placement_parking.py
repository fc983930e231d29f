"""ModelParker on CPU: the park / just-in-time restore path runs for real with enabled=True (the
storages are freed and refilled from the host copy), so outputs and the restore order are checked
here; enabled=False (the CPU default) must leave the model untouched."""

from __future__ import annotations

import pytest
import torch

from pipeline.placement.parking import ROOT_GROUP, ModelParker, ParkEvent
from tests.distributed import placement_support as ps


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def run(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return model(ps.make_input(seed))


def test_parked_then_restored_gives_identical_outputs() -> None:
    model = ps.build_model()
    expected = run(model)
    parker = ModelParker(torch.device("cpu"), enabled=True)
    parker.register("dit", model)
    total = parker.get("dit").nbytes
    assert total == sum(p.numel() * p.element_size() for p in model.parameters()) + model.pos.nbytes
    parker.park("dit")
    assert parker.resident_bytes() == {"dit": 0}
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters()), (
        "parking must free the storages"
    )
    assert torch.equal(run(model), expected)
    assert parker.resident_bytes() == {"dit": total}
    # parking again and again is stable (the host copy is the truth)
    for _ in range(3):
        parker.park("dit")
        assert torch.equal(run(model), expected)


def test_blocks_return_just_in_time_in_order() -> None:
    model = ps.build_model()
    log: list[str] = []
    parker = ModelParker(
        torch.device("cpu"), enabled=True, listener=lambda e: log.append(f"{e.kind} {e.group}")
    )
    parker.register("dit", model, lookahead=1)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: log.append(f"start {i}"))
        block.register_forward_hook(lambda m, a, o, i=i: log.append(f"end {i}"))
    parker.park("dit")
    log.clear()
    run(model)
    assert log[:2] == [f"issue {ROOT_GROUP}", f"wait {ROOT_GROUP}"]
    for i in range(ps.DEPTH):
        # block i is back before it starts; block i+1's copy is issued before block i's compute
        assert log.index(f"wait {i}") < log.index(f"start {i}"), log
        if i + 1 < ps.DEPTH:
            assert log.index(f"issue {i + 1}") < log.index(f"start {i}") < log.index(f"wait {i + 1}"), log
    # nothing is brought back before it is needed: block 3 is issued only once block 2 starts
    assert log.index(f"issue {ps.DEPTH - 1}") > log.index(f"end {ps.DEPTH - 3}"), log
    waits = [e for e in log if e.startswith("wait")]
    assert waits == [f"wait {g}" for g in [ROOT_GROUP, *range(ps.DEPTH)]]


def test_activate_switches_models() -> None:
    a, b = ps.build_model(0), ps.build_model(1)
    ya, yb = run(a), run(b)
    events: list[ParkEvent] = []
    parker = ModelParker(torch.device("cpu"), enabled=True, listener=events.append)
    parker.register("a", a)
    parker.register("b", b)
    parker.activate("a")  # b is parked, a stays resident
    assert parker.resident_bytes()["b"] == 0 and parker.resident_bytes()["a"] > 0
    assert torch.equal(run(a), ya)
    events.clear()
    parker.activate("b")  # a parked; b's root and first block start coming back before b runs
    assert parker.resident_bytes()["a"] == 0
    assert {(e.kind, e.group) for e in events if e.model == "b"} == {("issue", ROOT_GROUP), ("issue", 0)}
    assert torch.equal(run(b), yb)
    assert torch.equal(run(a), ya)  # used without activate: restored on demand, still correct


def test_disabled_parker_is_a_no_op() -> None:
    model = ps.build_model()
    expected = run(model)
    parker = ModelParker(torch.device("cpu"))
    assert not parker.enabled  # the CPU default: weights already live in host memory
    parker.register("dit", model)
    parker.park("dit")
    parker.activate("dit")
    assert parker.resident_bytes() == {}
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert torch.equal(run(model), expected)


def test_model_without_blocks_is_rejected() -> None:
    parker = ModelParker(torch.device("cpu"), enabled=True)
    with pytest.raises(TypeError, match="no non-empty `blocks: nn.ModuleList`"):
        parker.register("mlp", torch.nn.Sequential(torch.nn.Linear(2, 2)))
