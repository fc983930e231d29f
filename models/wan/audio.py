"""wav2vec2 audio features for the Wan avatar DiT, computed per chunk window, never for the whole audio.

Upstream (MeiGen-AI/InfiniteTalk ``generate_infinitetalk.py:get_embedding`` + ``src/audio_analysis/
wav2vec2.py``; SoulX-FlashTalk likewise) runs transformers' ``Wav2Vec2Model`` (chinese-wav2vec2-base) on
the *whole* clip: CNN features at 50 Hz are linearly resampled (``align_corners=True``) to one per 25 fps
video frame, then the transformer runs on those, and the hidden states of every layer (``hidden_states[1:]``)
are stacked: ``[F, 12, 768]``. The DiT then takes, per video frame, the 5 frames centred on it, clamped
at the clip's ends (:func:`frame_windows`).

Here :meth:`WanAudioFeatures.features` computes the same thing for video frames ``[start, end)`` from
the samples of ``[start − context, end + context)`` only:

* the resampling positions are the whole clip's (they depend on its total length, known up front), so
  CNN features and their resampling equal the whole-clip computation exactly away from the clip's ends;
* the transformer sees only the window plus ``context`` frames each side (its attention is global over
  what it sees, so far-away audio no longer contributes — the stated edge treatment; the clip's own
  ends behave exactly as upstream);
* waveform normalisation (the feature extractor's zero-mean / unit-variance) uses the statistics the
  caller passes (one streaming pass over the file), by default the window's own.

Who calls what: a family's audio stage calls :meth:`features` once per chunk with a reader of the job's
audio; memory is bounded by the window, not the audio's length (tested: 10 s vs 10 min).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Wav2Vec2Model

from models.wan.checkpoint import WanCheckpointError

SAMPLE_RATE = 16000
FPS = 25
SAMPLES_PER_FRAME = SAMPLE_RATE // FPS  # 640
CNN_STRIDE = 320  # wav2vec2 conv stack: total stride 320, receptive field 400 samples
CNN_FIELD = 400

AudioReader = Callable[[int, int], Tensor]  # (start_sample, end_sample) -> float32 mono [N]


def num_cnn_frames(num_samples: int) -> int:
    return max(0, (num_samples - CNN_FIELD) // CNN_STRIDE + 1)


def num_video_frames(num_samples: int) -> int:
    """Upstream: ``int(duration · 25)`` video frames for a clip of ``num_samples`` at 16 kHz."""
    return int(num_samples / SAMPLE_RATE * FPS)


class WanAudioFeatures(nn.Module):
    """Wraps one transformers ``Wav2Vec2Model``; adds no parameters."""

    def __init__(self, model: Wav2Vec2Model) -> None:
        super().__init__()
        self.model = model

    @torch.no_grad()
    def features(
        self,
        read: AudioReader,
        num_samples: int,
        start: int,
        end: int,
        context: int = 16,
        stats: tuple[float, float] | None = None,
    ) -> Tensor:
        """Hidden states of every layer for video frames ``[start, end)``: ``[end − start, L, C]``.

        ``read(a, b)`` returns samples ``a..b`` of the job's audio (16 kHz mono); ``num_samples`` is its
        length; ``context`` video frames each side feed the transformer; ``stats`` = (mean, std) of
        the whole waveform for the extractor's normalisation (default: the window's).
        """
        total_frames = num_video_frames(num_samples)
        if not 0 <= start < end <= total_frames:
            raise ValueError(f"frames [{start}, {end}) outside the clip's {total_frames} video frames")
        lo, hi = max(0, start - context), min(total_frames, end + context)
        cnn_BFC = self.resampled_cnn(read, num_samples, lo, hi, stats)
        states_FLC = layer_states(self.model, cnn_BFC)[0]
        return states_FLC[start - lo : end - lo].float()

    def resampled_cnn(
        self, read: AudioReader, num_samples: int, lo: int, hi: int, stats: tuple[float, float] | None
    ) -> Tensor:
        """CNN features resampled to video frames ``[lo, hi)`` at the whole clip's positions: ``[1, F, C]``."""
        total_frames = num_video_frames(num_samples)
        total_cnn = num_cnn_frames(num_samples)
        scale = (total_cnn - 1) / max(1, total_frames - 1)
        pos = torch.arange(lo, hi, dtype=torch.float64) * scale  # whole-clip positions (align_corners)
        j0 = int(pos[0].floor())
        j1 = min(total_cnn - 1, int(pos[-1].floor()) + 1)
        # the samples of CNN frames j0..j1; to the file's end when the window reaches the clip's end
        a = j0 * CNN_STRIDE
        b = num_samples if hi == total_frames else min(num_samples, j1 * CNN_STRIDE + CNN_FIELD)
        wave = read(a, b).float()
        mean, std = stats if stats is not None else (float(wave.mean()), float(wave.std(unbiased=False)))
        wave = (wave - mean) / (std**2 + 1e-7) ** 0.5  # Wav2Vec2FeatureExtractor's zero_mean_unit_var_norm
        dtype = next(self.model.parameters()).dtype
        cnn_BCJ = self.model.feature_extractor(wave[None].to(dtype))  # [1, C, J]: CNN frames j0..
        rel = (pos - j0).clamp(0, cnn_BCJ.shape[2] - 1)
        left = rel.floor().long().clamp(max=cnn_BCJ.shape[2] - 1)
        right = (left + 1).clamp(max=cnn_BCJ.shape[2] - 1)
        w = (rel - left).to(cnn_BCJ.device, cnn_BCJ.dtype)[None, None]  # positions are host arithmetic
        return (cnn_BCJ[:, :, left] * (1 - w) + cnn_BCJ[:, :, right] * w).transpose(1, 2)


def layer_states(model: Wav2Vec2Model, cnn_BFC: Tensor) -> Tensor:
    """Feature projection + encoder on resampled CNN features → every layer's output ``[B, F, L, C]``
    (= transformers' ``hidden_states[1:]``; the encoder is driven layer by layer because transformers 5
    records hidden states only through the top-level model's forward)."""
    if model.config.do_stable_layer_norm:
        raise ValueError("expected the chinese-wav2vec2-base encoder (do_stable_layer_norm=False)")
    hidden, _ = model.feature_projection(cnn_BFC)
    enc = model.encoder
    h = enc.dropout(enc.layer_norm(hidden + enc.pos_conv_embed(hidden)))
    outs = []
    for layer in enc.layers:
        out = layer(h, attention_mask=None)
        h = out[0] if isinstance(out, tuple) else out
        outs.append(h)
    return torch.stack(outs, dim=2)


def frame_windows(features_FLC: Tensor, first_frame: int, start: int, end: int, total_frames: int,
                  window: int = 5) -> Tensor:  # fmt: skip
    """Per video frame ``start..end-1``, the ``window`` feature frames centred on it, clamped at the
    clip's ends (upstream ``center_indices`` + ``torch.clamp``). ``features_FLC`` holds frames
    ``first_frame ..``; it must cover ``[start − window//2, end + window//2)`` within the clip."""
    half = window // 2
    idx = torch.arange(start, end)[:, None] + torch.arange(-half, half + 1)[None]
    idx = idx.clamp(0, total_frames - 1) - first_frame
    if idx.min() < 0 or idx.max() >= features_FLC.shape[0]:
        raise ValueError(
            f"features cover frames [{first_frame}, {first_frame + features_FLC.shape[0]}); windows for "
            f"[{start}, {end}) need [{start - half}, {end + half}) — compute features with more margin"
        )
    return features_FLC[idx]  # [F, window, L, C]


def whole_clip_features(model: Wav2Vec2Model, wave: Tensor) -> Tensor:
    """The upstream whole-clip computation (tests / short clips only): ``[F, L, C]``."""
    wave = (wave - wave.mean()) / (wave.var(unbiased=False) + 1e-7) ** 0.5
    cnn = model.feature_extractor(wave[None]).transpose(1, 2)
    cnn = F.interpolate(
        cnn.transpose(1, 2), size=num_video_frames(wave.numel()), align_corners=True, mode="linear"
    )
    return layer_states(model, cnn.transpose(1, 2))[0]


_PRETRAINING_HEADS = ("quantizer.", "project_q.", "project_hid.", "lm_head.")


def load_wav2vec2(
    folder: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> WanAudioFeatures:
    """Load the chinese-wav2vec2-base folder (``config.json`` + ``model.safetensors`` or
    ``pytorch_model.bin``) strictly: missing or wrong-shape tensors raise; the pre-training heads the
    public checkpoint also holds (quantizer, project_q / project_hid) are the only keys allowed to be
    left unused."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise WanCheckpointError(
            f"{folder}: no config.json — not the chinese-wav2vec2-base folder (download "
            "TencentGameMate/chinese-wav2vec2-base, and its model.safetensors from refs/pr/1)"
        )
    model, info = Wav2Vec2Model.from_pretrained(
        str(folder), local_files_only=True, output_loading_info=True, dtype=dtype
    )
    unexpected = [
        k
        for k in sorted(info["unexpected_keys"])
        if not k.removeprefix("wav2vec2.").startswith(_PRETRAINING_HEADS)
    ]
    problems = {
        "missing": sorted(info["missing_keys"]),
        "unexpected": unexpected,
        "wrong-shape": sorted(map(str, info["mismatched_keys"])),
    }
    bad = {k: v for k, v in problems.items() if v}
    if bad:
        detail = "; ".join(f"{k} keys: {', '.join(map(str, v[:5]))}" for k, v in bad.items())
        raise WanCheckpointError(f"{folder}: not the chinese-wav2vec2-base layout — {detail}")
    return WanAudioFeatures(model.to(device).eval().requires_grad_(False))
