"""Stage: a typed execution unit over modules, with declared input and output ports.

A stage declares the values it reads (``inputs``) and writes (``outputs``) as :class:`Port`\\ s — a
name, a type and a scope. ``job``-scoped values are made once per request (the encoded reference,
the text tokens) and live until the render ends; ``chunk``-scoped values live for one step of the
chunk plan and are dropped by the pipeline when the step is done. The :class:`~pipeline.pipeline.Pipeline`
checks the wiring when it is built (every input produced earlier with the same type and a scope that
lives at least as long) and :class:`Values` checks every write at run time, so a stage cannot smuggle
a value of the wrong type or keep a chunk value past its chunk.

Who calls what: the pipeline calls ``setup(values)`` once per request, then ``run(step, values)`` for
every step (``ChunkStep``) or emission the stage is registered for. Stages must not keep references to
chunk-scoped tensors in ``self``; everything that crosses chunks lives in ``RollingState``.

A :class:`BatchedStage` (the A2V of a family whose DiT can pack windows) runs its work in two halves,
``prepare`` per step and ``run_batch`` over several prepared steps, so the pipeline can sample steps
that do not depend on each other (``I_{k-1}`` and ``N_{k+1}``: ``pipeline.schedule.can_share_forward``)
in one forward per sampler step; ``run`` is the batch of one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Generic, TypeVar, cast

from pipeline.errors import PipelineBuildError

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Scope(StrEnum):
    JOB = "job"
    CHUNK = "chunk"


@dataclass(frozen=True)
class Port(Generic[T_co]):
    name: str
    type: type[T_co]
    scope: Scope
    doc: str = ""
    optional: bool = False  # the value may be None (e.g. text tokens when there is no text)


class Values:
    """The typed value store a pipeline run shares between its stages.

    Writes are checked against the declared port (type, and who may write it); chunk-scoped values
    are cleared by :meth:`end_chunk`.
    """

    def __init__(self, ports: dict[str, Port[object]]) -> None:
        self._ports = ports
        self._job: dict[str, object] = {}
        self._chunk: dict[str, object] = {}

    def put(self, port: Port[T], value: T | None) -> None:
        name = port.name
        if self._ports.get(name) is not port:
            raise PipelineBuildError(f"value {name!r} is not a declared port of this pipeline")
        if value is None:
            if not port.optional:
                raise PipelineBuildError(f"port {name!r} is not optional but got None")
        elif not isinstance(value, port.type):
            raise PipelineBuildError(
                f"port {name!r} expects {port.type.__name__}, got {type(value).__name__}"
            )
        (self._job if port.scope is Scope.JOB else self._chunk)[name] = value

    def get(self, port: Port[T]) -> T:
        store = self._job if port.scope is Scope.JOB else self._chunk
        if port.name not in store or store[port.name] is None:
            raise PipelineBuildError(f"value {port.name!r} was read before any stage produced it")
        return cast(T, store[port.name])

    def get_optional(self, port: Port[T]) -> T | None:
        store = self._job if port.scope is Scope.JOB else self._chunk
        return cast("T | None", store.get(port.name))

    def fork(self) -> Values:
        """A store sharing this one's job values (read-only once the stages are set up) with chunk
        values of its own: what a second thread of the same run (the emission lane) writes into."""
        other = Values(self._ports)
        other._job = self._job
        return other

    def end_chunk(self) -> None:
        """Drop every chunk-scoped value (called by the pipeline after each step)."""
        self._chunk.clear()


class Phase(StrEnum):
    STEP = "step"  # runs once per plan step (N or I chunk)
    EMISSION = "emission"  # runs once per emission (a timeline range made final)


class Stage(ABC):
    """Base of every stage. Subclasses set ``name``, ``phase``, ``inputs`` and ``outputs``."""

    name: ClassVar[str]
    phase: ClassVar[Phase]
    inputs: ClassVar[tuple[Port[object], ...]] = ()
    outputs: ClassVar[tuple[Port[object], ...]] = ()

    def setup(self, values: Values) -> None:  # noqa: B027 - optional hook
        """Once per request, before the first chunk: produce the stage's job-scoped outputs."""

    @abstractmethod
    def run(self, values: Values) -> None:
        """Once per step (``Phase.STEP``) or per emission (``Phase.EMISSION``)."""

    def modules(self) -> list[object]:
        """The :class:`~pipeline.module.Module`\\ s this stage runs (for placement and warm-up)."""
        return []


class BatchedStage(Stage):
    """A step stage that can run several independent steps at once (DESIGN §3: ``I_{k-1}`` and
    ``N_{k+1}`` both depend only on ``N_k`` and earlier, so they can share their forwards).

    :meth:`prepare` reads one step's inputs from its values (everything the step needs, so that the
    values of several steps can be gathered before anything runs); :meth:`run_batch` runs the
    prepared steps together and returns each step's outputs, in order, as ``{port: value}``. Each
    step's outputs must be what :meth:`run` gives for it alone (the pipeline's batched and sequential
    renders are compared frame for frame in the tests). :meth:`run` is the batch of one, so there is
    one code path.
    """

    phase = Phase.STEP

    @abstractmethod
    def prepare(self, values: Values) -> Any:
        """One step's inputs, read from ``values`` (the step's chunk values and the job's)."""

    @abstractmethod
    def run_batch(self, prepared: Sequence[Any]) -> list[dict[Port[Any], object]]:
        """The outputs of each prepared step, in order."""

    def run(self, values: Values) -> None:
        (outputs,) = self.run_batch([self.prepare(values)])
        for port, value in outputs.items():
            values.put(port, value)
