"""The renderer ``bench.quality`` scores in model mode: the real pipeline, frames streamed out.

``render_for_quality`` starts the render on a thread and returns at once with a generator of frames
(tapped before encoding, in timeline order) and the seam positions of the plan; the frames of a
10-minute render never sit in memory together. The MP4 is written to ``out_dir`` as a by-product.
This is the only renderer ``bench.quality`` scores (the training-time copy of the loop is gone):
``LONGTAKE_QUALITY_PRESET`` picks the preset, ``LONGTAKE_EVAL_CHECKPOINT`` another checkpoint.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np


def render_for_quality(image: Path, audio: Path, seconds: float, use_i_chunks: bool, out_dir: Path,
                       ) -> tuple[Iterator[np.ndarray], Sequence[int]]:
    from models.presets import get_preset
    from pipeline.inputs import AudioSource
    from pipeline.render import RenderRequest, render
    from pipeline.schedule import ChunkPlan, frames_for_audio
    from pipeline.sinks import FileSink

    preset = get_preset(os.environ.get("LONGTAKE_QUALITY_PRESET", "tiny"))
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
                                    checkpoint=Path(checkpoint) if checkpoint else None, use_i_chunks=use_i_chunks)
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
