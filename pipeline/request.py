"""What a render is asked for and what it reports: the ``render()`` contract's plain data.

No torch here: the worker, the API and test doubles of the renderer (``tests/integration/
fake_pipeline.py``) import these without loading the models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from pipeline.media_types import FrameSink

if TYPE_CHECKING:
    from pipeline.family_runtime import FamilyRuntime

RenderMode = Literal["streaming", "batch"]

MAX_TEXT_CHARS = 2000
"""Longest text/scene prompt ``render()`` accepts (the job spec refuses longer ones at submit)."""


@dataclass(frozen=True)
class RenderRequest:
    image: Path
    audio: Path
    text: str | None = None
    seed: int = 0
    family: str = "tiny"  # a name registered in pipeline.families.FAMILIES
    preset: str = "tiny"  # one of the family's presets
    checkpoint: Path | None = None
    use_i_chunks: bool = True  # False: N chunks only (the low-latency live mode; the seam baseline)
    # True: ``audio`` is a live directory (pipeline.live) that grows while the render runs; the
    # render follows it until its end.json and never knows the length up front
    live: bool = False
    # family options (sampling steps, guidance, ...), checked by the family's ModelFamily.options()
    options: Mapping[str, str | int | float] = field(default_factory=dict)


@dataclass(frozen=True)
class RenderProgress:
    emission_index: int
    num_emissions: int  # live: the emissions so far (the total is unknown until the feed ends)
    frames_done: int
    num_frames: int  # live: the frames so far
    elapsed_s: float
    # live: seconds from the arrival of the last audio frame this emission needs to its publication
    audio_delay_s: float | None = None


@dataclass(frozen=True)
class RenderResult:
    num_frames: int
    duration_s: float
    ttff_s: float
    wall_s: float
    peak_rss_bytes: int
    stage_s: dict[str, float] = field(default_factory=dict)
    model_s: dict[str, float] = field(default_factory=dict)
    encode_s: float = 0.0
    num_fragments: int = 0
    random_init: bool = False
    # live (RenderRequest.live): why the feed ended (pipeline.live.END_REASONS), the fed timeline's
    # length (the sender's audio plus the silence the live clock inserted) and that silence, in seconds
    live_end_reason: str | None = None
    live_fed_s: float = 0.0
    live_silence_s: float = 0.0


class Renderer(Protocol):
    """``render()``'s contract (``pipeline.render.render`` is the implementation; tests plug in
    stand-ins). A NodeEngine rank calls it with the rank's device and, for a sharded render, the
    family over the rank's engine-loaded modules; a renderer that has no models ignores both."""

    def __call__(
        self,
        request: RenderRequest,
        sinks: Sequence[FrameSink],
        *,
        mode: RenderMode = "streaming",
        resume_state: bytes | None = None,
        should_cancel: Callable[[], bool] | None = None,
        on_progress: Callable[[RenderProgress], None] | None = None,
        device: str = "cpu",
        family: FamilyRuntime | None = None,
    ) -> RenderResult: ...
