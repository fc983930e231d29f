"""Pipeline: the stage graph, its wiring check, and the chunk loop in streaming or batch mode.

``step()`` reads as schedule → execute → update: the plan (``pipeline.schedule``) says which step
comes next; the step stages (context, A2V) run on it; the rolling state is updated; if the step made
a timeline range final, the emission stages (SR, decode) run on it and the frames are published
(at the video frames of the range, ``ChunkPlan.video_frames``: a family whose latents span several
video frames decodes more frames per timeline frame).

With ``batch_steps`` an I step and the N step after it run as one group (their inputs do not depend
on each other: ``pipeline.schedule.can_share_forward``): the family's :class:`~pipeline.stage.BatchedStage`
(the A2V) samples both windows in one forward per sampler step; the frames are the same.

Streaming and batch modes run the same stages on the same steps. Batch mode is the conventional
design we measure against: it keeps every emission's latents until the plan is done, then runs SR and
decode over the whole sequence, then encodes — and must give the same frames.

With ``overlap_emissions`` (streaming only) the emission stages run on their own
:class:`~pipeline.lane.Lane`: while SR and the VAE decode one emission, the loop already samples the
next step, and the publisher encodes the emission before — three lanes on as many cores, each handing
over through a queue of one. The emission stages see the same values and the rolling state as of
their step, so the frames and resume snapshots are exactly those of the sequential loop. Off for
families whose models are sharded or parked across ranks (their collectives must be issued in the
same order on every rank: ``ModelFamily.overlap_emissions``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from pipeline import ports as P
from pipeline.errors import CancelledError, PipelineBuildError
from pipeline.host import release_free_heap
from pipeline.lane import Lane
from pipeline.live_run import LiveSchedule
from pipeline.publish import Publisher
from pipeline.request import RenderProgress
from pipeline.schedule import ChunkKind, ChunkPlan, ChunkStep, Emission, ReleasedStep, can_share_forward
from pipeline.stage import BatchedStage, Phase, Port, Scope, Stage, Values
from pipeline.stage_common import Timings
from pipeline.state import RollingState

log = logging.getLogger(__name__)

Mode = Literal["streaming", "batch"]


@dataclass(frozen=True)
class _EmissionWork:
    released: ReleasedStep  # the step that made the emission final
    latents: torch.Tensor  # low-res latents_BCThw of the emission
    state: RollingState  # the rolling state after the step (or group of steps) that made the emission final
    snapshot: bool  # make the resume snapshot (not for the last emission, nor for a live session)

    @property
    def emission(self) -> Emission:
        assert self.released.step.emission is not None
        return self.released.step.emission


class Pipeline:
    """A validated stage graph. Build once per preset; :meth:`run` once per request."""

    def __init__(self, stages: Sequence[Stage], *, provided: Sequence[Port[object]] = P.PIPELINE_INPUTS,
                 timings: Timings | None = None) -> None:
        self.stages = list(stages)
        self.timings = timings or Timings()
        self.ports = self._validate(provided)
        self.step_stages = [s for s in self.stages if s.phase is Phase.STEP]
        self.emission_stages = [s for s in self.stages if s.phase is Phase.EMISSION]
        batched = [s for s in self.step_stages if isinstance(s, BatchedStage)]
        if len(batched) > 1:
            raise PipelineBuildError(f"stages {[s.name for s in batched]} are all batched step stages: a "
                                     "pipeline batches its steps through one stage (the A2V)")
        self.batched_stage: BatchedStage | None = batched[0] if batched else None

    def _validate(self, provided: Sequence[Port[object]]) -> dict[str, Port[object]]:
        ports: dict[str, Port[object]] = {p.name: p for p in provided}
        # Emission stages run after every step stage, so check them in that order. They may run on
        # the emission lane while the loop is at a later step: the step's chunk values are not theirs.
        step_chunk = {P.STEP.name} | {p.name for s in self.stages if s.phase is Phase.STEP
                                      for p in s.outputs if p.scope is Scope.CHUNK}
        ordered = sorted(self.stages, key=lambda s: 0 if s.phase is Phase.STEP else 1)
        for stage in ordered:
            for port in stage.inputs:
                have = ports.get(port.name)
                if have is None:
                    raise PipelineBuildError(
                        f"stage {stage.name!r} reads {port.name!r} but no earlier stage produces it")
                if stage.phase is Phase.EMISSION and port.name in step_chunk:
                    raise PipelineBuildError(
                        f"emission stage {stage.name!r} reads {port.name!r}, a chunk value of the step: "
                        "emission stages see only the emission (emission, emission_latents), job values "
                        "and what earlier emission stages produce; make it job-scoped or pass it along")
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
        plan: ChunkPlan | LiveSchedule,
        state: RollingState,
        publisher: Publisher,
        mode: Mode = "streaming",
        should_cancel: Callable[[], bool] | None = None,
        on_chunk: Callable[[RenderProgress], None] | None = None,
        overlap_emissions: bool = False,
        batch_steps: bool = False,
    ) -> None:
        """Run ``plan`` from ``state.next_step`` on. ``on_chunk`` is called on this thread, in order,
        once per published emission (streaming) or once at the end (batch).

        With ``batch_steps`` (and a :class:`~pipeline.stage.BatchedStage` among the step stages) an
        I step and the N step after it (``can_share_forward``) run as one group: the step stages
        before the batched one run per step, the batched stage once over both, the rest per step;
        then the state advances step by step, in plan order. Each step's latents are those of the
        sequential loop. A group's emission is published with the state after the whole group (its
        resume snapshot restarts at the next group). Not for a live schedule: taking the N step with
        the I step would hold the I chunk's emission until the next chunk's audio has arrived.

        A :class:`~pipeline.live_run.LiveSchedule` (streaming only, from the start) releases its steps
        as the audio arrives; each emission's progress then carries ``audio_delay_s`` (its fragment's
        delivery to the sinks minus the arrival of the last audio it needed) and the counts so far,
        and is reported once the fragment is delivered.
        """
        t_start = time.perf_counter()
        live = isinstance(plan, LiveSchedule)
        if live and (mode != "streaming" or state.next_step):
            raise PipelineBuildError("a live schedule runs in streaming mode from its first step")
        values = Values(self.ports)
        for port, value in job_values.items():
            if port.scope is not Scope.JOB:
                raise PipelineBuildError(f"job value {port.name!r} is chunk-scoped")
            values.put(port, value)
        values.put(P.ROLLING, state)

        held: list[torch.Tensor] = []  # batch mode only: every emission's latents, in order
        events: deque[tuple[RenderProgress, float | None]] = deque()  # (progress, arrival): not reported yet

        def report(*, drained: bool = False) -> None:
            while events:
                event, arrival = events[0]
                if live:  # reported once delivered, with its delay
                    delivered = publisher.delivered_at(event.emission_index)
                    if delivered is None and not drained:
                        return
                    if delivered is not None and arrival is not None:
                        event = dataclasses.replace(event, audio_delay_s=delivered - arrival)
                events.popleft()
                if on_chunk is not None:
                    on_chunk(event)

        def emit(vals: Values, work: _EmissionWork) -> None:
            self._emit(vals, work, publisher)
            r = work.released
            total = r.plan.num_emissions if r.is_final else work.emission.index + 1
            frames = r.plan.total_video_frames if r.is_final else r.video.stop
            events.append((RenderProgress(work.emission.index, total, r.video.stop, frames,
                                          time.perf_counter() - t_start), r.arrival_t))

        lane: Lane[_EmissionWork] | None = None
        if overlap_emissions and mode == "streaming":
            lane_values = values.fork()  # same job values, its own chunk values
            lane = Lane("emission", lambda work: emit(lane_values, work))
        steps = plan.released(report) if isinstance(plan, LiveSchedule) else plan.released(state.next_step)
        first = next(steps, None)  # live: waits for the first chunk's audio (the setup may read it)
        values.put(P.PLAN, first.plan if first is not None else plan)
        for stage in self.stages:
            with self.timings.stage(stage.name):
                stage.setup(values)
        publisher.open()
        ok = False
        last: ReleasedStep | None = None
        try:
            if lane is not None:
                lane.start()
            released_steps = itertools.chain([first] if first is not None else [], steps)
            batching = batch_steps and not live and self.batched_stage is not None
            for group in _groups(released_steps, batching):
                if should_cancel is not None and should_cancel():
                    raise CancelledError(f"render cancelled before step {group[0].step.name}")
                outputs = self._run_steps(values, group)
                works: list[_EmissionWork] = []
                emitted: list[tuple[ReleasedStep, torch.Tensor]] = []
                for released, step_latents in zip(group, outputs, strict=True):
                    latents = _advance(state, released.step, step_latents)
                    state.next_step = released.index + 1
                    if released.step.emission is not None and latents is not None:
                        emitted.append((released, latents))
                last = group[-1]
                for j, (released, latents) in enumerate(emitted):
                    if mode == "batch":
                        held.append(latents)
                    else:  # the state after the group: a snapshot resumes at the next group
                        works.append(_EmissionWork(released, latents, dataclasses.replace(state),
                                                   snapshot=not live and not released.is_last_emission
                                                   and j == len(emitted) - 1))
                for work in works:
                    if lane is not None:
                        lane.submit(work)
                    else:
                        emit(values, work)
                report()
            if lane is not None:
                lane.finish(ok=True)  # every emission published (raises the lane's error, if any)
            if mode == "batch":
                assert isinstance(plan, ChunkPlan)
                self._emit_batch(values, state, plan, publisher, held)
                events.append((RenderProgress(plan.num_emissions - 1, plan.num_emissions, plan.total_video_frames,
                                              plan.total_video_frames, time.perf_counter() - t_start), None))
            if live:
                publisher.drain()  # every fragment delivered: each event has its delay
                if last is None or not last.is_last_emission:
                    raise RuntimeError("the live schedule ended before its last emission")
            report(drained=True)  # before the sinks finish: a callback that raises still fails the render
            ok = True
        finally:
            if lane is not None and lane.running:  # failed or cancelled: drop the queued emissions
                with contextlib.suppress(Exception):
                    lane.finish(ok=False)
            publisher.finish(ok=ok)

    def _run_steps(self, values: Values, group: list[ReleasedStep]) -> list[torch.Tensor]:
        """The step stages over a group of steps (one step, or steps that ``can_share_forward``):
        the stages before the batched one per step, the batched one once over the group (for one
        step that is its ``run``), the rest per step. Each step's ``STEP_LATENTS``, in order."""
        batched = self.batched_stage
        at = self.step_stages.index(batched) if batched is not None else len(self.step_stages)
        step_values = [values] if len(group) == 1 else [values.fork() for _ in group]  # chunk values per step
        prepared: list[Any] = []
        for released, vals in zip(group, step_values, strict=True):
            vals.put(P.PLAN, released.plan)  # the plan the step was taken from (live: it grows)
            vals.put(P.STEP, released.step)
            for stage in self.step_stages[:at]:
                with self.timings.stage(stage.name):
                    stage.run(vals)
            if batched is not None:
                prepared.append(batched.prepare(vals))
        if batched is not None:
            with self.timings.stage(batched.name):
                outputs = batched.run_batch(prepared)
            for vals, out in zip(step_values, outputs, strict=True):
                for port, value in out.items():
                    vals.put(port, value)
                for stage in self.step_stages[at + 1:]:
                    with self.timings.stage(stage.name):
                        stage.run(vals)
        latents = [vals.get(P.STEP_LATENTS) for vals in step_values]
        values.end_chunk()  # the forks of a group go with their chunk values
        return latents

    def _run_emission_stages(self, values: Values, emission: Emission, latents: torch.Tensor) -> np.ndarray:
        values.put(P.EMISSION, emission)
        values.put(P.EMISSION_LATENTS, latents)
        for stage in self.emission_stages:
            with self.timings.stage(stage.name):
                stage.run(values)
        return values.get(P.FRAMES)

    def _emit(self, values: Values, work: _EmissionWork, publisher: Publisher) -> None:
        """SR + decode one emission and publish it, with the resume snapshot of the state after it."""
        emission = work.emission
        frames = self._run_emission_stages(values, emission, work.latents)
        values.end_chunk()
        state = values.get(P.ROLLING)  # the decoder cache lives here (only the decode stage touches it)
        state.next_emission = emission.index + 1
        snapshot = None if not work.snapshot else dataclasses.replace(
            work.state, next_emission=emission.index + 1, decoder_cache=state.decoder_cache).snapshot()
        video = work.released.video  # the last emission is cut at the video's end
        publisher.publish(frames[: len(video)], first_frame=video.start, index=emission.index,
                          is_last=work.released.is_last_emission, resume_state=snapshot)
        del frames, snapshot
        release_free_heap()  # the emission's activations are free now; keep RSS at live memory

    def _emit_batch(self, values: Values, state: RollingState, plan: ChunkPlan, publisher: Publisher,
                    held: list[torch.Tensor]) -> None:
        if not held:
            return
        first = plan.emission_frames(state.next_emission).start
        everything = Emission(-1, range(first, plan.num_frames), range(first, plan.num_frames),
                              range(plan.num_frames, plan.num_frames))
        frames = self._run_emission_stages(values, everything, torch.cat(held, dim=2))
        held.clear()
        v0 = plan.video_frames(everything.frames).start
        for j in range(state.next_emission, plan.num_emissions):
            r = plan.video_frames(plan.emission_frames(j))
            publisher.publish(frames[r.start - v0 : r.stop - v0], first_frame=r.start, index=j,
                              is_last=j == plan.num_emissions - 1, resume_state=None)
        state.next_emission = plan.num_emissions


def _groups(released: Iterator[ReleasedStep], batching: bool) -> Iterator[list[ReleasedStep]]:
    """The released steps in order, grouped: with ``batching`` a step takes the one after it when
    they ``can_share_forward`` (an I step and the next N step); otherwise each step runs alone, and
    the next one is taken only once the current one is done (a live schedule's next step waits for
    its audio)."""
    current = next(released, None)
    while current is not None:
        following = next(released, None) if batching else None
        if following is not None and can_share_forward(current.step, following.step):
            yield [current, following]
            current = next(released, None)
        else:
            yield [current]
            current = following if batching else next(released, None)


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
