"""The family interface: what the framework needs of a model family, and the registry of families.

A **model family** is one folder, ``pipeline/families/<name>/``: its stages and ports, its presets,
how its modules are built and loaded (one weight builder), its parallelize plan and a few flags. It
implements :class:`ModelFamily` and is registered by name with one line in
``pipeline/families/__init__.py`` (``FAMILIES.register(TinyFamily())``); ``render()`` and the job
spec name it (``RenderRequest.family``, ``JobSpec.family``, default ``"tiny"``).

Who calls what: ``render()`` resolves ``request.family`` through a :class:`FamilyRegistry`, and
:class:`~pipeline.family_runtime.FamilyRuntime` calls :meth:`ModelFamily.preset`,
:meth:`~ModelFamily.modules` and :meth:`~ModelFamily.stages` once per (preset, checkpoint, device)
to build the warm modules and the pipeline over them. A NodeEngine rank's loaders
(``pipeline.placement.loaders.family_loaders``) call :meth:`~ModelFamily.modules` for the same
weights and place them as :attr:`ModelFamily.parallel` says.

This module imports no torch at import time: the HTTP API and the Celery parent validate job specs
against the registered names without loading any model code, so a family's ``__init__`` must stay
light too (import its models inside :meth:`~ModelFamily.modules` / :meth:`~ModelFamily.stages`).
The framework core (``pipeline/`` outside ``families/`` and ``render.py``) imports no family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeAlias

from pipeline.errors import InvalidInputError
from pipeline.schedule import FrameGrid

if TYPE_CHECKING:
    from pipeline.module import Module
    from pipeline.stage import Stage
    from pipeline.stage_common import Timings


class FamilyPreset(Protocol):
    """What the framework reads of a family's preset (its own preset type has more: model configs).

    ``render()`` plans the chunks and encodes with these; ``reference_frame`` turns on the
    reference slot of every N window (``pipeline.schedule.ChunkPlan``)."""

    @property
    def name(self) -> str: ...
    @property
    def height(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def fps(self) -> int: ...
    @property
    def sample_rate(self) -> int: ...
    @property
    def chunk_frames(self) -> int: ...
    @property
    def context_frames(self) -> int: ...
    @property
    def interp_frames(self) -> int: ...
    @property
    def reference_frame(self) -> bool: ...


@dataclass(frozen=True)
class ParallelPlan:
    """How a NodeEngine rank places a family's modules (torchtitan's per-model ``parallelize``).

    ``sharded``: the large block models, FSDP2-sharded per block and registered with the rank's
    parker (parked in pinned host memory between their stages when parking is on); every other module
    is placed whole on each rank (its all-gathers would cost more than its weights).
    ``forward_methods``: per sharded module, the root methods the stages call on their own (outside
    ``forward``) that read root parameters, so they are wrapped to all-gather first.
    """

    sharded: tuple[str, ...] = ()
    forward_methods: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


class ModelFamily(ABC):
    """One model family. Stateless: one instance per family, registered in a :class:`FamilyRegistry`.

    Flags: ``has_sr`` says the family has a super-resolution stage (reports, docs);
    ``overlap_emissions`` lets the pipeline run a render's emission stages on a second lane next to
    the next step (never over a rank's engine-loaded modules, see ``FamilyRuntime``).
    """

    name: ClassVar[str]
    default_preset: ClassVar[str]
    has_sr: ClassVar[bool] = False
    overlap_emissions: ClassVar[bool] = True
    parallel: ClassVar[ParallelPlan] = ParallelPlan()

    @abstractmethod
    def preset(self, name: str) -> FamilyPreset:
        """The preset called ``name``; raise ``InvalidInputError(field="preset")`` naming the known ones."""

    def default_checkpoint(self, preset: FamilyPreset) -> Path | None:
        """The weights used when the request names none (None: seeded random init)."""
        return None

    def frame_grid(self, preset: FamilyPreset) -> FrameGrid:
        """How the preset's latent timeline maps to video frames (``pipeline.schedule.FrameGrid``);
        default one to one. ``render()`` plans the chunks with it."""
        return FrameGrid()

    def audio_lookahead_frames(self, preset: FamilyPreset) -> int:
        """Video frames of audio past a step window's last video frame that the family's step stages
        read (an audio encoder's right context, a feature window). A live render
        (``pipeline.schedule.LiveChunkPlan``) waits for that much audio before running the step, and
        ``LiveAudioSource`` refuses reads past it, so a family that reads further must say so here.
        Default: none."""
        return 0

    def output_size(self, preset: FamilyPreset, source_hw: tuple[int, int]) -> tuple[int, int]:
        """``(height, width)`` of the video for a reference image of ``source_hw`` pixels; default the
        preset's fixed size. ``render()`` crops and resizes the reference to it and encodes at it."""
        return preset.height, preset.width

    def options(self, preset: FamilyPreset, options: Mapping[str, str | int | float]) -> dict[str, str | int | float]:
        """The request's family options (``RenderRequest.options``) checked and completed with the
        preset's defaults; the stages read the result from ``pipeline.ports.OPTIONS``. Default: the
        family takes none. Raise ``InvalidInputError(field="options.<key>")`` naming the key, value and
        bounds: :func:`check_option` checks a numeric one."""
        if options:
            raise InvalidInputError(
                f"options={dict(options)!r}: family {self.name!r} takes no options; remove them", field="options")
        return {}

    @abstractmethod
    def modules(self, preset: FamilyPreset, checkpoint: Path | None, *, device: str = "cpu",
                seed: int = 0) -> dict[str, Module]:
        """The family's one weight builder: one *unloaded* :class:`~pipeline.module.Module` per model
        of ``preset`` (seeded random init from ``seed``, then ``checkpoint`` when given). Nothing is
        built until ``Module.get()``; the in-process render and every rank's loaders build through
        here, so they compute with the same parameters."""

    @abstractmethod
    def stages(self, preset: FamilyPreset, modules: Mapping[str, Module], timings: Timings) -> list[Stage]:
        """The stages over ``modules`` (what :meth:`modules` returned, or a rank's loaded ones), in
        order. Step stages must produce ``pipeline.ports.STEP_LATENTS``, the last emission stage
        ``pipeline.ports.FRAMES``; ``timings`` is the render's accounting (``Timings.model``)."""


OptionBounds: TypeAlias = Mapping[str, tuple[type, float, float]]
"""A family's numeric options (:meth:`ModelFamily.options`): key -> (``int`` or ``float``, lowest,
highest), both ends allowed."""


def check_option(family: str, preset: FamilyPreset, key: str, value: object,
                 defaults: Mapping[str, str | int | float], bounds: OptionBounds) -> int | float:
    """One numeric request option for :meth:`ModelFamily.options`, checked against ``bounds[key]``:
    an int or float (not a bool; an int option also takes an integral float, 5.0) within [lo, hi],
    returned as the option's type. ``defaults``: the preset's value of every key the family takes
    (the messages quote them). Raises ``InvalidInputError(field="options.<key>")`` naming the key, the
    value, the bounds and the preset's default — or, for a key not in ``bounds``, the keys ``family``
    takes. Every family with numeric options checks them here (wan, tiny)."""
    if key not in bounds:
        raise InvalidInputError(f"options.{key}: the {family} family takes {sorted(defaults)}", field=f"options.{key}")
    kind, lo, hi = bounds[key]
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not (kind is float or isinstance(value, int) or value.is_integer()) or not lo <= value <= hi):
        raise InvalidInputError(f"options.{key}={value!r}: must be {kind.__name__} in [{lo:g}, {hi:g}] "
                                f"(preset {preset.name!r} default {defaults[key]!r})", field=f"options.{key}")
    return int(value) if kind is int else float(value)


class FamilyRegistry:
    """Families by name. ``pipeline.families.FAMILIES`` is the process's; tests register their own
    families there (and :meth:`unregister` them) without editing any framework file."""

    def __init__(self) -> None:
        self._by_name: dict[str, ModelFamily] = {}

    def register(self, family: ModelFamily) -> ModelFamily:
        """Add ``family`` under ``family.name``; a second, different family of that name is an error."""
        have = self._by_name.get(family.name)
        if have is not None and have is not family:
            raise ValueError(f"family {family.name!r} is already registered ({type(have).__name__}); "
                             "pick another name or unregister the first")
        self._by_name[family.name] = family
        return family

    def unregister(self, name: str) -> None:
        self._by_name.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._by_name))

    def get(self, name: str) -> ModelFamily:
        """The family called ``name``; ``InvalidInputError(field="family")`` naming the registered ones."""
        family = self._by_name.get(name)
        if family is None:
            raise InvalidInputError(
                f"family={name!r} is not registered; registered families: {list(self.names())}. "
                "Name one of them, or register yours in pipeline/families/__init__.py", field="family")
        return family
