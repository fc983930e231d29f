"""Small real and broken media files for the API tests (built in memory, a few kB each).

Used by ``test_api.py`` (valid uploads) and ``test_api_security.py`` (each way the submit-time probe
must refuse a file: not an image, truncated, too small, too large, CMYK, 16-bit, empty or corrupt
audio, an image sent as audio and the other way round).
"""

from __future__ import annotations

import io
import struct
import wave
import zlib

import numpy as np
from PIL import Image


def png(width: int = 96, height: int = 80, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(width * height)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    im = Image.fromarray(pixels).convert(mode)
    out = io.BytesIO()
    im.save(out, "PNG")
    return out.getvalue()


def huge_png_header(side: int = 20000) -> bytes:
    """A PNG whose header says ``side`` x ``side`` (no pixel data: refused from the header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def cmyk_jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("CMYK", (96, 96), (10, 20, 30, 0)).save(out, "JPEG")
    return out.getvalue()


def png16() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((96, 96), 40000, dtype=np.uint16)).save(out, "PNG")
    return out.getvalue()


def wav(seconds: float = 0.5, rate: int = 8000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(rate)
        w.writeframes(bytes([128, 140, 128, 116]) * int(seconds * rate / 4))
    return out.getvalue()


def corrupt_wav() -> bytes:
    return b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00" + b"\xff" * 40


def truncated_png() -> bytes:
    return png(200, 200)[:3000]
