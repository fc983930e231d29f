from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.inputs import speech_wav


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    # Two cores shared by the whole suite: deterministic, contention-free math.
    torch.set_num_threads(1)


@pytest.fixture
def speech(tmp_path: Path):  # type: ignore[no-untyped-def]
    def make(seconds: float, seed: int = 0) -> Path:
        return speech_wav(tmp_path / f"speech_{seconds}_{seed}.wav", seconds, seed=seed)

    return make
