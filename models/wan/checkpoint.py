"""Strict, shard-by-shard loading of public checkpoints into modules built on the meta device.

Who calls what: the release loaders in :mod:`models.wan.release` list a release's tensors with
:func:`safetensors_entries` (a sharded ``*.safetensors.index.json`` folder, or single files) or
:func:`state_dict_entries` (a ``.pth`` already read with ``mmap=True``), optionally rename them, and call
:func:`fill_module`. Every check (files present and complete, index consistent with the shards, no
missing / unexpected keys, shapes, floating dtypes) runs on headers only, before any tensor is read;
on any problem :class:`WanCheckpointError` names the file, the keys and the fix, and the caller gets no
module. Tensors are then read one at a time and copied into parameters allocated once at the target
dtype, so peak host memory is the module's size plus one tensor (see docs/wan.md for the measurement).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

_SHOW = 5
_ST_DTYPES = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class WanCheckpointError(Exception):
    """A release directory or checkpoint file cannot be loaded; the message says what and how to fix it."""


def _first(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    more = f" … and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
    return ", ".join(keys[:_SHOW]) + more


@dataclass(frozen=True)
class Entry:
    """One stored tensor: where it lives, its header shape/dtype, and how to read it."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], Tensor]


def _safetensors_header(path: Path) -> dict[str, dict[str, object]]:
    """Parse a safetensors header and check the file holds every byte the header promises."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size:
                raise ValueError("header length beyond end of file")
            header: dict[str, dict[str, object]] = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error) as exc:
        raise WanCheckpointError(
            f"{path}: not a readable safetensors file ({exc}); download it again"
        ) from exc
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)  # type: ignore[index]
    if 8 + n + end > size:
        raise WanCheckpointError(
            f"{path}: truncated ({size} bytes, the header needs {8 + n + end}); the download is incomplete — "
            "download this file again"
        )
    return header


def safetensors_entries(files: Iterable[Path]) -> dict[str, Entry]:
    """Entries of single safetensors files (later files override earlier ones: an overlay such as
    InfiniteTalk's weights applied on top of the base model)."""
    out: dict[str, Entry] = {}
    for path in files:
        if not path.is_file():
            raise WanCheckpointError(f"{path}: file not found; download it (see docs/wan.md for the layout)")
        for key, info in _safetensors_header(path).items():
            dtype = _ST_DTYPES.get(str(info["dtype"]))
            if dtype is None:
                raise WanCheckpointError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
            shape = tuple(int(s) for s in info["shape"])  # type: ignore[attr-defined]
            out[key] = Entry(path, shape, dtype, _reader(path, key))
    return out


def sharded_entries(folder: Path, stem: str) -> dict[str, Entry]:
    """Entries of ``{stem}.safetensors.index.json`` + its shards, or of a single ``{stem}.safetensors``.

    The index's ``weight_map`` must agree with the shards: every shard present and complete, every key
    in the shard the index names."""
    index = folder / f"{stem}.safetensors.index.json"
    single = folder / f"{stem}.safetensors"
    if not index.is_file():
        if single.is_file():
            return safetensors_entries([single])
        shards = sorted(folder.glob(f"{stem}-*-of-*.safetensors"))
        hint = f" ({len(shards)} shard files are there, so the index was lost)" if shards else ""
        raise WanCheckpointError(
            f"{folder}: neither {index.name} nor {single.name} found{hint}; expected the release layout "
            f"'{stem}-0000N-of-0000M.safetensors' + '{index.name}' — download the whole folder again"
        )
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as exc:
        raise WanCheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({exc})") from exc
    files = sorted({folder / name for name in weight_map.values()})
    missing_files = [str(f.name) for f in files if not f.is_file()]
    if missing_files:
        raise WanCheckpointError(
            f"{folder}: shards named in {index.name} are missing: {_first(missing_files)}"
        )
    entries = safetensors_entries(files)
    wrong = [k for k, name in weight_map.items() if k not in entries or entries[k].file.name != name]
    if wrong:
        raise WanCheckpointError(
            f"{index}: {len(wrong)} keys are not in the shard the index names: {_first(wrong)}; "
            "the index and the shards come from different downloads — download the folder again"
        )
    extra = set(entries) - set(weight_map)
    if extra:
        raise WanCheckpointError(f"{folder}: shards hold keys the index does not list: {_first(extra)}")
    return entries


def _reader(path: Path, key: str) -> Callable[[], Tensor]:
    def read() -> Tensor:
        with safe_open(str(path), framework="pt") as fh:  # mmap; reads only this tensor
            return fh.get_tensor(key)

    return read


def state_dict_entries(state: Mapping[str, Tensor], path: Path) -> dict[str, Entry]:
    """Entries of a ``.pth`` state dict loaded with ``torch.load(..., mmap=True, weights_only=True)``."""
    return {k: Entry(path, tuple(v.shape), v.dtype, constant(v)) for k, v in state.items()}


def constant(tensor: Tensor) -> Callable[[], Tensor]:
    """A reader for a tensor already at hand (mmap'd ``.pth`` entries, derived tensors)."""

    def read() -> Tensor:
        return tensor

    return read


def read_pth(path: Path, release_file: str) -> tuple[Path, dict[str, Tensor]]:
    """Open a Wan ``.pth`` state dict memory-mapped (``path`` may be the release folder); clear errors
    for a missing file, an unreadable one, or one that holds no state dict."""
    path = Path(path)
    if path.is_dir():
        path = path / release_file
    if not path.is_file():
        raise WanCheckpointError(f"{path}: not found; the Wan2.1-I2V-14B-480P folder ships {release_file}")
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises several types for a bad zip / pickle
        raise WanCheckpointError(
            f"{path}: not a readable torch checkpoint ({exc}); download it again"
        ) from exc
    if not isinstance(state, dict):
        raise WanCheckpointError(
            f"{path}: holds a {type(state).__name__}, expected a state dict ({release_file})"
        )
    return path, state


def fill_module(
    module: nn.Module,
    entries: Mapping[str, Entry],
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    what: str,
    keep_fp32: Callable[[str], bool] = lambda name: False,
) -> nn.Module:
    """Check ``entries`` against ``module`` (built on the meta device) and fill it; returns the module.

    ``what`` names the layout in errors (e.g. "Wan2.1-I2V-14B-480P DiT + InfiniteTalk audio layers").
    Parameters for which ``keep_fp32(name)`` is true stay float32 whatever ``dtype`` is.
    """
    if dtype not in FLOAT_DTYPES:
        raise WanCheckpointError(f"dtype={dtype}: load in one of bfloat16, float16, float32")
    expected = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    shapes = {k: tuple(v.shape) for k, v in expected.items()}
    files = sorted({str(e.file) for e in entries.values()})
    where = f"{what} ({', '.join(files[:3])}{' …' if len(files) > 3 else ''})"
    missing = set(shapes) - set(entries)
    if missing:
        raise WanCheckpointError(
            f"{where}: {len(missing)} keys missing: {_first(missing)}; the files are not the {what} layout "
            "or a file is missing (a partial download, or the wrong folder passed)"
        )
    unexpected = set(entries) - set(shapes)
    if unexpected:
        files_u = sorted({entries[k].file.name for k in unexpected})
        raise WanCheckpointError(
            f"{where}: {len(unexpected)} unexpected keys in {', '.join(files_u)}: {_first(unexpected)}; "
            f"these files are not (only) the {what} layout — pass the folder of that release"
        )
    bad_shape = [
        f"{k} {entries[k].shape} in {entries[k].file.name} vs model {shapes[k]}"
        for k in sorted(shapes)
        if entries[k].shape != shapes[k]
    ]
    if bad_shape:
        raise WanCheckpointError(
            f"{where}: {len(bad_shape)} tensors have the wrong shape: {'; '.join(bad_shape[:_SHOW])}; "
            "the checkpoint is another model size than the config says — check config.json / the preset"
        )
    bad_dtype = [
        f"{k} ({entries[k].dtype} in {entries[k].file.name})"
        for k in sorted(shapes)
        if entries[k].dtype not in FLOAT_DTYPES and expected[k].is_floating_point()
    ]
    if bad_dtype:
        raise WanCheckpointError(
            f"{where}: tensors stored in a dtype this loader does not convert: {_first(bad_dtype)}; "
            "expected float32/bfloat16/float16 (quantised releases are not supported)"
        )
    module.to_empty(device=device)
    expected = {**dict(module.named_parameters()), **dict(module.named_buffers())}  # to_empty made new ones
    with torch.no_grad():
        for name, tensor in expected.items():
            target = torch.float32 if keep_fp32(name) else dtype
            if tensor.is_floating_point() and tensor.dtype != target:
                tensor.data = torch.empty(tensor.shape, dtype=target, device=device)
        # Shard order, one tensor at a time: peak = the module + one tensor.
        for k in sorted(shapes, key=lambda k: (str(entries[k].file), k)):
            expected[k].data.copy_(entries[k].read())
    return module
