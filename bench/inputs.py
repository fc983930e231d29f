"""Deterministic inputs for benchmarks and tests: a speech-like WAV of any length and a reference.

The WAV is generated and written block by block (:func:`speech_blocks`), so an hour of input costs a
block's memory, not the whole waveform's in float64 (which made ``bench.stream``'s peak RSS for long
inputs measure this generator instead of the renderer). The blocks concatenate to exactly the
samples of the one-shot :func:`speech_like`.
"""

from __future__ import annotations

import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEMO_IMAGE = REPO / "assets" / "demo" / "reference.png"
DEMO_AUDIO = REPO / "assets" / "demo" / "speech.wav"

BLOCK_SAMPLES = 1 << 18


def speech_blocks(seconds: float, sample_rate: int = 16000, seed: int = 0,
                  block: int = BLOCK_SAMPLES) -> Iterator[np.ndarray]:
    """Syllable-rate amplitude-modulated harmonic tones with pauses, float32 mono in [-1, 1], in
    blocks of ``block`` samples. The running phase is carried across blocks with the same sequential
    sum as one ``np.cumsum``, and the noise is drawn from one generator in order, so the blocks are
    bit-identical to a single-block run."""
    rng = np.random.default_rng(seed)
    n = max(1, int(round(seconds * sample_rate)))
    u0, u1, u2 = rng.uniform(0, 6), rng.uniform(0, 6), rng.uniform(0, 6)
    carry = 0.0  # sum of f0 over the blocks before, the value np.cumsum would have reached
    for i0 in range(0, n, block):
        t = np.arange(i0, min(n, i0 + block)) / sample_rate
        f0 = 120 + 30 * np.sin(2 * np.pi * 0.3 * t + u0)
        run = np.cumsum(np.concatenate([[carry], f0]))
        carry = float(run[-1])
        phase = 2 * np.pi * run[1:] / sample_rate
        voice = sum(np.sin(k * phase) / k for k in range(1, 6))
        syll = np.clip(np.sin(2 * np.pi * 4.0 * t + u1), 0, None) ** 2
        pauses = (np.sin(2 * np.pi * 0.25 * t + u2) > -0.6).astype(np.float64)
        x = 0.3 * voice * syll * pauses + 0.002 * rng.standard_normal(len(t))
        yield np.clip(x, -1, 1).astype(np.float32)


def speech_like(seconds: float, sample_rate: int = 16000, seed: int = 0) -> np.ndarray:
    """The whole waveform of :func:`speech_blocks` as one array (short inputs, tests)."""
    return np.concatenate(list(speech_blocks(seconds, sample_rate, seed)))


def _pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def write_wav(path: Path, samples: np.ndarray, sample_rate: int = 16000) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(_pcm16(samples))
    return path


def speech_wav(path: Path, seconds: float, seed: int = 0, sample_rate: int = 16000) -> Path:
    """Write :func:`speech_blocks` to ``path`` as 16-bit PCM, one block at a time."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        for block in speech_blocks(seconds, sample_rate, seed):
            w.writeframes(_pcm16(block))
    return path
