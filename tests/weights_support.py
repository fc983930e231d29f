"""Test support shared by unit and integration tests: a checkpoint a deploy could ship."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np


def other_weights(checkpoint: Path, dest: Path) -> Path:
    """``checkpoint`` with one A2V weight scaled by 1.05 in place: the header (names, dtypes, shapes,
    offsets, metadata) byte for byte the same, other weights — a retrained checkpoint a deploy ships."""
    data = bytearray(checkpoint.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k, v in header.items()
                if k.startswith("a2v.") and v["dtype"] == "F32" and len(v["shape"]) == 2)
    start, end = header[name]["data_offsets"]
    span = slice(8 + n + start, 8 + n + end)
    data[span] = (np.frombuffer(bytes(data[span]), dtype="<f4") * 1.05).astype("<f4").tobytes()
    dest.write_bytes(bytes(data))
    return dest
