"""FSDP2 sharding of a block-structured model, applied from outside the model.

Who calls this: a rank's module loader (see :class:`pipeline.placement.engine.NodeEngine`) right
after it builds a model and before the first forward, once per rank and per model. The model stays a
plain ``nn.Module`` with a ``blocks: nn.ModuleList``; sharding is a property of placement, not of the
model (torchtitan's ``parallelize`` pattern).

What it does: ``fully_shard`` on every block, then on the root (which groups whatever is left: patch
embedding, time/audio embeddings, final norm and head), on a 1-D device mesh, and chains explicit
forward prefetch so block ``n``'s pre-forward issues the AllGather of blocks ``n+1 .. n+prefetch``
right after its own AllGather. Without the explicit chain, FSDP2 issues block ``n+1``'s AllGather
only when block ``n+1``'s forward begins (implicit prefetch overlaps on CUDA streams only).

Correctness: the AllGather reassembles the exact parameter values (a shard is a byte range of the
padded flattened parameter), so the forward math is identical to the unsharded module's on the same
device and thread count. The tests check bit-identity on CPU/gloo.

Inference only: gradients, optimizer state and mixed precision for training are not configured.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

logger = logging.getLogger(__name__)


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The ordered transformer blocks of ``model`` (its ``blocks`` ModuleList).

    Raises a ``TypeError`` that names the model class when there is none: placement streams and
    shards per block, so a model must expose them.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise TypeError(
            f"{type(model).__name__} has no non-empty `blocks: nn.ModuleList` (got {type(blocks).__name__}); "
            "placement shards and streams a model block by block: expose its transformer blocks as "
            "`self.blocks = nn.ModuleList([...])` in forward order"
        )
    return list(blocks)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    prefetch: int = 1,
    param_dtype: torch.dtype | None = None,
    offload_policy: OffloadPolicy | None = None,
    forward_methods: Sequence[str] = (),
) -> FSDPModule:
    """Shard ``model`` in place with FSDP2 per block, then the root, and chain forward prefetch.

    Args:
        model: a module with ``blocks: nn.ModuleList`` (forward order). Its parameters may be on CPU
            or already on the mesh's device; FSDP moves them to the mesh device.
        mesh: a 1-D mesh over the node's ranks (``init_device_mesh(device_type, (world_size,))``).
        reshard_after_forward: free each block's gathered parameters after its forward (memory per
            rank ~ 1/world_size of the model plus ``prefetch + 1`` gathered blocks). ``False`` keeps
            them gathered after the first forward: faster for many sampling steps, full model memory.
        prefetch: how many following blocks each block's pre-forward all-gathers ahead (0 disables
            the explicit chain). 1 overlaps the next AllGather with the current block's compute; 2 or
            more is more aggressive and holds more gathered blocks at once.
        param_dtype: compute dtype to all-gather parameters in (e.g. ``torch.bfloat16``); ``None``
            keeps the stored dtype.
        offload_policy: e.g. ``CPUOffloadPolicy(pin_memory=True)`` for small encoders that should
            live on the host and be copied in per forward; ``None`` keeps shards on the device.
        forward_methods: other methods of the root that use its parameters and are called on their
            own (``A2VDiT.embed_context``, ``SRDiT.embed_reference``): they all-gather like forward.

    Returns:
        the same ``model`` object, now also an ``FSDPModule``.
    """
    if mesh.ndim != 1:
        raise ValueError(f"parallelize needs a 1-D mesh over the node's ranks, got mesh.ndim={mesh.ndim}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 (blocks to all-gather ahead), got {prefetch}")
    blocks = model_blocks(model)
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype is not None else MixedPrecisionPolicy()
    )
    offload = offload_policy if offload_policy is not None else OffloadPolicy()
    for block in blocks:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload,
        )
    # The root's own group (embeddings, head) is needed at the start and the end of every forward:
    # keep it gathered unless the caller asked for strict resharding.
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload,
    )
    for method in forward_methods:
        register_fsdp_forward_method(model, method)
    fsdp_blocks = cast(list[FSDPModule], blocks)
    set_forward_prefetch(fsdp_blocks, prefetch)
    logger.debug(
        "sharded %s: %d blocks over %d ranks, prefetch=%d, reshard_after_forward=%s",
        type(model).__name__,
        len(blocks),
        mesh.size(),
        prefetch,
        reshard_after_forward,
    )
    return cast(FSDPModule, model)


def set_forward_prefetch(blocks: Sequence[FSDPModule], prefetch: int) -> None:
    """Make block ``i``'s pre-forward all-gather blocks ``i+1 .. i+prefetch`` (0 clears the chain)."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(list(blocks[i + 1 : i + 1 + prefetch]))


def reset_after_failure(model: nn.Module) -> None:
    """Bring a model sharded by :func:`parallelize` back to a clean, resharded state after a failure.

    Who calls this: the rank loop after a job raised, so the next job starts from sharded parameters
    and an idle FSDP iteration state (FSDP2 leaves it undefined when forward raises). ``model`` must be
    the root that :func:`parallelize` returned; a model that is not sharded is left alone.
    """
    if not isinstance(model, FSDPModule):
        return
    # FSDP2 sets up its iteration state at the first forward; a model never run has nothing to reset
    # (and reset_iter_state would fail on the uninitialized communication context).
    if model._get_fsdp_state()._is_root is None:
        return
    model.reset_iter_state()
    reshard_all(model)


def reshard_all(model: nn.Module) -> None:
    """Free every gathered parameter of ``model`` (registered parameters become the local shards).

    Needed before parking a model sharded with ``reshard_after_forward=False``: the parker moves the
    local shards, so the gathered copies must be gone first.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
