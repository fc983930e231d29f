"""A render entry point (``pipeline.render:render`` or one with its signature) as a NodeEngine job.

Who calls this: :meth:`NodeEngine.run` runs :func:`render_entry_job` on every rank (the worker wraps it
to add its logging, see ``worker.runner.render_attempt``). Each rank imports the entry (its module
also provides ``RenderRequest``), builds the request from the payload and calls the entry with one
:class:`~pipeline.placement.relay.RelaySink` (rank 0 publishes, the other ranks discard), the
engine's cancel flag as ``should_cancel`` and progress published as :class:`ProgressEvent`.

Because a rank process lives across jobs, whatever the entry caches per process stays warm: with
``pipeline.render`` that is the model family (``pipeline.family_runtime.WARM_FAMILIES``), built by the first
job and reused by every later one. :func:`warm_report` says, per job, how many modules were loaded
during it (0 once warm), which the worker logs and the tests assert.

Sharded renders: with ``shard`` true in the payload (default: ``world_size > 1``) every rank renders
with the models the engine loaded once per rank (``EngineConfig(loaders=family_loaders(family, preset))``:
the family's plan, e.g. A2V and SR FSDP2-sharded, the encoders whole) instead of its own unsharded
family: the job wraps ``ctx.modules`` in a ``FamilyRuntime(loaded=..., on_use=parker.activate)`` and
passes it to the entry
as ``family=``. Every rank runs the same steps with the same seeds (SPMD; the FSDP all-gathers pair
up because every rank runs the same forwards in the same order), rank 0 publishes. ``shard=False``
on several ranks makes each rank render alone with its own full models (only rank 0's output is
kept), which wastes the other ranks.

Payload (plain, picklable): ``entry`` ("package.module:function"), ``request`` (the
``RenderRequest`` fields; ``image``/``audio``/``checkpoint`` as path strings), ``resume_state``
(bytes or None), ``mode`` (default "streaming"), ``shard`` (bool, optional). Nothing from one job is
kept for the next except what the entry itself caches.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import InvalidInputError, ModuleLoadError, OutOfMemoryError
from pipeline.placement.rank import RankContext, resolve
from pipeline.placement.relay import RelaySink

if TYPE_CHECKING:  # imported when a sharded job runs: the parent only needs ProgressEvent from here
    from pipeline.family_runtime import FamilyRuntime, WarmFamilies

_PATH_FIELDS = ("image", "audio", "checkpoint")
_jobs_served = 0  # render jobs this rank process has run (its warmth, for reports)


@dataclass(frozen=True)
class ProgressEvent:
    """One chunk's progress (the entry's ``RenderProgress`` as a dict), published by rank 0."""

    fields: dict[str, object]


def _as_dict(obj: object) -> dict[str, object]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return dict(vars(obj))


def loaded_modules() -> dict[str, float]:
    """``"family/preset/checkpoint/device/module" -> load_s`` of every model this process's warm
    families (``pipeline.family_runtime.WARM_FAMILIES``) loaded; empty when the entry does not use
    them (e.g. a test stand-in: the module is then never imported, so neither is torch's model code)."""
    runtime_mod = sys.modules.get("pipeline.family_runtime")
    if runtime_mod is None:
        return {}
    warm: WarmFamilies = runtime_mod.WARM_FAMILIES
    return warm.loaded_modules()


def warm_report(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, object]:
    """What this job cost in model loading: loads done during it and their seconds."""
    new = {k: v for k, v in after.items() if k not in before}
    return {
        "pid": os.getpid(),
        "jobs_on_rank": _jobs_served,
        "modules_loaded": len(after),
        "loads_this_job": len(new),
        "load_s_this_job": round(sum(new.values()), 4),
    }


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

    def activate(name: str) -> None:  # Module.get() right before a stage's forward
        if name in parked:
            ctx.parker.activate(name)

    return FamilyRuntime(model_family, family_preset, ckpt, device=str(ctx.device), loaded=ctx.modules,
                         on_use=activate)


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


def _accepts_family(render: Callable[..., object]) -> bool:
    try:
        return "family" in inspect.signature(render).parameters
    except (TypeError, ValueError):  # a builtin without a signature: cannot take one
        return False


def render_entry_job(ctx: RankContext, payload: Mapping[str, object]) -> dict[str, object]:
    """Run the configured render entry on this rank; rank 0 returns ``{"result", "warm"}``."""
    global _jobs_served
    entry = str(payload["entry"])
    render = resolve(entry)
    module = importlib.import_module(entry.partition(":")[0])
    request_cls = getattr(module, "RenderRequest", None)
    if request_cls is None:
        raise InvalidInputError(
            f"render entry {entry!r}: its module has no RenderRequest class; point render_entry at a "
            "module that defines render() and RenderRequest (like pipeline.render)",
            field="render_entry",
        )
    raw = payload["request"]
    if not isinstance(raw, Mapping):
        raise TypeError(f"payload['request'] must be a mapping of RenderRequest fields, got {type(raw).__name__}")
    fields = {k: (Path(str(v)) if k in _PATH_FIELDS and v is not None else v) for k, v in raw.items()}
    request = request_cls(**fields)

    def on_progress(progress: object) -> None:
        if ctx.is_publisher:
            ctx.publish(ProgressEvent(_as_dict(progress)))

    extra: dict[str, object] = {}
    if ctx.device.type != "cpu":  # GPU-only: the CPU default keeps stand-ins without `device` working
        extra["device"] = str(ctx.device)
    shard = bool(payload.get("shard", ctx.world_size > 1))
    if shard:
        if not _accepts_family(render):
            raise InvalidInputError(
                f"render entry {entry!r} takes no `family` argument, so it cannot render with the engine's "
                "sharded modules; use pipeline.render:render or send shard=False", field="render_entry")
        checkpoint = getattr(request, "checkpoint", None)
        extra["family"] = rank_family(ctx, str(getattr(request, "family", "tiny")),
                                      str(getattr(request, "preset", "")),
                                      Path(checkpoint) if checkpoint is not None else None)
    should_cancel = agreed_cancel(ctx) if shard and ctx.world_size > 1 else ctx.cancel_requested
    before = loaded_modules()
    try:
        result = render(
            request,
            [RelaySink(ctx)],
            mode=str(payload.get("mode", "streaming")),
            resume_state=payload.get("resume_state"),
            should_cancel=should_cancel,
            on_progress=on_progress,
            **extra,
        )
    except MemoryError as exc:  # host RAM: retryable (a retry resumes after the last commit)
        raise OutOfMemoryError(
            f"rank {ctx.rank} ran out of host memory during the render: {exc!r}; the job resumes from its "
            "last committed chunk on retry (lower the preset's chunk size if it repeats)"
        ) from exc
    _jobs_served += 1
    warm = warm_report(before, loaded_modules())
    warm["sharded"] = shard
    if shard:  # loaded once at rank start by the engine's loaders, never during a job
        warm["modules_loaded"] = len(ctx.modules)
    return {"result": _as_dict(result), "warm": warm}
