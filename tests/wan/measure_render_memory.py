"""Peak RSS of one ``wan`` render in this (fresh) process: ``python tests/wan/measure_render_memory.py
WEIGHTS SECONDS`` renders SECONDS of speech on the tiny release at WEIGHTS (streaming, into a file)
and prints one JSON line. Run by tests/wan/test_wan_memory.py; nothing about the allocator or the
thread count is changed here."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench.inputs import DEMO_IMAGE, speech_wav
from pipeline.host import peak_rss_bytes
from pipeline.render import RenderRequest, render
from pipeline.sinks import FileSink


def main() -> None:
    weights, seconds = Path(sys.argv[1]), float(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "streaming"
    with tempfile.TemporaryDirectory() as tmp:
        audio = speech_wav(Path(tmp) / "speech.wav", seconds)
        request = RenderRequest(image=DEMO_IMAGE, audio=audio, text="w1 w2", family="wan", preset="tiny",
                                checkpoint=weights)
        result = render(request, [FileSink(Path(tmp) / "out.mp4")], mode=mode)  # type: ignore[arg-type]
    print(json.dumps({"peak_rss_bytes": peak_rss_bytes(), "num_frames": result.num_frames,
                      "fragments": result.num_fragments, "wall_s": result.wall_s}))


if __name__ == "__main__":
    main()
