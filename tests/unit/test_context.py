"""The context stage's loudness normalisation equals the training-time one, in constant memory."""

from __future__ import annotations

import numpy as np

from models.avatars.speech import normalize_loudness
from pipeline.families.tiny.stages.context import loudness_gain


class ArrayAudio:
    def __init__(self, x: np.ndarray, rate: int) -> None:
        self.x, self.rate = x, rate

    def num_samples(self, rate: int) -> int:
        return self.x.size

    def read(self, start: int, stop: int, rate: int) -> np.ndarray:
        return self.x[start:stop]


def test_streaming_gain_matches_training_normalisation() -> None:
    rng = np.random.default_rng(0)
    x = (0.02 * rng.standard_normal(16000 * 7) * (np.arange(16000 * 7) % 8000 < 5000)).astype(np.float32)
    gain = loudness_gain(ArrayAudio(x, 16000), 16000)
    expected = normalize_loudness(x)
    np.testing.assert_allclose(np.clip(x * gain, -1, 1), expected, rtol=1e-5, atol=1e-6)


def test_silence_gets_unit_gain() -> None:
    assert loudness_gain(ArrayAudio(np.zeros(16000, np.float32), 16000), 16000) == 1.0
    assert loudness_gain(ArrayAudio(np.zeros(10, np.float32), 16000), 16000) == 1.0
