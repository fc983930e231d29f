"""Deterministic inputs for benchmarks and tests: a speech-like WAV of any length and a reference."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEMO_IMAGE = REPO / "assets" / "demo" / "reference.png"
DEMO_AUDIO = REPO / "assets" / "demo" / "speech.wav"


def speech_like(seconds: float, sample_rate: int = 16000, seed: int = 0) -> np.ndarray:
    """Syllable-rate amplitude-modulated harmonic tones with pauses: float32 mono in [-1, 1]."""
    rng = np.random.default_rng(seed)
    n = max(1, int(round(seconds * sample_rate)))
    t = np.arange(n) / sample_rate
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.3 * t + rng.uniform(0, 6))
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    syll = np.clip(np.sin(2 * np.pi * 4.0 * t + rng.uniform(0, 6)), 0, None) ** 2
    pauses = (np.sin(2 * np.pi * 0.25 * t + rng.uniform(0, 6)) > -0.6).astype(np.float64)
    x = 0.3 * voice * syll * pauses + 0.002 * rng.standard_normal(n)
    return np.clip(x, -1, 1).astype(np.float32)


def write_wav(path: Path, samples: np.ndarray, sample_rate: int = 16000) -> Path:
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return path


def speech_wav(path: Path, seconds: float, seed: int = 0, sample_rate: int = 16000) -> Path:
    return write_wav(path, speech_like(seconds, sample_rate, seed), sample_rate)
