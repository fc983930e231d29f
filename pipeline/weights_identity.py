"""A cheap identity of a checkpoint: which weights a render computes with, without hashing them.

Who calls this: :class:`~pipeline.family_runtime.FamilyRuntime` once when it is built (a warm
runtime: just before its modules load) and a NodeEngine rank's loaders once per module they load
(``pipeline.placement.loaders``). ``render()`` puts the result in the resume key of every rolling-state
snapshot (``pipeline.state``), so a retry after a deploy that shipped other weights does not continue
the old model's latents with the new model.

What is read: a checkpoint is a file (the tiny family's ``.safetensors``) or a release directory (the
wan family's downloads, every file under it except hidden ones, by relative path). Per file: its
size; a ``.safetensors`` file's header (tensor names, dtypes, shapes, offsets and metadata) and the
first :data:`SAMPLE_BYTES` of every tensor's data; any other file whole when it is at most
:data:`WHOLE_BYTES` (configs, tokenizers), else :data:`NUM_BLOCKS` blocks of :data:`BLOCK_BYTES`
spread evenly over it (``.pth`` / ``.bin`` weights). Retrained or fine-tuned weights change every
element of the tensors they touch, so their first bytes change; the cost is one small read per tensor
(the tiny checkpoint's 375: 1 ms), independent of the weights' size — a 14B release has a few
thousand tensors, not 30 GB to hash. Measured on a sparse replica of a Wan 14B release directory (7
DiT shards with 1 400 tensors, the umT5 / CLIP / VAE ``.pth`` files, a tokenizer; 44 GB apparent):
9-14 ms from the page cache. From a cold disk it is ~1 500 small random reads (not measured; at
0.1-1 ms a read, 0.15-1.5 s once per node, then cached for the other ranks' and modules' calls).

Content, not path or mtime: the same release copied to another node (or downloaded there again) has
the same identity, so a job retried on another worker still resumes; a file replaced in place with
other weights does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Protocol

RANDOM_INIT = "random-init"
SAMPLE_BYTES = 64  # per safetensors tensor
WHOLE_BYTES = 1 << 20  # other files up to this size are hashed whole
BLOCK_BYTES = 4096
NUM_BLOCKS = 32
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one


class _Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...


def weights_identity(checkpoint: Path | None) -> str:
    """16 hex digits naming the weights under ``checkpoint`` (a file or a directory); ``"random-init"``
    for None. A path that does not exist gets ``"missing:<path>"`` (loading it fails with its own
    error). Same content, same identity, wherever it lies."""
    if checkpoint is None:
        return RANDOM_INIT
    path = Path(checkpoint)
    digest = hashlib.sha256()
    if path.is_file():
        _file(digest, path)
    elif path.is_dir():
        for rel, file in _files(path):
            digest.update(rel.encode() + b"\0")
            _file(digest, file)
    else:
        return f"missing:{path}"
    return digest.hexdigest()[:16]


def _files(root: Path) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for top, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # .cache/ of huggingface-cli downloads
        for name in names:
            if not name.startswith("."):
                file = Path(top) / name
                out.append((file.relative_to(root).as_posix(), file))
    return sorted(out)


def _file(digest: _Digest, path: Path) -> None:
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        digest.update(struct.pack("<Q", size))
        if path.suffix == ".safetensors" and _safetensors(digest, fd, size):
            return
        if size <= WHOLE_BYTES:
            digest.update(os.pread(fd, size, 0))
            return
        step = (size - BLOCK_BYTES) / (NUM_BLOCKS - 1)
        for i in range(NUM_BLOCKS):
            digest.update(os.pread(fd, BLOCK_BYTES, round(i * step)))


def _safetensors(digest: _Digest, fd: int, size: int) -> bool:
    """Header + the first bytes of every tensor; False when the file is not a safetensors file."""
    if size < 8:
        return False
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > min(size - 8, _MAX_HEADER):
        return False
    header = os.pread(fd, n, 8)
    try:
        tensors = json.loads(header)
        offsets = sorted(int(v["data_offsets"][0]) for k, v in tensors.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError):
        return False
    digest.update(header)
    base = 8 + n
    for start in offsets:
        digest.update(os.pread(fd, SAMPLE_BYTES, base + start))
    return True
