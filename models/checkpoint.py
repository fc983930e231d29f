"""Checkpoints: one safetensors file holding every module, keys prefixed by the module's role.

Who calls what: ``build_module`` / ``build_modules`` build a preset's modules with seeded random init
(training starts here, and so does the framework's tiny family, in process and on every rank; the
1.3b / 14b presets stay random); training saves with ``save_checkpoint``; the pipeline's
module loader calls ``load_checkpoint`` with the modules it needs on this process (a subset is fine:
keys of modules not passed are skipped). Every problem raises :class:`CheckpointError` naming the file,
the first few keys involved and the fix; nothing is loaded half-way on error (all checks run first).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from models.audio import AudioEncoder
from models.dit import A2VDiT
from models.presets import ModelPreset
from models.sr import SRDiT
from models.text import TextEncoder
from models.vae import CausalVAE

MODULE_NAMES = ("a2v", "sr", "vae", "audio", "text")
_SHOW = 5  # keys listed per problem kind


class CheckpointError(Exception):
    """A checkpoint cannot be loaded (missing file, bad file, missing/unexpected keys, shape mismatch)."""


def _first(keys: list[str]) -> str:
    more = f" … and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
    return ", ".join(keys[:_SHOW]) + more


def module_factories(preset: ModelPreset) -> dict[str, Callable[[], nn.Module]]:
    """How each module of ``preset`` is made, in ``MODULE_NAMES`` order ("text" only if the preset has one)."""
    makers: dict[str, Callable[[], nn.Module]] = {
        "a2v": lambda: A2VDiT(preset.dit),
        "sr": lambda: SRDiT(preset.sr),
        "vae": lambda: CausalVAE(preset.vae),
        "audio": lambda: AudioEncoder(preset.audio),
    }
    if preset.text is not None:
        text_cfg = preset.text
        makers["text"] = lambda: TextEncoder(text_cfg)
    return makers


def build_module(preset: ModelPreset, name: str, seed: int = 0) -> nn.Module:
    """Seeded random init of module ``name`` of ``preset``: the one weight builder of the reference family.

    The module draws from its own seed (``seed * 16 + MODULE_NAMES.index(name)``), so building one
    module alone (a rank loading only the A2V DiT) gives the weights :func:`build_modules` gives, and
    adding or dropping the text encoder never changes the others. The global RNG state is left as it
    was. Build under ``torch.device("meta")`` (a context manager) to count parameters without
    allocating, under ``torch.device("cuda")`` to initialise on the GPU.
    """
    makers = module_factories(preset)
    if name not in makers:
        raise KeyError(f"preset {preset.name!r} has no module {name!r}; its modules: {list(makers)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 16 + MODULE_NAMES.index(name))
        return makers[name]()


def build_modules(preset: ModelPreset, seed: int = 0) -> dict[str, nn.Module]:
    """Seeded random init of every module of ``preset`` (deterministic for a seed): :func:`build_module`
    of each name. Training starts here; the 1.3b / 14b presets stay random."""
    return {name: build_module(preset, name, seed) for name in module_factories(preset)}


def save_checkpoint(
    modules: dict[str, nn.Module], path: str | os.PathLike[str], metadata: dict[str, str] | None = None
) -> None:
    """Write every module's state into one safetensors file (atomically: temp file, then rename)."""
    tensors: dict[str, Tensor] = {}
    for name, module in modules.items():
        if name not in MODULE_NAMES:
            raise CheckpointError(f"save_checkpoint: module name {name!r} is not one of {MODULE_NAMES}")
        for key, value in module.state_dict().items():
            tensors[f"{name}.{key}"] = value.detach().to("cpu").contiguous()
    meta = {"format": "pt", "longtake.modules": ",".join(modules)}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(f"save_checkpoint: metadata must map str to str, got {k!r}: {v!r}")
        meta[k] = v
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


# Key prefixes of parts a module gained after checkpoints of it were shipped. Each starts as a no-op
# (its output layer is zero), so the trainers warm-start from, and assemble on top of, an older file
# with ``allow_missing=GROWN_PARTS``; inference loads stay strict.
GROWN_PARTS: tuple[str, ...] = ("sr.ref_window.", "sr.ref_window_more.", "vae.decoder.ref_window.", "vae.decoder.ref_gate.")


def load_checkpoint(
    modules: dict[str, nn.Module],
    path: str | os.PathLike[str],
    *,
    key_map: Callable[[str], str] | None = None,
    strict: bool = True,
    preset: str | None = None,
    allow_missing: tuple[str, ...] = (),
    reshaped: list[str] | None = None,
) -> dict[str, str]:
    """Load the modules' weights from ``path``; returns the file's metadata.

    ``key_map`` renames file keys (after renaming they must read ``"<module>.<state_dict key>"``) —
    use it for checkpoints from other codebases. Keys of modules not in ``modules`` are skipped.
    ``strict=False`` tolerates missing and unexpected keys (never shape mismatches).
    ``preset``: the file's metadata must name this preset (checked before any tensor is read, so a
    checkpoint of another preset is named as such instead of failing as a shape mismatch).
    ``allow_missing``: key prefixes (``"sr.ref_window."``) the file may lack while everything else stays
    strict; those parameters keep the module's own values. For warm-starting a module that grew a part
    since the file was written (the part must start as a no-op, as ``SRDiT.ref_window`` does).
    ``reshaped``: a list to collect the keys whose shape differs between file and module; given, such
    keys are not an error and keep the module's own values (warm-starting a preset that changed a size,
    e.g. the latent channels, whose other tensors still fit). Without it a shape mismatch always raises.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint file {str(path)!r} does not exist: pass the path of a .safetensors file written by "
            "models.checkpoint.save_checkpoint (train one, see docs/models.md), or use random weights via "
            "models.checkpoint.build_modules(preset, seed)"
        )
    for name in modules:
        if name not in MODULE_NAMES:
            raise CheckpointError(f"load_checkpoint: module name {name!r} is not one of {MODULE_NAMES}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            if preset is not None and metadata.get("preset") != preset:
                raise CheckpointError(
                    f"checkpoint {str(path)!r} is of preset {metadata.get('preset')!r}, not {preset!r}: pass a "
                    f"checkpoint saved with preset {preset!r} (e.g. models/checkpoints/{preset}.safetensors)"
                )
            # read only the tensors of the modules asked for (a rank loading one module of a 14b file
            # must not materialise the others); other keys are only named
            file_tensors: dict[str, Tensor | None] = {}
            for raw in f.keys():
                key = key_map(raw) if key_map else raw
                file_tensors[key] = f.get_tensor(raw) if key.partition(".")[0] in modules else None
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises several types for a corrupt file
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is not a readable safetensors file ({exc}): "
            "re-download or re-save it"
        ) from exc

    missing: list[str] = []
    unexpected: list[str] = []
    mismatched: list[str] = []
    per_module: dict[str, dict[str, Tensor]] = {name: {} for name in modules}
    expected = {name: m.state_dict() for name, m in modules.items()}
    for key, tensor in file_tensors.items():
        prefix, _, rest = key.partition(".")
        if prefix not in modules:
            if prefix not in MODULE_NAMES:
                unexpected.append(key)
            continue
        target = expected[prefix].get(rest)
        if target is None or tensor is None:
            unexpected.append(key)
        elif tuple(target.shape) != tuple(tensor.shape):
            if reshaped is not None:
                reshaped.append(key)
                continue
            mismatched.append(f"{key} (file {tuple(tensor.shape)}, model {tuple(target.shape)})")
        else:
            per_module[prefix][rest] = tensor
    for name, sd in expected.items():
        missing.extend(f"{name}.{k}" for k in sd if k not in per_module[name]
                       and f"{name}.{k}" not in (reshaped or ()))
    missing = [k for k in missing if not k.startswith(allow_missing)]

    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es): {_first(mismatched)}")
    if strict and missing:
        problems.append(f"{len(missing)} missing key(s): {_first(sorted(missing))}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s): {_first(sorted(unexpected))}")
    if problems:
        preset = metadata.get("preset", "unknown")
        raise CheckpointError(
            f"checkpoint {str(path)!r} (preset {preset}) does not fit the modules {sorted(modules)}: "
            + "; ".join(problems)
            + ". Fix: build the modules from the preset the checkpoint was saved with, pass key_map= to rename "
            "keys from another codebase, or strict=False to accept missing/unexpected keys"
        )
    with torch.no_grad():
        for name, module in modules.items():
            module.load_state_dict(per_module[name], strict=False)
    return metadata
