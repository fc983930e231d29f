"""Regenerate the demo inputs: ``reference.png`` (a drawn cartoon face) and ``speech.wav`` (espeak-ng).

Run from anywhere: ``python assets/demo/make_demo_inputs.py``. Both outputs are deterministic: the
face is drawn with fixed coordinates, and espeak-ng's synthesis has no randomness (same espeak-ng
version -> same samples). ``speech.wav`` is 16 kHz mono 16-bit PCM.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import wave
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
SIZE = 256
SPEECH_TEXT = (
    "Hello, and welcome to long take. This voice drives the face you are watching. "
    "The video is rendered in chunks and streamed as soon as each one is ready."
)
# espeak-ng: US English, 150 words per minute; it writes 22.05 kHz, ffmpeg resamples to 16 kHz.
ESPEAK_CMD = ["espeak-ng", "-v", "en-us", "-s", "150", "-w"]
FFMPEG_CMD = ["ffmpeg", "-v", "error", "-y", "-i"]
FFMPEG_OUT = ["-ac", "1", "-ar", "16000", "-c:a", "pcm_s16le", "-map_metadata", "-1", "-fflags", "+bitexact"]


def draw_face(size: int = SIZE) -> Image.Image:
    """A front-facing cartoon head on a plain background, scaled to ``size``."""
    s = size / 256
    im = Image.new("RGB", (size, size), (196, 214, 228))
    d = ImageDraw.Draw(im)

    def box(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float, float, float]:
        return (x0 * s, y0 * s, x1 * s, y1 * s)

    d.rectangle(box(104, 196, 152, 240), fill=(232, 190, 160))  # neck
    d.pieslice(box(40, 220, 216, 330), 180, 360, fill=(70, 96, 150))  # shoulders
    d.ellipse(box(60, 40, 196, 150), fill=(92, 58, 36))  # hair (behind the face)
    d.ellipse(box(70, 60, 186, 216), fill=(240, 200, 170))  # face
    d.ellipse(box(62, 118, 80, 150), fill=(232, 190, 160))  # ears
    d.ellipse(box(176, 118, 194, 150), fill=(232, 190, 160))
    d.chord(box(66, 44, 190, 120), 180, 360, fill=(92, 58, 36))  # fringe
    for cx in (104, 152):
        d.ellipse(box(cx - 14, 118, cx + 14, 136), fill=(255, 255, 255))  # eye whites
        d.ellipse(box(cx - 6, 121, cx + 6, 133), fill=(60, 40, 30))  # iris
        d.ellipse(box(cx - 2, 124, cx + 2, 128), fill=(255, 255, 255))  # highlight
        d.line(
            [(cx - 16 * s, 108 * s), (cx + 14 * s, 104 * s)], fill=(80, 50, 30), width=max(1, round(4 * s))
        )
    d.polygon([(128 * s, 136 * s), (120 * s, 164 * s), (134 * s, 164 * s)], fill=(220, 170, 140))  # nose
    d.chord(box(106, 172, 150, 196), 0, 180, fill=(170, 60, 70))  # mouth
    d.line([(108 * s, 180 * s), (148 * s, 180 * s)], fill=(120, 40, 50), width=max(1, round(2 * s)))
    return im


def make_speech(out: Path, text: str = SPEECH_TEXT) -> None:
    for tool in ("espeak-ng", "ffmpeg"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed; install it (apt-get install {tool}) and rerun")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "espeak.wav"
        subprocess.run([*ESPEAK_CMD, str(raw), text], check=True)
        subprocess.run([*FFMPEG_CMD, str(raw), *FFMPEG_OUT, str(out)], check=True)
    with wave.open(str(out)) as w:
        print(
            f"{out}: {w.getnframes() / w.getframerate():.2f} s, {w.getframerate()} Hz, {w.getnchannels()} ch"
        )


def main() -> int:
    draw_face().save(HERE / "reference.png", optimize=True)
    print(f"{HERE / 'reference.png'}: {SIZE}x{SIZE}")
    make_speech(HERE / "speech.wav")
    return 0


if __name__ == "__main__":
    sys.exit(main())
