"""The ports of the reference avatar pipeline: one place that names every shared value.

Producers and consumers import the same :class:`~pipeline.stage.Port` objects, so a typo is an
ImportError, not a silent miss. ``job`` values live for the request, ``chunk`` values for one step.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from pipeline.schedule import ChunkPlan, ChunkStep, Emission
from pipeline.stage import Port, Scope
from pipeline.state import RollingState

J, C = Scope.JOB, Scope.CHUNK


@runtime_checkable
class AudioReader(Protocol):
    """What the stages need of the driving audio (``pipeline.inputs.AudioSource`` implements it)."""

    def read(self, start: int, stop: int, rate: int) -> np.ndarray:
        """Mono float32 samples ``[start, stop)`` at ``rate``, zero outside the audio."""
        ...

    def num_samples(self, rate: int) -> int:
        """Length of the audio in samples at ``rate``."""
        ...


# provided by the pipeline from the request
REFERENCE_RGB = Port("reference_rgb", np.ndarray, J, "reference image, HxWx3 uint8 at output size")
AUDIO = Port("audio", AudioReader, J, "the driving audio")  # type: ignore[type-abstract]
TEXT = Port("text", str, J, "text / scene prompt", optional=True)
SEED = Port("seed", int, J, "job seed; per-chunk seeds derive from it and the step")
PLAN = Port("plan", ChunkPlan, J, "the N/I chunk plan")
ROLLING = Port("rolling", RollingState, J, "state that crosses chunks")
STEP = Port("step", ChunkStep, C, "the plan step being run")
EMISSION = Port("emission", Emission, C, "the timeline range made final by this step")
EMISSION_LATENTS = Port("emission_latents", torch.Tensor, C, "low-res latents_BCThw of the emission")

# context stage
REF_LATENT = Port("ref_latent", torch.Tensor, J, "reference hr latent_BCHW (encoded once)")
REF_LOWRES = Port("ref_lowres", torch.Tensor, J, "reference low-res latent_BC1hw (N_0's known frame)")
TEXT_TOKENS = Port("text_tokens", torch.Tensor, J, "text tokens_BND", optional=True)
TEXT_MASK = Port("text_mask", torch.Tensor, J, "text mask_BN", optional=True)
AUDIO_GAIN = Port("audio_gain", float, J, "loudness normalisation gain for the model's audio input")
AUDIO_FEATS = Port("audio_feats", torch.Tensor, C, "audio features_BTD of the step's window")
AUDIO_FEATS_SILENT = Port("audio_feats_silent", torch.Tensor, C,
                          "features_BTD of silence over the step's window: audio guidance's unconditional input",
                          optional=True)
NOISE = Port("noise", torch.Tensor, C, "initial noise_BCThw of the step's window")

# a2v stage
A2V_CONTEXT = Port("a2v_context", tuple, J, "(reference + text tokens, mask) the DiT attends to; per job")
STEP_LATENTS = Port("step_latents", torch.Tensor, C, "low-res latents_BCThw of step.generate")

# sr stage
SR_REF_TOKENS = Port("sr_ref_tokens", torch.Tensor, J, "reference tokens of the SR DiT; per job")
EMISSION_HR = Port("emission_hr", torch.Tensor, C, "hr latents_BCThw of the emission")

# decode stage
FRAMES = Port("frames", np.ndarray, C, "decoded RGB frames THWC uint8 of the emission")

PIPELINE_INPUTS = (REFERENCE_RGB, AUDIO, TEXT, SEED, PLAN, ROLLING, STEP, EMISSION, EMISSION_LATENTS)
