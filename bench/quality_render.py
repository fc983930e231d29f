"""The renderer ``bench.quality`` scores in model mode: the real pipeline, frames streamed out.

``render_for_quality`` starts the render on a thread and returns at once with a generator of frames
(tapped before encoding, in timeline order) and the seam positions of the plan; the frames of a
10-minute render never sit in memory together. The MP4 is written to ``out_dir`` as a by-product.
This is the only renderer ``bench.quality`` scores (the training-time copy of the loop is gone):
``LONGTAKE_QUALITY_PRESET`` picks the preset, ``LONGTAKE_EVAL_CHECKPOINT`` another checkpoint,
``LONGTAKE_EVAL_OPTIONS`` the request's family options as a JSON object (e.g.
``'{"audio_guidance": 2.0}'``: a checkpoint scored under other sampling settings than its preset's;
the family checks them as it checks a job's).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np


def eval_options() -> dict[str, str | int | float]:
    """``$LONGTAKE_EVAL_OPTIONS``: a JSON object of family options, ``{}`` when unset."""
    raw = os.environ.get("LONGTAKE_EVAL_OPTIONS", "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"LONGTAKE_EVAL_OPTIONS={raw!r} is not JSON ({exc}); give an object such as "
                         "'{\"audio_guidance\": 2.0}'") from None
    if not isinstance(value, dict) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                              for v in value.values()):
        raise ValueError(f"LONGTAKE_EVAL_OPTIONS={raw!r}: must be a JSON object of option names to numbers or "
                         "strings, such as '{\"audio_guidance\": 2.0}'")
    return value


def render_for_quality(image: Path, audio: Path, seconds: float, use_i_chunks: bool, out_dir: Path,
                       ) -> tuple[Iterator[np.ndarray], Sequence[int]]:
    from models.presets import get_preset
    from pipeline.inputs import AudioSource
    from pipeline.render import RenderRequest, render
    from pipeline.schedule import ChunkPlan, frames_for_audio
    from pipeline.sinks import FileSink

    preset = get_preset(os.environ.get("LONGTAKE_QUALITY_PRESET", "tiny"))
    options = eval_options()  # a malformed value fails before the audio is read
    with AudioSource.open(audio, model_rate=preset.sample_rate) as src:
        n = frames_for_audio(src.num_samples(preset.sample_rate), preset.sample_rate, preset.fps)
    plan = ChunkPlan(n, preset.chunk_frames, preset.context_frames, preset.interp_frames,
                     use_i_chunks=use_i_chunks, reference_frame=preset.reference_frame)
    parts: queue.Queue[np.ndarray | BaseException | None] = queue.Queue(maxsize=2)

    def tap(first_frame: int, frames: np.ndarray) -> None:
        parts.put(frames.copy())

    def run() -> None:
        try:
            checkpoint = os.environ.get("LONGTAKE_EVAL_CHECKPOINT") or None
            request = RenderRequest(image=image, audio=audio, seed=0, preset=preset.name,
                                    checkpoint=Path(checkpoint) if checkpoint else None, use_i_chunks=use_i_chunks,
                                    options=options)
            render(request, [FileSink(out_dir / "render.mp4")], frame_tap=tap)
            parts.put(None)
        except BaseException as exc:  # surfaced to the consumer
            parts.put(exc)

    thread = threading.Thread(target=run, name="quality-render", daemon=True)
    thread.start()

    def frames() -> Iterator[np.ndarray]:
        while True:
            item = parts.get()
            if item is None:
                thread.join()
                return
            if isinstance(item, BaseException):
                raise item
            yield from item

    return frames(), plan.seams()
