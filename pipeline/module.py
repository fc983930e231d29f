"""Module: one model and its checkpoint, built and loaded lazily.

A :class:`Module` is what stages hold instead of a bare ``nn.Module``: it knows how to build the
model (a factory from the preset), where its weights come from (a safetensors file and a key prefix,
or a seeded random init) and, once loaded, where it lives (resident on the compute device, parked in
host memory, sharded across ranks — see ``pipeline/placement``). Stages call :meth:`get` on their
first use, so a pipeline that never runs a stage never pays for its model.

A model already built and placed elsewhere (a NodeEngine rank's sharded DiT) is wrapped with
:meth:`Module.from_loaded`; its ``on_use`` callback runs at every :meth:`get`, i.e. when a stage is
about to run the model, which is where a rank's parker brings the model back just in time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from pipeline.errors import ModuleLoadError

log = logging.getLogger(__name__)


class Residency(StrEnum):
    UNLOADED = "unloaded"
    RESIDENT = "resident"
    PARKED = "parked"
    SHARDED = "sharded"


class Module:
    """A lazily built model plus the source of its weights.

    ``build`` returns the ``nn.Module`` in its random-init state (seeded by the caller);
    ``checkpoint``/``prefix`` name the safetensors file and the key prefix of this module's tensors
    in it (``"a2v."`` …). With no checkpoint the seeded random init is kept and
    :attr:`is_random_init` says so, so the CLI can warn the user. ``prefix=None``: ``build`` itself
    loads the weights from ``checkpoint`` (a release directory in a layout of its own). ``dtype``:
    the parameters' dtype after loading; ``None`` keeps the builder's (mixed-precision models).
    """

    def __init__(
        self,
        name: str,
        build: Callable[[], nn.Module],
        *,
        checkpoint: Path | None = None,
        prefix: str | None = "",
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = torch.float32,
        on_use: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._build = build
        self.checkpoint = checkpoint
        self.prefix = prefix
        self.device = torch.device(device)
        self.dtype = dtype
        self._model: nn.Module | None = None
        self._lock = threading.Lock()
        self.residency = Residency.UNLOADED
        self.load_s = 0.0
        self.on_use = on_use  # called by get() each time a stage takes the model

    @classmethod
    def from_loaded(
        cls,
        name: str,
        model: nn.Module,
        *,
        checkpoint: Path | None = None,
        residency: Residency | None = None,
        on_use: Callable[[], None] | None = None,
    ) -> Module:
        """Wrap a model the caller already built, loaded and placed (e.g. FSDP2-sharded on a rank).

        ``checkpoint`` only records where its weights came from (``None``: random init).
        ``residency`` defaults to SHARDED when the model carries DTensor parameters, else RESIDENT.
        The caller owns the model's placement; this Module never rebuilds or moves it.
        """

        def build() -> nn.Module:
            raise ModuleLoadError(f"module {name!r} was loaded by its owner and cannot be rebuilt here")

        module = cls(name, build, checkpoint=checkpoint, prefix=f"{name}.", on_use=on_use)
        first = next(iter(model.parameters()), None)
        module.device = first.device if first is not None else torch.device("cpu")
        module.dtype = first.dtype if first is not None else torch.float32
        if residency is None:
            sharded = any(isinstance(p, DTensor) for p in model.parameters())
            residency = Residency.SHARDED if sharded else Residency.RESIDENT
        module.residency = residency
        module._model = model
        return module

    @property
    def is_loaded(self) -> bool:
        return self._model is not None

    @property
    def is_random_init(self) -> bool:
        return self.checkpoint is None

    def get(self) -> nn.Module:
        """The loaded model (built and loaded on first call; thread-safe), after ``on_use()``."""
        model = self._loaded()
        if self.residency is Residency.PARKED:
            with self._lock:
                model.to(self.device)
                self.residency = Residency.RESIDENT
        if self.on_use is not None:
            self.on_use()
        return model

    def _loaded(self) -> nn.Module:
        if self._model is None:
            with self._lock:
                if self._model is None:
                    self._model = self._load()
        return self._model

    def park(self) -> None:
        """Move a model that has done its work for this job (a once-per-job encoder) to host memory;
        the next :meth:`get` brings it back to :attr:`device`. No-op for unloaded or sharded models
        (a rank's parker owns those) and when the device is the CPU."""
        if self._model is None or self.residency is not Residency.RESIDENT or self.device.type == "cpu":
            return
        with self._lock:
            self._model.to("cpu")
            self.residency = Residency.PARKED

    def blocks(self) -> list[nn.Module]:
        """The model's repeated blocks (``model.blocks``) for per-block placement; [] if none."""
        blocks = getattr(self._loaded(), "blocks", None)
        return list(blocks) if isinstance(blocks, nn.ModuleList) else []

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self._loaded().parameters())

    def _load(self) -> nn.Module:
        t0 = time.perf_counter()
        try:
            model = self._build()
        except Exception as exc:  # a preset/config bug: name the module
            raise ModuleLoadError(f"module {self.name!r}: building the model failed: {exc}") from exc
        if self.checkpoint is not None and self.prefix is not None:
            load_module_weights(model, self.checkpoint, self.prefix, module_name=self.name)
        if self.dtype is None:
            model.to(device=self.device)
        else:
            model.to(device=self.device, dtype=self.dtype)
        model.eval()
        model.requires_grad_(False)
        self.residency = Residency.RESIDENT
        self.load_s = time.perf_counter() - t0
        log.info("loaded module %s (%s) in %.2fs", self.name,
                 "random init" if self.checkpoint is None else self.checkpoint, self.load_s)
        return model


def load_module_weights(model: nn.Module, path: Path, prefix: str, *, module_name: str) -> None:
    """Load the tensors under ``prefix`` of a safetensors file into ``model``, strictly.

    Raises :class:`ModuleLoadError` naming the file, the module and the offending keys when the file
    is missing or unreadable, keys are missing or unexpected, or shapes differ.
    """
    path = Path(path)
    if not path.is_file():
        raise ModuleLoadError(
            f"module {module_name!r}: checkpoint {path} does not exist; pass an existing .safetensors "
            "file or omit --checkpoint to use the preset's default"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = [k for k in f.keys() if k.startswith(prefix)]
            tensors = {k[len(prefix):]: f.get_tensor(k) for k in keys}
    except Exception as exc:
        raise ModuleLoadError(
            f"module {module_name!r}: cannot read checkpoint {path}: {exc}; is it a safetensors file?"
        ) from exc
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    mismatched = [
        f"{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in tensors and tuple(tensors[k].shape) != tuple(v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys (e.g. {', '.join(prefix + k for k in missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys (e.g. {', '.join(prefix + k for k in unexpected[:3])})")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches (e.g. {'; '.join(mismatched[:3])})")
    if problems:
        raise ModuleLoadError(
            f"module {module_name!r}: checkpoint {path} does not fit the model: {'; '.join(problems)}. "
            "Check that the checkpoint was trained for this preset (--preset) and prefix "
            f"{prefix!r}."
        )
    model.load_state_dict(tensors, strict=True)
