"""``render``: the one entry point every caller uses (CLI, worker, benchmarks, tests).

It validates the inputs, resolves the request's model family by name (``pipeline.families.FAMILIES``),
plans the chunks, builds (or reuses) the family's warm runtime, and runs its pipeline into the
caller's sinks. It knows nothing of where the inputs came from or where the fragments go, nor of any
particular family.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from pipeline import ports as P
from pipeline.encode import FragmentEncoder
from pipeline.errors import InvalidInputError
from pipeline.families import FAMILIES
from pipeline.family_runtime import WARM_FAMILIES, FamilyRuntime
from pipeline.host import peak_rss_bytes
from pipeline.inputs import AudioSource, image_size, load_reference_image
from pipeline.live_run import LiveSchedule
from pipeline.live_source import LiveAudioSource
from pipeline.media_types import FrameSink
from pipeline.pipeline import Mode
from pipeline.publish import Publisher
from pipeline.request import MAX_TEXT_CHARS, RenderProgress, RenderRequest, RenderResult
from pipeline.schedule import ChunkPlan, LiveChunkPlan, PlanError, frames_for_audio
from pipeline.state import ResumeKey, RollingState

log = logging.getLogger(__name__)



def validate_request(request: RenderRequest) -> None:
    if request.text is not None and len(request.text) > MAX_TEXT_CHARS:
        raise InvalidInputError(
            f"text has {len(request.text)} characters; the limit is {MAX_TEXT_CHARS}: shorten the prompt",
            field="text")
    if not isinstance(request.seed, int) or request.seed < 0:
        raise InvalidInputError(f"seed={request.seed!r}: must be an integer >= 0", field="seed")


def resume_key(request: RenderRequest, family: FamilyRuntime, options: Mapping[str, str | int | float],
               reference: np.ndarray) -> ResumeKey:
    """What decides a render's frames besides its chunk plan, as every resume snapshot records it
    (``pipeline.state``): the model (``FamilyRuntime.model_key``: family, preset, preset definition,
    weights identity), ``options`` as the family resolved them (``ModelFamily.options``: the preset's
    defaults filled in, so a deploy that changes a default changes the key), the seed, and digests of
    the text and of the reference image as rendered. Not the audio: the plan covers its length, its
    samples are not read up front. Cheap: a few hashes of small inputs."""
    key: ResumeKey = dict(family.model_key())
    for name, value in sorted(options.items()):
        # a long string (a negative prompt): its digest, not the text, in every snapshot
        key[f"options.{name}"] = _digest(value.encode()) if isinstance(value, str) and len(value) > 64 else value
    key["seed"] = request.seed
    key["text"] = None if request.text is None else _digest(request.text.encode())
    key["reference"] = _digest(str(reference.shape).encode() + np.ascontiguousarray(reference).tobytes())
    return key


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]


def render(
    request: RenderRequest,
    sinks: Sequence[FrameSink],
    *,
    mode: Mode = "streaming",
    resume_state: bytes | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_progress: Callable[[RenderProgress], None] | None = None,
    device: str = "cpu",
    frame_tap: Callable[[int, np.ndarray], None] | None = None,
    family: FamilyRuntime | None = None,
) -> RenderResult:
    """Render ``request`` into ``sinks``; see ``docs/architecture.md`` for the contract.

    ``frame_tap(first_frame, frames_THWC)`` sees every published frame before encoding (quality
    metrics, tests); it must not keep the array. ``family``: the runtime to render with (a NodeEngine
    rank passes one over its sharded modules); default: this process's warm runtime of the family
    ``request.family`` names (``WARM_FAMILIES.get(FAMILIES.get(request.family), request.preset,
    request.checkpoint, device=device)``).
    """
    t0 = time.perf_counter()
    validate_request(request)
    if request.live:
        if mode != "streaming":
            raise InvalidInputError(f"mode={mode!r} with live=True: a live session is published as it renders; "
                                    "pass mode='streaming'", field="mode")
        if resume_state is not None:
            raise InvalidInputError("resume_state with live=True: live sessions are not resumable (their audio "
                                    "was live); start a new session without resume_state", field="resume_state")
    if family is None:
        family = WARM_FAMILIES.get(FAMILIES.get(request.family), request.preset, request.checkpoint, device=device)
    elif family.family.name != request.family:
        raise InvalidInputError(
            f"family={request.family!r} but the runtime passed to render() is of family "
            f"{family.family.name!r}: request the family the runtime (the engine's loaders) was built for",
            field="family")
    elif family.preset.name != request.preset:
        raise InvalidInputError(
            f"preset={request.preset!r} but the family passed to render() is {family.preset.name!r}: "
            "request the preset the family (the engine's loaders) was built for", field="preset")
    preset = family.preset
    options = family.family.options(preset, request.options)
    height, width = family.family.output_size(preset, image_size(Path(request.image)))
    reference = load_reference_image(Path(request.image), height, width)
    grid = family.family.frame_grid(preset)
    if request.live:
        return _render_live(request, sinks, family, reference, options, t0=t0, should_cancel=should_cancel, on_progress=on_progress,
                            frame_tap=frame_tap)
    with AudioSource.open(Path(request.audio), model_rate=preset.sample_rate) as audio:
        try:
            num_video = frames_for_audio(audio.num_samples(preset.sample_rate), preset.sample_rate, preset.fps)
            plan = ChunkPlan(grid.timeline_frames(num_video), preset.chunk_frames, preset.context_frames,
                             preset.interp_frames, use_i_chunks=request.use_i_chunks,
                             reference_frame=preset.reference_frame, grid=grid,
                             num_video_frames=0 if grid.is_identity else num_video)
        except PlanError as exc:
            raise InvalidInputError(f"audio {request.audio}: {exc}", field="audio") from exc
        plan_key, key = plan.key, resume_key(request, family, options, reference)
        if resume_state is not None:
            if mode != "streaming":
                raise InvalidInputError("resume_state needs mode='streaming'", field="mode")
            state = RollingState.restore(resume_state, plan_key=plan_key, resume_key=key, device=device)
        else:
            state = RollingState(plan_key=plan_key, resume_key=key)
        # x264 "veryfast": ~40% less CPU than "fast" for the same CRF; inference owns the cores
        encoder = FragmentEncoder(width, height, preset.fps, audio, preset="veryfast",
                                  start_frame=plan.video_frames(plan.emission_frames(state.next_emission)).start
                                  if state.next_emission < plan.num_emissions else plan.total_video_frames)
        publisher = Publisher(encoder, sinks, asynchronous=mode == "streaming", frame_tap=frame_tap)

        family.timings.reset()
        family.pipeline.run(
            job_values={P.REFERENCE_RGB: reference, P.AUDIO: audio, P.TEXT: request.text, P.SEED: request.seed,
                        P.OPTIONS: options},
            plan=plan, state=state, publisher=publisher, mode=mode, should_cancel=should_cancel,
            on_chunk=on_progress, overlap_emissions=family.overlap_emissions, batch_steps=family.batch_steps,
        )
    return _result(family, publisher, plan.total_video_frames, t0)


def _render_live(request: RenderRequest, sinks: Sequence[FrameSink], family: FamilyRuntime, reference: np.ndarray,
                 options: dict[str, str | int | float], *, t0: float,
                 should_cancel: Callable[[], bool] | None, on_progress: Callable[[RenderProgress], None] | None,
                 frame_tap: Callable[[int, np.ndarray], None] | None) -> RenderResult:
    """``request.audio`` is a live directory (``pipeline.live``): the steps run as its audio arrives
    (``pipeline.live_run.LiveSchedule``) until its ``end.json``; see docs/live.md."""
    preset = family.preset
    try:
        live_plan = LiveChunkPlan(preset.chunk_frames, preset.context_frames, preset.interp_frames,
                                  use_i_chunks=request.use_i_chunks, reference_frame=preset.reference_frame,
                                  grid=family.family.frame_grid(preset),
                                  audio_lookahead_frames=family.family.audio_lookahead_frames(preset))
    except PlanError as exc:
        raise InvalidInputError(f"preset {preset.name!r}: {exc}", field="preset") from exc
    with LiveAudioSource(Path(request.audio), model_rate=preset.sample_rate, should_cancel=should_cancel) as audio:
        schedule = LiveSchedule(live_plan, audio, preset.sample_rate, preset.fps)
        encoder = FragmentEncoder(reference.shape[1], reference.shape[0],
                                  preset.fps, audio, preset="veryfast")
        publisher = Publisher(encoder, sinks, asynchronous=True, frame_tap=frame_tap)
        family.timings.reset()
        family.pipeline.run(
            job_values={P.REFERENCE_RGB: reference, P.AUDIO: audio, P.TEXT: request.text, P.SEED: request.seed,
                        P.OPTIONS: options},
            plan=schedule, state=RollingState(plan_key=live_plan.key), publisher=publisher, mode="streaming",
            should_cancel=should_cancel, on_chunk=on_progress, overlap_emissions=family.overlap_emissions,
        )
        end = audio.end
    assert schedule.final is not None and end is not None  # the schedule ran to the feed's end
    rate = audio.meta.sample_rate
    return dataclasses.replace(_result(family, publisher, schedule.final.total_video_frames, t0),
                               live_end_reason=end.reason, live_fed_s=end.frames / rate,
                               live_silence_s=end.silence_frames / rate)


def _result(family: FamilyRuntime, publisher: Publisher, num_frames: int, t0: float) -> RenderResult:
    wall = time.perf_counter() - t0
    first = publisher.first_fragment_at
    return RenderResult(
        num_frames=num_frames,
        duration_s=num_frames / family.preset.fps,
        ttff_s=(first - t0) if first is not None else wall,
        wall_s=wall,
        peak_rss_bytes=peak_rss_bytes(),
        stage_s=dict(family.timings.stage_s),
        model_s=dict(family.timings.model_s),
        encode_s=publisher.encode_s,
        num_fragments=publisher.num_fragments,
        random_init=family.is_random_init,
    )
