"""Helpers shared by the stages: per-step seeds, the known positions of a window, model-time accounting."""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pipeline.schedule import ChunkStep


def step_seed(seed: int, step: ChunkStep) -> int:
    """A 63-bit seed for one step, a pure function of the job seed and the step's identity.

    Resume relies on it: a retried job regenerates exactly the noise of the uninterrupted run.
    """
    digest = hashlib.sha256(f"longtake:{seed}:{step.kind.value}:{step.index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def step_generator(seed: int, step: ChunkStep) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(step_seed(seed, step))


def known_positions(step: ChunkStep, device: torch.device) -> torch.Tensor:
    """The window positions of the step's known frames, in window order (``ChunkStep.known_mask``'s
    True entries), as indices on ``device``: indexing with them, unlike with a boolean mask, needs no
    device-to-host sync."""
    return torch.tensor([i for i, known in enumerate(step.known_mask()) if known], dtype=torch.long, device=device)


class Timings:
    """Wall time per stage and time inside model forwards, accumulated over a render."""

    def __init__(self) -> None:
        self.stage_s: dict[str, float] = defaultdict(float)
        self.model_s: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        self.stage_s.clear()
        self.model_s.clear()

    @contextmanager
    def model(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.model_s[name] += time.perf_counter() - t0

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stage_s[name] += time.perf_counter() - t0
