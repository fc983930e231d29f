"""Module loaders for a model family on a NodeEngine rank: build its modules with the family's one
weight builder, place them as its parallelize plan says (FSDP2 sharding for the block models it
names, plain device placement for the rest) and register the sharded ones with the rank's parker.

Who calls this: whoever builds the :class:`~pipeline.placement.engine.EngineConfig` (the worker, the
benchmarks, the tests): ``EngineConfig(loaders=family_loaders(FAMILIES.get("tiny"), "tiny"))``. Each
rank then calls every loader once at start; the modules stay warm in ``ctx.modules``. Family-neutral:
the family object travels (pickled) with each loader.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline.model_family import ModelFamily
from pipeline.placement.fsdp import parallelize
from pipeline.placement.rank import ModuleLoader, RankContext
from pipeline.weights_identity import weights_identity

logger = logging.getLogger(__name__)


def is_block_model(module: nn.Module) -> bool:
    """True for models with a non-empty ``blocks: nn.ModuleList`` (what ``parallelize`` can shard)."""
    blocks = getattr(module, "blocks", None)
    return isinstance(blocks, nn.ModuleList) and len(blocks) > 0


def _place(ctx: RankContext, name: str, module: nn.Module, *, shard: bool, prefetch: int,
           methods: tuple[str, ...]) -> nn.Module:
    """Shard ``module`` with :func:`parallelize` and register it with ``ctx.parker`` (when ``shard``),
    or move it whole to the device."""
    if shard:
        parallelize(module, ctx.mesh, prefetch=prefetch, forward_methods=methods)
        ctx.parker.register(name, module, gathers_ahead=prefetch, methods=methods)
        return module
    return module.to(ctx.device)


@dataclass(frozen=True)
class FamilySource:
    """Where a rank's module came from: the family, the preset name, the checkpoint (None: random
    init), whether it is registered with ``ctx.parker`` (the render activates those per stage), and
    the identity of its weights as loaded (``weights_identity`` of the checkpoint when the module was
    loaded, plus a non-default seed / dtype: the resume key's ``weights``)."""

    family: ModelFamily
    preset: str
    checkpoint: Path | None
    parked: bool
    weights_id: str = ""


# name -> source of each module family_loaders built in this rank process (render_on_rank checks
# that a request asks for the family, preset and checkpoint the rank holds). Written once per module
# at rank start.
FAMILY_SOURCES: dict[str, FamilySource] = {}


def load_family_module(
    ctx: RankContext,
    *,
    family: ModelFamily,
    preset: str,
    name: str,
    checkpoint: str = "",
    random_init: bool = False,
    seed: int = 0,
    shard: bool = True,
    prefetch: int = 1,
    dtype: str = "",
    build_on_device: bool = False,
) -> nn.Module:
    """Build module ``name`` exactly as the single-process render does (``family.modules``) and place
    it (see :func:`family_loaders`); ``shard``: FSDP2-shard it and register it with the parker."""
    resolved = family.preset(preset)
    ckpt = (Path(checkpoint) if checkpoint else None if random_init else family.default_checkpoint(resolved))
    # read right before the weights are: what this module computes with, for the resume key
    weights_id = weights_identity(ckpt) + (f"+seed{seed}" if seed else "") + (f"+{dtype}" if dtype else "")
    device = str(ctx.device) if build_on_device else "cpu"
    modules = family.modules(resolved, ckpt, device=device, seed=seed)
    if name not in modules:
        raise KeyError(f"family {family.name!r} preset {preset!r} has no module {name!r}; "
                       f"its modules: {sorted(modules)}")
    # random init straight on the GPU: much faster for the 1.3b / 14b benchmarks
    with torch.device(ctx.device) if build_on_device else contextlib.nullcontext():
        model = modules[name].get()  # seeded init (+ checkpoint), float32, eval, requires_grad False
    if dtype:
        model = model.to(getattr(torch, dtype))
    shard = shard and is_block_model(model)
    placed = _place(ctx, name, model, shard=shard, prefetch=prefetch,
                    methods=tuple(family.parallel.forward_methods.get(name, ())))
    FAMILY_SOURCES[name] = FamilySource(family, preset, ckpt, parked=shard and ctx.parker.enabled,
                                        weights_id=weights_id)
    return placed


def family_loaders(
    family: ModelFamily,
    preset: str,
    names: Sequence[str] | None = None,
    *,
    checkpoint: Path | None = None,
    random_init: bool = False,
    seed: int = 0,
    shard: Sequence[str] | None = None,
    prefetch: int = 1,
    dtype: str = "",
    build_on_device: bool = False,
) -> dict[str, ModuleLoader]:
    """Loaders for the modules ``names`` (default: all) of ``family``'s ``preset``, built by
    ``family.modules`` — the same seeded init and ``checkpoint`` (default: the family's shipped one
    for the preset, as the in-process render; ``random_init``: none, seeded by ``seed``) as the
    single-process render. The modules in ``shard`` (default ``family.parallel.sharded``) are
    FSDP2-sharded (also on one rank: the same code path) and registered with the parker; the others
    are placed whole on every rank. ``dtype``: "bfloat16" / "float16" to store weights in (empty
    keeps float32); ``build_on_device``: random init on the rank's device (benchmarks).
    """
    if names is None:
        names = list(family.modules(family.preset(preset), None))
    sharded = family.parallel.sharded if shard is None else tuple(shard)
    return {
        name: functools.partial(
            load_family_module,
            family=family,
            preset=preset,
            name=name,
            checkpoint=str(checkpoint) if checkpoint else "",
            random_init=random_init,
            seed=seed,
            shard=name in sharded,
            prefetch=prefetch,
            dtype=dtype,
            build_on_device=build_on_device,
        )
        for name in names
    }
