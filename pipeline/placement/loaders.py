"""Module loaders for the reference model family: build (or load) a preset's modules on a rank, place
them (FSDP2 sharding for block models, plain device placement for the small encoders) and register
the block models with the rank's parker.

Who calls this: whoever builds the :class:`~pipeline.placement.engine.EngineConfig` (the worker, the
benchmarks, the tests): ``EngineConfig(loaders=preset_loaders("tiny", ["a2v", "sr", "vae", "audio"]))``.
Each rank then calls every loader once at start; the modules stay warm in ``ctx.modules``.

Two ways to build the weights: :func:`preset_loaders` uses ``models.checkpoint.build_modules(preset,
seed)`` (benchmarks, placement tests); :func:`family_loaders` uses ``pipeline.family.family_modules``,
the very construction of the single-process render (same seeds, same checkpoint loading), so a
sharded render over them produces the single-process frames. ``render_on_rank`` needs the latter.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline.placement.fsdp import parallelize
from pipeline.placement.rank import ModuleLoader, RankContext

logger = logging.getLogger(__name__)

# Root methods the pipeline calls on their own (once per chunk) that read root parameters.
FORWARD_METHODS: dict[str, tuple[str, ...]] = {"a2v": ("embed_context",), "sr": ("embed_reference",)}

SHARDED_FAMILY_MODULES = ("a2v", "sr")  # the large models; the encoders stay whole on each rank

# Modules built for this rank and not yet taken by their loader: build_modules makes every module of a
# preset at once (each from its own seed), so the first loader builds them and the others take theirs.
# An entry is dropped as soon as its last requested module is taken; nothing is kept after loading.
_PENDING: dict[tuple[str, int, str, str], dict[str, nn.Module]] = {}


def _take(
    preset: str,
    seed: int,
    checkpoint: str,
    names: tuple[str, ...],
    name: str,
    device: torch.device,
    build_on_device: bool,
) -> nn.Module:
    from models.checkpoint import build_modules, load_checkpoint
    from models.presets import get_preset

    key = (preset, seed, checkpoint, ",".join(names))
    if key not in _PENDING:
        if build_on_device:  # random init straight on the GPU: much faster for 1.3b/14b benchmarks
            with torch.device(device):
                built = build_modules(get_preset(preset), seed)
        else:
            built = build_modules(get_preset(preset), seed)
        if checkpoint:
            load_checkpoint(built, checkpoint)
        _PENDING[key] = {n: m for n, m in built.items() if n in names}
        del built
    pending = _PENDING[key]
    if name not in pending:
        raise KeyError(f"preset {preset!r} has no module {name!r} (or it was loaded twice); names: {names}")
    module = pending.pop(name)
    if not pending:
        del _PENDING[key]
    return module.eval().requires_grad_(False)


def load_preset_module(
    ctx: RankContext,
    *,
    preset: str,
    name: str,
    names: tuple[str, ...],
    seed: int = 0,
    checkpoint: str = "",
    shard: bool = True,
    prefetch: int = 1,
    dtype: str = "",
    build_on_device: bool = False,
) -> nn.Module:
    """Build module ``name`` of ``preset`` on this rank and place it (see :func:`preset_loaders`)."""
    module = _take(preset, seed, checkpoint, names, name, ctx.device, build_on_device)
    if dtype:
        module = module.to(getattr(torch, dtype))
    return _place(ctx, name, module, shard=shard, prefetch=prefetch, register=True)


def is_block_model(module: nn.Module) -> bool:
    """True for models with a non-empty ``blocks: nn.ModuleList`` (what ``parallelize`` can shard)."""
    blocks = getattr(module, "blocks", None)
    return isinstance(blocks, nn.ModuleList) and len(blocks) > 0


def _place(
    ctx: RankContext, name: str, module: nn.Module, *, shard: bool, prefetch: int, register: bool
) -> nn.Module:
    """Shard ``module`` with :func:`parallelize` (when ``shard``) or move it whole to the device, and
    register it with ``ctx.parker`` when ``register`` (both need a block model)."""
    methods = FORWARD_METHODS.get(name, ())
    if shard and is_block_model(module):
        parallelize(module, ctx.mesh, prefetch=prefetch, forward_methods=methods)
        if register:
            ctx.parker.register(name, module, gathers_ahead=prefetch, methods=methods)
        return module
    module = module.to(ctx.device)
    if register and is_block_model(module):
        ctx.parker.register(name, module, methods=methods)
    return module


@dataclass(frozen=True)
class FamilySource:
    """Where a rank's family module came from: the preset name, the checkpoint (None: random init),
    and whether it is registered with ``ctx.parker`` (the render activates those per stage)."""

    preset: str
    checkpoint: Path | None
    parked: bool


# name -> source of each module family_loaders built in this rank process (render_on_rank checks
# that a request asks for the preset the rank holds). Written once per module at rank start.
FAMILY_SOURCES: dict[str, FamilySource] = {}


def load_family_module(
    ctx: RankContext,
    *,
    preset: str,
    name: str,
    checkpoint: str = "",
    shard: bool = True,
    prefetch: int = 1,
) -> nn.Module:
    """Build module ``name`` exactly as the single-process render does and place it (see
    :func:`family_loaders`); ``shard``: FSDP2-shard it and register it with the parker."""
    from pipeline.family import default_checkpoint, family_modules, resolve_preset

    ckpt = Path(checkpoint) if checkpoint else default_checkpoint(preset)
    modules = family_modules(resolve_preset(preset), ckpt)
    if name not in modules:
        raise KeyError(f"preset {preset!r} has no module {name!r}; its modules: {sorted(modules)}")
    model = modules[name].get()  # seeded init (+ checkpoint), float32, eval, requires_grad False
    shard = shard and is_block_model(model)
    placed = _place(ctx, name, model, shard=shard, prefetch=prefetch, register=shard)
    FAMILY_SOURCES[name] = FamilySource(preset, ckpt, parked=shard and ctx.parker.enabled)
    return placed


def family_loaders(
    preset: str,
    names: Sequence[str] | None = None,
    *,
    checkpoint: Path | None = None,
    shard: Sequence[str] = SHARDED_FAMILY_MODULES,
    prefetch: int = 1,
) -> dict[str, ModuleLoader]:
    """Loaders for a sharded render of ``preset``: every module of its family (``names``: default all,
    from ``pipeline.family.family_module_names``) built by ``pipeline.family.family_modules`` — the
    same seeded init and ``checkpoint`` (default: the preset's shipped one, as ``get_family``) as the
    single-process render. The models in ``shard`` (the A2V and SR DiTs) are FSDP2-sharded and
    registered with the parker; the small VAE, audio and text encoders are placed whole on every rank
    (their all-gathers would cost more than their weights).
    """
    if names is None:
        from pipeline.family import family_module_names, resolve_preset

        names = family_module_names(resolve_preset(preset))
    return {
        name: functools.partial(
            load_family_module,
            preset=preset,
            name=name,
            checkpoint=str(checkpoint) if checkpoint else "",
            shard=name in shard,
            prefetch=prefetch,
        )
        for name in names
    }


def preset_loaders(
    preset: str,
    names: Sequence[str],
    *,
    seed: int = 0,
    checkpoint: Path | None = None,
    shard: bool = True,
    prefetch: int = 1,
    dtype: str = "",
    build_on_device: bool = False,
) -> dict[str, ModuleLoader]:
    """Loaders for the modules ``names`` of ``preset`` (e.g. ``["a2v", "sr", "vae", "audio"]``).

    Block models (A2V and SR DiTs) are sharded with :func:`parallelize` when ``shard`` (also on one
    rank: the same code path) and registered with ``ctx.parker``; the others are moved to the device.
    ``dtype``: "bfloat16" / "float16" to store weights in (empty keeps float32). ``checkpoint``: a
    safetensors file for ``models.checkpoint.load_checkpoint`` (else seeded random init).
    """
    frozen = tuple(names)
    return {
        name: functools.partial(
            load_preset_module,
            preset=preset,
            name=name,
            names=frozen,
            seed=seed,
            checkpoint=str(checkpoint) if checkpoint else "",
            shard=shard,
            prefetch=prefetch,
            dtype=dtype,
            build_on_device=build_on_device,
        )
        for name in frozen
    }
