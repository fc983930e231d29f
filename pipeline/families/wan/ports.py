"""The ``wan`` family's ports: the values its three stages hand each other.

The framework's ports (``pipeline.ports``) are re-exported, so a stage reads every port as ``P.<NAME>``.
Latents are in the DiT's normalised space (``models.wan.vae``), shapes ``[1, 16, T, h, w]``.
"""

from __future__ import annotations

import torch

from pipeline.ports import AUDIO as AUDIO
from pipeline.ports import EMISSION_LATENTS as EMISSION_LATENTS
from pipeline.ports import FRAMES as FRAMES
from pipeline.ports import OPTIONS as OPTIONS
from pipeline.ports import PLAN as PLAN
from pipeline.ports import REFERENCE_RGB as REFERENCE_RGB
from pipeline.ports import ROLLING as ROLLING
from pipeline.ports import SEED as SEED
from pipeline.ports import STEP as STEP
from pipeline.ports import STEP_LATENTS as STEP_LATENTS
from pipeline.ports import TEXT as TEXT
from pipeline.stage import Port, Scope

J, C = Scope.JOB, Scope.CHUNK

# context stage, per job
REF_LATENT = Port("ref_latent", torch.Tensor, J, "reference latent_BC1hw: timeline frame 0's known latent")
PAD_LATENT = Port("pad_latent", torch.Tensor, J,
                  "latent_BC1hw of gray frames after the reference: the I2V condition of unknown frames")
CLIP_TOKENS = Port("clip_tokens", torch.Tensor, J, "CLIP penultimate tokens_BMC of the reference")
TEXT_STATES = Port("text_states", tuple, J, "(prompt, negative prompt) umT5 states, each [L_i, D]")
AUDIO_STATS = Port("audio_stats", tuple, J, "(mean, std) of the whole waveform: wav2vec2's normalisation")
# context stage, per step
AUDIO_WINDOWS = Port("audio_windows", torch.Tensor, C,
                     "wav2vec2 windows_BFWLC of the step: one per video frame, F = 1 + 4(T - 1)")
NOISE = Port("noise", torch.Tensor, C, "initial noise_BCThw of the step's window")
# a2v stage
DIT_CONTEXT = Port("dit_context", tuple, J, "(text_BND of [prompt, negative], image_BMD): the DiT's context")
