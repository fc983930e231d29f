"""A render as a NodeEngine job: the typed request that crosses to the ranks and what comes back.

Who calls this: the worker (``worker.runner``) and the tests run :func:`render_on_rank` on every rank
with a :class:`RankRenderRequest` (``NodeEngine.run(render_on_rank, request)``; the worker wraps it
to add its logging). Each rank calls the request's renderer (``pipeline.render.render`` or a
stand-in with its signature, :class:`~pipeline.request.Renderer`) with one
:class:`~pipeline.placement.relay.RelaySink` (rank 0 publishes, the other ranks discard), the
engine's cancel flag as ``should_cancel``, and progress published as the renderer's own
:class:`~pipeline.request.RenderProgress`. What rank 0 publishes is a :data:`RenderEvent`; what it
returns a :class:`RankRenderResult`. The parent replays the events with
:class:`~pipeline.placement.relay.SinkRelay`.

Because a rank process lives across jobs, whatever the renderer caches per process stays warm: with
``pipeline.render`` that is the model family (``pipeline.family_runtime.WARM_FAMILIES``), built by
the first job and reused by every later one. :class:`WarmReport` says, per job, how many modules were
loaded during it (0 once warm), which the worker logs and the tests assert.

Sharded renders: with ``shard`` (default: ``world_size > 1``) every rank renders with the models the
engine loaded once per rank (``EngineConfig(loaders=family_loaders(family, preset))``: the family's
plan, e.g. A2V and SR FSDP2-sharded, the encoders whole) instead of its own unsharded family: the job
wraps ``ctx.modules`` in a ``FamilyRuntime(loaded=..., on_use=parker.activate)`` and passes it to the
renderer as ``family=``. Every rank runs the same steps with the same seeds (SPMD; the FSDP
all-gathers pair up because every rank runs the same forwards in the same order), rank 0 publishes.
``shard=False`` on several ranks makes each rank render alone with its own full models (only rank 0's
output is kept), which wastes the other ranks. Nothing from one job is kept for the next except what
the renderer itself caches.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import ModuleLoadError, OutOfMemoryError
from pipeline.media_types import Fragment, InitSegment
from pipeline.placement.relay import RelaySink, SinkClosed
from pipeline.request import Renderer, RenderMode, RenderProgress, RenderRequest, RenderResult

if TYPE_CHECKING:  # torch-free at import: the worker's Celery parent imports this module
    from pipeline.family_runtime import FamilyRuntime, WarmFamilies
    from pipeline.placement.rank import RankContext

RenderEvent = InitSegment | Fragment | SinkClosed | RenderProgress
"""What rank 0 of a render job publishes, in order: the init segment, then fragments and progress,
then the sinks' close."""

_jobs_served = 0  # render jobs this rank process has run (its warmth, for reports)


@dataclass(frozen=True)
class RankRenderRequest:
    """One render for the ranks (picklable: ``render`` must be a module-level function)."""

    render: Renderer
    request: RenderRequest
    resume_state: bytes | None = None
    mode: RenderMode = "streaming"
    shard: bool | None = None
    """Render with the engine's sharded modules; None: when the engine has more than one rank."""


@dataclass(frozen=True)
class WarmReport:
    """What a render job cost this rank in model loading (``loads_this_job`` is 0 once warm)."""

    pid: int
    jobs_on_rank: int
    modules_loaded: int
    loads_this_job: int
    load_s_this_job: float
    sharded: bool


@dataclass(frozen=True)
class RankRenderResult:
    """Rank 0's return value of :func:`render_on_rank`."""

    result: RenderResult
    warm: WarmReport


def loaded_modules() -> dict[str, float]:
    """``"family/preset/checkpoint/device/module" -> load_s`` of every model this process's warm
    families (``pipeline.family_runtime.WARM_FAMILIES``) loaded; empty when the renderer does not use
    them (e.g. a test stand-in: the module is then never imported, so neither is torch's model code)."""
    runtime_mod = sys.modules.get("pipeline.family_runtime")
    if runtime_mod is None:
        return {}
    warm: WarmFamilies = runtime_mod.WARM_FAMILIES
    return warm.loaded_modules()


def rank_family(ctx: RankContext, family: str, preset: str, checkpoint: Path | None) -> FamilyRuntime:
    """The family runtime over this rank's engine-loaded modules (see the module docstring).

    The family object comes with the modules (``FAMILY_SOURCES``, written by ``family_loaders``), so
    this file names no family. Raises :class:`ModuleLoadError` when the engine was not configured with
    ``family_loaders`` for this family, preset and checkpoint (the weights would differ from the
    single-process render's).
    """
    from pipeline.family_runtime import FamilyRuntime
    from pipeline.placement.loaders import FAMILY_SOURCES

    held = {src.family.name: src.family for src in FAMILY_SOURCES.values()}
    model_family = held.get(family)
    if model_family is None:
        raise ModuleLoadError(
            f"sharded render of family {family!r} on rank {ctx.rank}: the engine's modules are of "
            f"{sorted(held) or 'no family'} (none loaded by family_loaders). Start the NodeEngine with "
            f"EngineConfig(loaders=family_loaders(FAMILIES.get({family!r}), {preset!r}, checkpoint=...)) "
            "for the family the jobs ask for, or send shard=False")
    family_preset = model_family.preset(preset)
    names = list(model_family.modules(family_preset, None))
    ckpt = checkpoint if checkpoint is not None else model_family.default_checkpoint(family_preset)
    sources = {n: FAMILY_SOURCES.get(n) for n in names}
    wrong = {
        n: (None if src is None else (src.preset, str(src.checkpoint)))
        for n, src in sources.items()
        if n not in ctx.modules or src is None or src.family.name != family or src.preset != preset
        or src.checkpoint != ckpt
    }
    if wrong:
        raise ModuleLoadError(
            f"sharded render of preset {preset!r} (checkpoint {ckpt}) on rank {ctx.rank}: the engine's "
            f"modules do not match: {wrong} (module -> (preset, checkpoint) loaded, None: not loaded by "
            f"family_loaders). Start the NodeEngine with EngineConfig(loaders=family_loaders("
            f"FAMILIES.get({family!r}), {preset!r}, checkpoint=...)) for the preset and checkpoint the "
            "jobs ask for, or send shard=False"
        )
    parked = {n for n, src in sources.items() if src is not None and src.parked}
    # one checkpoint, so one identity; should a file have changed between two modules' loads, the
    # key names both (a snapshot of either model then does not resume here)
    weights_id = "+".join(sorted({src.weights_id for src in sources.values() if src is not None}))

    def activate(name: str) -> None:  # Module.get() right before a stage's forward
        if name in parked:
            ctx.parker.activate(name)

    return FamilyRuntime(model_family, family_preset, ckpt, device=str(ctx.device), loaded=ctx.modules,
                         on_use=activate, weights_id=weights_id)


def agreed_cancel(ctx: RankContext) -> Callable[[], bool]:
    """``should_cancel`` for a sharded render: true on every rank at the same step, or on none.

    The engine's cancel flag is one event seen by all ranks, but each rank polls it on its own
    clock: one rank could stop before step k while another enters step k's forward and blocks in an
    all-gather until the group is torn down. The pipeline polls once per step on every rank in the
    same order, so a MAX all-reduce of the local flags there makes them decide together (one tiny
    collective per step).
    """
    import torch
    import torch.distributed as dist

    def should_cancel() -> bool:
        flag = torch.tensor([1 if ctx.cancel_requested() else 0], dtype=torch.int32, device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.group)
        return bool(flag.item())

    return should_cancel


def _warm(before: Mapping[str, float], after: Mapping[str, float], *, sharded: bool, ctx: RankContext) -> WarmReport:
    new = {k: v for k, v in after.items() if k not in before}
    return WarmReport(
        pid=os.getpid(),
        jobs_on_rank=_jobs_served,
        # sharded: loaded once at rank start by the engine's loaders, never during a job
        modules_loaded=len(ctx.modules) if sharded else len(after),
        loads_this_job=len(new),
        load_s_this_job=round(sum(new.values()), 4),
        sharded=sharded,
    )


def render_on_rank(ctx: RankContext, job: RankRenderRequest) -> RankRenderResult:
    """Run ``job.render`` on this rank (see the module docstring)."""
    global _jobs_served
    request = job.request

    def on_progress(progress: RenderProgress) -> None:
        if ctx.is_publisher:
            ctx.publish(progress)

    shard = job.shard if job.shard is not None else ctx.world_size > 1
    family = rank_family(ctx, request.family, request.preset, request.checkpoint) if shard else None
    should_cancel = agreed_cancel(ctx) if shard and ctx.world_size > 1 else ctx.cancel_requested
    before = loaded_modules()
    try:
        result = job.render(
            request,
            [RelaySink(ctx)],
            mode=job.mode,
            resume_state=job.resume_state,
            should_cancel=should_cancel,
            on_progress=on_progress,
            device=str(ctx.device),
            family=family,
        )
    except MemoryError as exc:  # host RAM: retryable (a retry resumes after the last commit)
        raise OutOfMemoryError(
            f"rank {ctx.rank} ran out of host memory during the render: {exc!r}; the job resumes from its "
            "last committed chunk on retry (lower the preset's chunk size if it repeats)"
        ) from exc
    _jobs_served += 1
    return RankRenderResult(result, _warm(before, loaded_modules(), sharded=shard, ctx=ctx))
