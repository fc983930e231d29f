"""Shared training plumbing: resumable state files, per-step seeded generators, time budgets, loss logs.

Who calls what: every ``train_*`` script builds its modules and optimiser, calls :func:`load_state`
(resume) once, then per step draws its randomness from :func:`step_generator` (so a resumed run sees
exactly the batches an uninterrupted one would), and calls :func:`save_state` every few minutes and at
the end. Nothing here keeps tensors between calls.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from models.checkpoint import GROWN_PARTS, load_checkpoint

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_CACHE = REPO_ROOT / ".cache" / "training"


def setup_logging(log_file: Path | None = None) -> None:
    """Log to stderr and (optionally) append to ``log_file``; safe to call twice."""
    root = logging.getLogger()
    if getattr(root, "_longtake_training", False):
        return
    fmt = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(logging.INFO)
    root._longtake_training = True  # type: ignore[attr-defined]


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """The RNG of one training step: a pure function of (seed, step, stream), so resume is exact."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 7 + stream)


def on_device(batch: dict[str, torch.Tensor | None], device: torch.device) -> dict[str, torch.Tensor | None]:
    """A training batch moved to the model's device. Batches are drawn on the CPU from the step's
    generator (:func:`step_generator`), so a run draws the same samples on any device; on the CPU this
    is a no-op."""
    return {k: None if v is None else v.to(device, non_blocking=True) for k, v in batch.items()}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10, check=False)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def checkpoint_label(path: Path, meta: dict[str, str], *more: str) -> str:
    """How a checkpoint another one was made from is named in metadata: its file name, the commit it
    was assembled at (its ``git_commit``), the first 12 hex digits of its SHA-256 (what ``sha256sum``
    prints, so a file found in git history can be checked by hand), then ``more``. The commit alone
    does not name the file: a checkpoint is assembled before it is committed, so at that commit the
    same path may hold its predecessor (the ninth, assembled at git 82ac639, is the eighth there)."""
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    parts = [f"git {meta.get('git_commit', '?')}", f"sha256 {digest[:12]}", *more]
    return f"{path.name} ({', '.join(parts)})"


@dataclass
class TrainState:
    """What a resumable run keeps on disk: step, wall time spent, recent losses, free-form extras."""

    step: int = 0
    elapsed_s: float = 0.0
    losses: list[float] = field(default_factory=list)  # running mean of each logging interval
    extra: dict[str, float] = field(default_factory=dict)
    init_from: str = ""  # the checkpoint a warm-started run began from (warm_start), "" from scratch


def save_state(path: Path, modules: dict[str, nn.Module], opt: torch.optim.Optimizer, state: TrainState) -> None:
    """Atomically write modules, optimiser and progress to ``path`` (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"modules": {k: m.state_dict() for k, m in modules.items()}, "opt": opt.state_dict(),
                "state": state.__dict__}, tmp)
    os.replace(tmp, path)


def load_state(path: Path, modules: dict[str, nn.Module], opt: torch.optim.Optimizer | None = None) -> TrainState:
    """Resume from ``path`` if it exists (else a fresh ``TrainState``). ``opt=None`` loads weights only."""
    if not path.is_file():
        return TrainState()
    blob = torch.load(path, map_location="cpu", weights_only=False)
    missing = set(modules) - set(blob["modules"])
    if missing:
        raise ValueError(f"training state {path} lacks modules {sorted(missing)}: delete it to start over "
                         "or pass the state file of the right trainer")
    for k, m in modules.items():
        m.load_state_dict(blob["modules"][k])
    if opt is not None:
        opt.load_state_dict(blob["opt"])
    st = TrainState(**blob["state"])
    log.info("resumed %s at step %d (%.0f s trained)", path, st.step, st.elapsed_s)
    return st


def warm_start(modules: dict[str, nn.Module], checkpoint: Path, preset: str, state: TrainState, *,
               reinit_reshaped: bool = False) -> bool:
    """Start a fresh run from a shipped checkpoint's weights instead of the seeded init.

    ``modules`` maps checkpoint module names (``a2v``, ``audio``, ``sr``) to the modules to fill; the
    checkpoint must be of ``preset``. Records where the run began in ``state.init_from`` (carried into
    the assembled checkpoint's metadata). Returns whether it loaded weights (False: ``state`` is a
    resumed run that began from this checkpoint, its own weights stand). Raises on a resumed state
    that began elsewhere: resuming is never silently re-initialised. Parts a module gained after the
    file was written (``models.checkpoint.GROWN_PARTS``) keep their no-op init. ``reinit_reshaped``:
    tensors whose shape differs from the file's (the preset changed a size since, e.g. its latent
    channels: the patch embeddings and the output head) keep the seeded init, the rest load; their
    names go into ``state.init_from``. Without it a shape mismatch raises."""
    if state.step > 0:
        if not state.init_from.startswith(f"{checkpoint.name} "):
            raise ValueError(f"--from {checkpoint}: the training state to resume (step {state.step}) began from "
                             f"{state.init_from or 'the seeded init'}; drop --from to resume it, or delete the "
                             "state file to start over from the checkpoint")
        return False
    reshaped: list[str] | None = [] if reinit_reshaped else None
    meta = load_checkpoint(modules, checkpoint, preset=preset, allow_missing=GROWN_PARTS, reshaped=reshaped)
    steps = ", ".join(f"{m}_steps {meta[f'{m}_steps']}" for m in modules if f"{m}_steps" in meta)
    state.init_from = checkpoint_label(checkpoint, meta, *([steps] if steps else []))
    if reshaped:
        state.init_from += f"; seeded init kept for {len(reshaped)} reshaped tensors: {', '.join(reshaped)}"
    log.info("warm start from %s: %s", checkpoint, state.init_from)
    return True


class LossLog:
    """Appends one JSON line per logging interval (step, wall seconds, mean losses) to a file."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = path, name
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
            self.counts[k] = self.counts.get(k, 0) + 1

    def flush(self, step: int, elapsed_s: float) -> dict[str, float]:
        """Mean of each key over the steps that reported it since the last flush."""
        means = {k: v / self.counts[k] for k, v in self.sums.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"trainer": self.name, "step": step, "elapsed_s": round(elapsed_s, 1), **means}) + "\n")
        log.info("%s step %d (%.0f s): %s", self.name, step, elapsed_s,
                 " ".join(f"{k}={v:.5f}" for k, v in means.items()))
        self.sums, self.counts = {}, {}
        return means


class Budget:
    """Wall-clock budget of a run, counting time already spent before a resume."""

    def __init__(self, minutes: float, already_s: float = 0.0) -> None:
        self.total_s = minutes * 60.0
        self.start = time.monotonic() - already_s

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    @property
    def fraction(self) -> float:
        return min(1.0, self.elapsed_s / max(self.total_s, 1e-9))

    def done(self) -> bool:
        return self.elapsed_s >= self.total_s


def cosine_lr(base: float, fraction: float, warmup: float = 0.03, floor: float = 0.05) -> float:
    """Learning rate at ``fraction`` of the budget: linear warm-up, then cosine down to ``floor * base``."""
    import math

    if fraction < warmup:
        return base * max(fraction / warmup, 0.05)
    p = (fraction - warmup) / (1 - warmup)
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))
