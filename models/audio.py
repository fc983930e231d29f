"""Audio feature encoder: a log-mel front end (STFT + mel filterbank in plain torch) and learned layers.

Who calls it: the pipeline's context stage, once per chunk, with the audio samples of the chunk's
window plus ``context_frames`` video frames of audio on each side (zeros where the audio has none).

Chunk independence: the feature of video frame i is computed only from the mel frames that lie
entirely inside frame i's audio window ``[i - C, i + C]`` (in video frames), and each mel frame only
from its own samples (``center=False``, no padding). So features computed for a frame in any window
are the same as computed in one pass over the whole file.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.presets import AudioConfig


def mel_filterbank(n_fft: int, n_mels: int, sample_rate: int, f_min: float, f_max: float) -> Tensor:
    """HTK-scale triangular filters ``(n_mels, n_fft // 2 + 1)`` over the power spectrum."""

    def mel_to_hz(m: Tensor) -> Tensor:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    freqs = torch.linspace(0.0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64, device="cpu")
    lo, hi = (2595.0 * math.log10(1.0 + f / 700.0) for f in (f_min, f_max))
    mels = torch.linspace(lo, hi, n_mels + 2, dtype=torch.float64, device="cpu")
    pts = mel_to_hz(mels)
    lower, center, upper = pts[:-2, None], pts[1:-1, None], pts[2:, None]
    up = (freqs[None] - lower) / (center - lower)
    down = (upper - freqs[None]) / (upper - center)
    return torch.clamp(torch.minimum(up, down), min=0.0).float()


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        spf = cfg.sample_rate // cfg.fps
        if cfg.sample_rate % cfg.fps or spf % cfg.hop_length:
            raise ValueError(
                f"AudioConfig: samples per frame ({cfg.sample_rate}/{cfg.fps}) must be a whole number "
                f"and a multiple of hop_length={cfg.hop_length}"
            )
        window = (2 * cfg.context_frames + 1) * spf
        if window < cfg.n_fft:
            raise ValueError(
                f"AudioConfig: the audio window of a frame ({window} samples) is shorter than n_fft"
            )
        self.cfg = cfg
        self.context_frames = cfg.context_frames
        self.samples_per_frame = spf
        self.mels_per_frame = spf // cfg.hop_length  # stride between frames in mel frames
        self.mels_per_window = (window - cfg.n_fft) // cfg.hop_length + 1
        # fixed DSP constants: built on first use per device rather than kept as buffers, so they are
        # never part of a checkpoint and survive meta-device construction + to_empty()
        self._dsp: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self.conv_in = nn.Conv1d(cfg.n_mels, cfg.dim, 3, padding=1)
        self.blocks = nn.ModuleList(
            [nn.Conv1d(cfg.dim, cfg.dim, 3, padding=1) for _ in range(cfg.num_layers)]
        )
        self.proj = nn.Linear(cfg.dim * self.mels_per_window, cfg.out_dim)
        self.norm = nn.LayerNorm(cfg.out_dim)

    def num_samples(self, num_frames: int) -> int:
        """Samples ``forward`` expects for ``num_frames`` central frames."""
        return (num_frames + 2 * self.context_frames) * self.samples_per_frame

    def _dsp_constants(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._dsp:
            cfg = self.cfg
            f_max = cfg.f_max if cfg.f_max is not None else cfg.sample_rate / 2
            fb = mel_filterbank(cfg.n_fft, cfg.n_mels, cfg.sample_rate, cfg.f_min, f_max)
            self._dsp[device] = (fb.to(device), torch.hann_window(cfg.n_fft, device="cpu").to(device))
        return self._dsp[device]

    def log_mel(self, wave_BS: Tensor) -> Tensor:
        """``(B, S)`` -> ``(B, n_mels, M)`` log-mel, mel frame j from samples ``[j*hop, j*hop + n_fft)``."""
        fb, window = self._dsp_constants(wave_BS.device)
        spec = torch.stft(
            wave_BS.float(),
            self.cfg.n_fft,
            self.cfg.hop_length,
            window=window,
            center=False,
            return_complex=True,
        )
        mel = torch.matmul(fb, spec.abs() ** 2)
        return (torch.log(mel.clamp(min=1e-5)) + 4.0) / 4.0  # roughly zero-mean, unit scale for speech

    def forward(self, wave_BS: Tensor, num_frames: int) -> Tensor:
        """Audio of ``num_frames + 2*context_frames`` video frames -> features ``(B, num_frames, out_dim)``."""
        expected = self.num_samples(num_frames)
        if wave_BS.dim() != 2 or wave_BS.shape[1] != expected:
            raise ValueError(
                f"wave_BS has shape {tuple(wave_BS.shape)}; expected (B, {expected}) = (num_frames {num_frames} + "
                f"2 x context_frames {self.context_frames}) x {self.samples_per_frame} samples: pad with zeros "
                "outside the audio"
            )
        mel = self.log_mel(wave_BS)  # (B, n_mels, M)
        windows = mel.unfold(-1, self.mels_per_window, self.mels_per_frame)[
            :, :, :num_frames
        ]  # (B, n_mels, T, K)
        B, n_mels, T, K = windows.shape
        # the DSP runs in float32; the learned layers in the module's dtype
        x = windows.permute(0, 2, 1, 3).reshape(B * T, n_mels, K).to(self.conv_in.weight.dtype)
        x = F.gelu(self.conv_in(x))
        for conv in self.blocks:
            x = x + F.gelu(conv(x))
        return self.norm(self.proj(x.reshape(B, T, -1)))
