"""The framework's ports: the values every family's pipeline shares with the chunk loop.

``render()`` provides the request's values (reference image, audio, text, seed); the pipeline
provides the plan, the rolling state, the step and the emission. Every family's step stages must
produce :data:`STEP_LATENTS` (the low-res latents of ``step.generate``, which the rolling state keeps)
and its last emission stage :data:`FRAMES`. A family's own values are declared in its own
``ports.py`` (``pipeline/families/<name>/ports.py``). Producers and consumers import the same
:class:`~pipeline.stage.Port` objects, so a typo is an ImportError, not a silent miss. ``job``
values live for the request, ``chunk`` values for one step.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.inputs import AudioReader as AudioReader
from pipeline.schedule import ChunkPlan, ChunkStep, Emission
from pipeline.stage import Port, Scope
from pipeline.state import RollingState

J, C = Scope.JOB, Scope.CHUNK


# provided by the pipeline from the request
REFERENCE_RGB = Port("reference_rgb", np.ndarray, J, "reference image, HxWx3 uint8 at output size")
AUDIO = Port("audio", AudioReader, J, "the driving audio")  # type: ignore[type-abstract]
TEXT = Port("text", str, J, "text / scene prompt", optional=True)
SEED = Port("seed", int, J, "job seed; per-chunk seeds derive from it and the step")
OPTIONS = Port("options", dict, J, "the request's family options, checked and completed by ModelFamily.options")
PLAN = Port("plan", ChunkPlan, J, "the N/I chunk plan")
ROLLING = Port("rolling", RollingState, J, "state that crosses chunks")
STEP = Port("step", ChunkStep, C, "the plan step being run")
EMISSION = Port("emission", Emission, C, "the timeline range made final by this step")
EMISSION_LATENTS = Port("emission_latents", torch.Tensor, C, "low-res latents_BCThw of the emission")

# produced by every family's stages, read by the chunk loop
STEP_LATENTS = Port("step_latents", torch.Tensor, C, "low-res latents_BCThw of step.generate")
FRAMES = Port("frames", np.ndarray, C, "decoded RGB frames THWC uint8 of the emission")

PIPELINE_INPUTS = (REFERENCE_RGB, AUDIO, TEXT, SEED, OPTIONS, PLAN, ROLLING, STEP, EMISSION, EMISSION_LATENTS)
