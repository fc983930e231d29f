"""Module loaders for the reference model family: build (or load) a preset's modules on a rank, place
them (FSDP2 sharding for block models, plain device placement for the small encoders) and register
the block models with the rank's parker.

Who calls this: whoever builds the :class:`~pipeline.placement.engine.EngineConfig` (the worker, the
benchmarks, the tests): ``EngineConfig(loaders=preset_loaders("tiny", ["a2v", "sr", "vae", "audio"]))``.
Each rank then calls every loader once at start; the modules stay warm in ``ctx.modules``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from pipeline.placement.fsdp import parallelize
from pipeline.placement.rank import ModuleLoader, RankContext

logger = logging.getLogger(__name__)

# Modules built for this rank and not yet taken by their loader: build_modules makes every module of a
# preset at once (each from its own seed), so the first loader builds them and the others take theirs.
# An entry is dropped as soon as its last requested module is taken; nothing is kept after loading.
# Root methods the pipeline calls on their own (once per chunk) that read root parameters.
FORWARD_METHODS: dict[str, tuple[str, ...]] = {"a2v": ("embed_context",), "sr": ("embed_reference",)}

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
    blocks = getattr(module, "blocks", None)
    methods = FORWARD_METHODS.get(name, ())
    if shard and isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
        parallelize(module, ctx.mesh, prefetch=prefetch, forward_methods=methods)
        ctx.parker.register(name, module, gathers_ahead=prefetch, methods=methods)
    else:
        module = module.to(ctx.device)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            ctx.parker.register(name, module, methods=methods)
    return module


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
