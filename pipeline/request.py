"""What a render is asked for and what it reports: the ``render()`` contract's plain data.

No torch here: the worker, the API and test doubles of the renderer (``tests/integration/
fake_pipeline.py``) import these without loading the models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class RenderRequest:
    image: Path
    audio: Path
    text: str | None = None
    seed: int = 0
    family: str = "tiny"  # a name registered in pipeline.families.FAMILIES
    preset: str = "tiny"  # one of the family's presets
    checkpoint: Path | None = None
    use_i_chunks: bool = True  # False renders the N-only baseline (for seam measurements)


@dataclass(frozen=True)
class RenderProgress:
    emission_index: int
    num_emissions: int
    frames_done: int
    num_frames: int
    elapsed_s: float


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
