"""The real tiny preset (A2V DiT + SR DiT from models/) through the NodeEngine with family_loaders:
FSDP2-sharded over 2 gloo ranks with parking enabled, against the plain modules in this process.

Observed: bit-identical (torch.equal) — same reason as the generic model (exact all-gather, same
kernels, one thread); embed_context / embed_reference, called on their own, all-gather and return
parked parameters like forward does."""

from __future__ import annotations

import pytest
import torch

from models.checkpoint import build_modules
from models.presets import get_preset
from pipeline.families import FAMILIES
from pipeline.placement.engine import EngineConfig, NodeEngine
from pipeline.placement.loaders import family_loaders
from tests.distributed import placement_support as ps

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(240)
def test_tiny_preset_sharded_and_parked_equals_plain() -> None:
    torch.set_num_threads(1)
    modules = build_modules(get_preset("tiny"), seed=0)
    v, hr = ps.tiny_stage_outputs(modules["a2v"].eval(), modules["sr"].eval())
    config = EngineConfig(world_size=2, loaders=family_loaders(FAMILIES.get("tiny"), "tiny", ["a2v", "sr"], random_init=True), park=True)
    with NodeEngine(config) as engine:
        out = engine.run(ps.job_tiny_stages, {}).value
    assert isinstance(out, dict)
    assert int(out["parked_bytes"]) == 0
    for key in ("v", "v_parked", "v_switch"):
        assert torch.equal(out[key], v), (key, (out[key] - v).abs().max())
    for key in ("hr", "hr_parked", "hr_switch"):
        assert torch.equal(out[key], hr), (key, (out[key] - hr).abs().max())
