"""The tiny family's ports: the values its four stages hand each other.

The framework's ports (``pipeline.ports``: the request's values, plan, step, emission, step latents,
frames) are re-exported here, so a stage reads every port it uses as ``P.<NAME>``.
"""

from __future__ import annotations

import torch

from pipeline.ports import AUDIO as AUDIO
from pipeline.ports import EMISSION as EMISSION
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
from pipeline.ports import AudioReader as AudioReader
from pipeline.stage import Port, Scope

J, C = Scope.JOB, Scope.CHUNK

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
DECODER_REFERENCE = Port("decoder_reference", tuple, J,
                         "what a decoder that reads the reference reads of it (CausalVAE.reference_features, "
                         "a models.vae.DecoderReference); "
                         "None for one that does not", optional=True)

# a2v stage (and STEP_LATENTS)
A2V_CONTEXT = Port("a2v_context", tuple, J, "(reference + text tokens, mask) the DiT attends to; per job")

# sr stage
SR_REF_TOKENS = Port("sr_ref_tokens", torch.Tensor, J, "reference tokens of the SR DiT; per job")
EMISSION_HR = Port("emission_hr", torch.Tensor, C, "hr latents_BCThw of the emission")

# decode stage: FRAMES (reads DECODER_REFERENCE)
