"""A family built for one (preset, checkpoint, device): its modules, stages and pipeline, kept warm.

Who calls what: ``render()`` takes this process's warm :class:`FamilyRuntime` from
:data:`WARM_FAMILIES` (built on first use, so a worker pays for model loading once); a NodeEngine
rank builds one over the modules its engine loaded (``FamilyRuntime(..., loaded=ctx.modules,
on_use=parker.activate)``, see ``pipeline.placement.render_job``) and passes it to ``render()``.
One render at a time uses a runtime. Family-neutral: everything model-specific comes from the
:class:`~pipeline.model_family.ModelFamily`.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from torch import nn

from pipeline.errors import ModuleLoadError
from pipeline.model_family import FamilyPreset, ModelFamily
from pipeline.module import Module
from pipeline.pipeline import Pipeline
from pipeline.stage_common import Timings
from pipeline.weights_identity import weights_identity


class FamilyRuntime:
    """The modules, stages and pipeline of one preset of ``family``.

    ``loaded``: models the caller already holds (a NodeEngine rank's ``ctx.modules``, some of them
    FSDP2-sharded), built by ``family.modules`` (through ``family_loaders``) so they carry the same
    weights; nothing is built then. ``on_use(name)`` runs each time a stage takes model ``name``
    (``Module.get``), just before its forward: a rank passes its parker's ``activate`` so the stage's
    model is brought back and the others parked.

    ``weights_id``: the identity of the weights the modules compute with
    (:func:`~pipeline.weights_identity.weights_identity`), part of every resume snapshot's key
    (``render()``); default: computed here from ``checkpoint``, once, right before the modules load.
    A rank passes the one its loaders computed when they loaded ``loaded``.
    """

    def __init__(
        self,
        family: ModelFamily,
        preset: FamilyPreset,
        checkpoint: Path | None,
        *,
        device: str = "cpu",
        loaded: Mapping[str, nn.Module] | None = None,
        on_use: Callable[[str], None] | None = None,
        weights_id: str | None = None,
    ) -> None:
        self.family = family
        self.preset = preset
        self.checkpoint = checkpoint
        self.weights_id = weights_identity(checkpoint) if weights_id is None else weights_id
        self.modules = family.modules(preset, checkpoint, device=device)
        if loaded is None:
            if on_use is not None:
                for name, module in self.modules.items():
                    module.on_use = functools.partial(on_use, name)
        else:
            names = list(self.modules)
            missing = [n for n in names if n not in loaded]
            if missing:
                raise ModuleLoadError(
                    f"family {family.name!r}, preset {preset.name!r}: loaded modules lack {missing} (have "
                    f"{sorted(loaded)}); load every module of the family ({names}), e.g. "
                    f"family_loaders({preset.name!r}, family={family.name!r})")
            self.modules = {
                n: Module.from_loaded(n, loaded[n], checkpoint=checkpoint,
                                      on_use=functools.partial(on_use, n) if on_use is not None else None)
                for n in names
            }
        # emissions overlap the next step on a second core (Pipeline.run); not over a rank's loaded
        # modules: sharded forwards issue collectives that every rank must run in the same order, and
        # on_use parks models as each stage takes its turn
        self.overlap_emissions = family.overlap_emissions and loaded is None and on_use is None
        # I_{k-1} and N_{k+1} share their A2V forwards when the family's A2V is a BatchedStage
        # (Pipeline.run(batch_steps=)); the same frames either way. False: one forward per step, the
        # sequential loop (bench.stream --no-batch-steps measures the two side by side)
        self.batch_steps = True
        self.timings = Timings()
        self.pipeline = Pipeline(family.stages(preset, self.modules, self.timings), timings=self.timings)

    @property
    def is_random_init(self) -> bool:
        return self.checkpoint is None

    def model_key(self) -> dict[str, str]:
        """The model's part of a resume snapshot's key (``render()``, ``pipeline.state``): the family,
        the preset's name and a digest of its definition (shapes, sampler settings: a deploy may change
        them under the same name; presets are frozen dataclasses, so their repr is stable) and
        :attr:`weights_id`."""
        return {
            "family": self.family.name,
            "preset": self.preset.name,
            "preset_config": hashlib.sha256(repr(self.preset).encode()).hexdigest()[:16],
            "weights": self.weights_id,
        }


class WarmFamilies:
    """This process's warm runtimes by (family, preset, checkpoint, device); thread-safe."""

    def __init__(self) -> None:
        self._runtimes: dict[tuple[str, str, str, str], FamilyRuntime] = {}
        self._lock = threading.Lock()

    def get(self, family: ModelFamily, preset: str, checkpoint: Path | None = None, *,
            device: str = "cpu") -> FamilyRuntime:
        """The warm runtime of ``family`` for ``preset`` (``checkpoint`` None: the family's default),
        built on first use."""
        resolved = family.preset(preset)
        ckpt = checkpoint if checkpoint is not None else family.default_checkpoint(resolved)
        key = (family.name, preset, str(ckpt), device)
        with self._lock:
            runtime = self._runtimes.get(key)
            if runtime is None:
                runtime = FamilyRuntime(family, resolved, ckpt, device=device)
                self._runtimes[key] = runtime
            return runtime

    def loaded_modules(self) -> dict[str, float]:
        """``"family/preset/checkpoint/device/module" -> load_s`` of every model loaded so far."""
        with self._lock:
            runtimes = list(self._runtimes.items())
        return {f"{'/'.join(key)}/{name}": module.load_s
                for key, runtime in runtimes for name, module in runtime.modules.items() if module.is_loaded}


WARM_FAMILIES = WarmFamilies()
"""The process's warm families: a worker's rank lives across jobs, so its models load once."""
