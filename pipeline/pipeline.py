"""Pipeline: the stage graph, its wiring check, and the chunk loop in streaming or batch mode.

``step()`` reads as schedule → execute → update: the plan (``pipeline.schedule``) says which step
comes next; the step stages (context, A2V) run on it; the rolling state is updated; if the step made
a timeline range final, the emission stages (SR, decode) run on it and the frames are published.

Streaming and batch modes run the same stages on the same steps. Batch mode is the conventional
design we measure against: it keeps every emission's latents until the plan is done, then runs SR and
decode over the whole sequence, then encodes — and must give the same frames.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from pipeline import ports as P
from pipeline.errors import CancelledError, PipelineBuildError
from pipeline.publish import Publisher
from pipeline.schedule import ChunkKind, ChunkPlan, ChunkStep, Emission
from pipeline.stage import Phase, Port, Scope, Stage, Values
from pipeline.stages.common import Timings
from pipeline.state import RollingState

log = logging.getLogger(__name__)

Mode = Literal["streaming", "batch"]


@dataclass(frozen=True)
class ChunkEvent:
    """Reported after each published emission (streaming) or at the end (batch)."""

    emission_index: int
    num_emissions: int
    frames_done: int
    num_frames: int
    elapsed_s: float


class Pipeline:
    """A validated stage graph. Build once per preset; :meth:`run` once per request."""

    def __init__(self, stages: Sequence[Stage], *, provided: Sequence[Port[object]] = P.PIPELINE_INPUTS,
                 timings: Timings | None = None) -> None:
        self.stages = list(stages)
        self.timings = timings or Timings()
        self.ports = self._validate(provided)
        self.step_stages = [s for s in self.stages if s.phase is Phase.STEP]
        self.emission_stages = [s for s in self.stages if s.phase is Phase.EMISSION]

    def _validate(self, provided: Sequence[Port[object]]) -> dict[str, Port[object]]:
        ports: dict[str, Port[object]] = {p.name: p for p in provided}
        # Emission stages run after every step stage, so check them in that order.
        ordered = sorted(self.stages, key=lambda s: 0 if s.phase is Phase.STEP else 1)
        for stage in ordered:
            for port in stage.inputs:
                have = ports.get(port.name)
                if have is None:
                    raise PipelineBuildError(
                        f"stage {stage.name!r} reads {port.name!r} but no earlier stage produces it")
                if have is not port and (have.type is not port.type or have.scope is not port.scope):
                    raise PipelineBuildError(
                        f"stage {stage.name!r} reads {port.name!r} as {port.type.__name__}/{port.scope.value}"
                        f" but it is produced as {have.type.__name__}/{have.scope.value}")
            for port in stage.outputs:
                if port.name in ports and ports[port.name] is not port:
                    raise PipelineBuildError(f"stage {stage.name!r} redefines port {port.name!r}")
                ports[port.name] = port
        if P.FRAMES.name not in ports:
            raise PipelineBuildError("no stage produces 'frames': add a decode stage")
        return ports

    def run(
        self,
        *,
        job_values: dict[Port[object], object],
        plan: ChunkPlan,
        state: RollingState,
        publisher: Publisher,
        mode: Mode = "streaming",
        should_cancel: Callable[[], bool] | None = None,
        on_chunk: Callable[[ChunkEvent], None] | None = None,
    ) -> None:
        t_start = time.perf_counter()
        values = Values(self.ports)
        for port, value in job_values.items():
            if port.scope is not Scope.JOB:
                raise PipelineBuildError(f"job value {port.name!r} is chunk-scoped")
            values.put(port, value)
        values.put(P.PLAN, plan)
        values.put(P.ROLLING, state)
        for stage in self.stages:
            with self.timings.stage(stage.name):
                stage.setup(values)

        held: list[torch.Tensor] = []  # batch mode only: every emission's latents, in order
        steps = plan.steps
        publisher.open()
        ok = False
        try:
            for i in range(state.next_step, len(steps)):
                if should_cancel is not None and should_cancel():
                    raise CancelledError(f"render cancelled before step {steps[i].name}")
                step = steps[i]
                values.put(P.STEP, step)
                for stage in self.step_stages:
                    with self.timings.stage(stage.name):
                        stage.run(values)
                latents = _advance(state, step, values.get(P.STEP_LATENTS))
                state.next_step = i + 1
                if step.emission is not None and latents is not None:
                    if mode == "batch":
                        held.append(latents)
                    else:
                        self._emit(values, state, plan, publisher, step.emission, latents)
                        if on_chunk is not None:
                            on_chunk(ChunkEvent(step.emission.index, plan.num_emissions,
                                                step.emission.frames.stop, plan.num_frames,
                                                time.perf_counter() - t_start))
                values.end_chunk()
            if mode == "batch":
                self._emit_batch(values, state, plan, publisher, held)
                if on_chunk is not None:
                    on_chunk(ChunkEvent(plan.num_emissions - 1, plan.num_emissions, plan.num_frames,
                                        plan.num_frames, time.perf_counter() - t_start))
            ok = True
        finally:
            publisher.finish(ok=ok)

    def _run_emission_stages(self, values: Values, emission: Emission, latents: torch.Tensor) -> np.ndarray:
        values.put(P.EMISSION, emission)
        values.put(P.EMISSION_LATENTS, latents)
        for stage in self.emission_stages:
            with self.timings.stage(stage.name):
                stage.run(values)
        return values.get(P.FRAMES)

    def _emit(self, values: Values, state: RollingState, plan: ChunkPlan, publisher: Publisher,
              emission: Emission, latents: torch.Tensor) -> None:
        frames = self._run_emission_stages(values, emission, latents)
        state.next_emission = emission.index + 1
        is_last = emission.index == plan.num_emissions - 1
        publisher.publish(frames, first_frame=emission.frames.start, index=emission.index, is_last=is_last,
                          resume_state=None if is_last else state.snapshot())

    def _emit_batch(self, values: Values, state: RollingState, plan: ChunkPlan, publisher: Publisher,
                    held: list[torch.Tensor]) -> None:
        if not held:
            return
        first = plan.emission_frames(state.next_emission).start
        everything = Emission(-1, range(first, plan.num_frames), range(first, plan.num_frames),
                              range(plan.num_frames, plan.num_frames))
        frames = self._run_emission_stages(values, everything, torch.cat(held, dim=2))
        held.clear()
        for j in range(state.next_emission, plan.num_emissions):
            r = plan.emission_frames(j)
            publisher.publish(frames[r.start - first : r.stop - first], first_frame=r.start, index=j,
                              is_last=j == plan.num_emissions - 1, resume_state=None)
        state.next_emission = plan.num_emissions


def _advance(state: RollingState, step: ChunkStep, step_latents: torch.Tensor) -> torch.Tensor | None:
    """Update the rolling state after a step; return the emission's low-res latents, if any."""
    if step.kind is ChunkKind.N:
        if state.last_n is not None:
            state.prev_last = state.last_n[:, :, -1:].clone()
        state.last_n = step_latents
        return step_latents if step.emission is not None else None
    if state.last_n is None:
        raise RuntimeError(f"{step.name} ran without its pending N chunk")
    e = len(step.generate)
    return torch.cat([step_latents, state.last_n[:, :, e:]], dim=2)
