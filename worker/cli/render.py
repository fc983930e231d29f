"""``longtake render``: one local render from files, with a progress bar and a summary.

Runs the same ``pipeline.render`` the workers run, into a local MP4 (written progressively: a
player can open ``OUT.partial`` while it grows) and optionally an HLS directory for live viewing.
Imports nothing of Celery, SQL or S3.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.errors import InvalidInputError, RenderError
from pipeline.host import default_threads
from pipeline.inputs import validate_hls_directory, validate_output_path
from pipeline.media_types import FrameSink
from pipeline.render import render
from pipeline.request import RenderProgress, RenderRequest
from pipeline.sinks import FileSink, HLSDirectorySink


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="longtake render",
        description="Render a video of the person in --image speaking --audio (any length).",
    )
    p.add_argument("--image", required=True, type=Path, help="reference image (png, jpg, webp, ...)")
    p.add_argument("--audio", required=True, type=Path, help="driving audio (wav, mp3, m4a, flac, ...)")
    p.add_argument("--text", default=None, help="optional text / scene prompt")
    p.add_argument("--out", required=True, type=Path, help="output MP4 path")
    p.add_argument("--hls", type=Path, default=None, help="also write a live HLS directory here")
    p.add_argument("--seed", type=int, default=0, help="random seed (>= 0); same seed, same video")
    p.add_argument("--family", default="tiny", help="model family: tiny (default) or wan")
    p.add_argument("--preset", default=None,
                   help="model preset of the family (default: the family's, e.g. wan: infinitetalk)")
    p.add_argument("--checkpoint", "--weights", type=Path, default=None, dest="checkpoint",
                   help="tiny: a safetensors checkpoint (default: the one shipped for the preset); wan: the "
                   "folder holding the downloads side by side (docs/wan.md)")
    p.add_argument("--model", default=None,
                   help="a model name the operator configured (LONGTAKE_MODELS) instead of --weights")
    p.add_argument("--mode", choices=["streaming", "batch"], default="streaming",
                   help="streaming (default) or the conventional batch baseline")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: CPU cores - 1, leaving one to the encoder)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _request(args: argparse.Namespace) -> RenderRequest:
    """The request of the parsed arguments: the family's default preset when none is given;
    ``--model NAME`` looked up in ``Settings.models`` (``--text`` is the wan family's prompt)."""
    from pipeline.families import FAMILIES

    family = FAMILIES.get(args.family)
    preset = args.preset or family.default_preset
    checkpoint = args.checkpoint
    if args.model is not None:
        if checkpoint is not None:
            raise InvalidInputError("give --weights DIR or --model NAME, not both", field="model")
        from worker.settings import Settings

        checkpoint = Settings().model_weights(args.model)
    return RenderRequest(image=args.image, audio=args.audio, text=args.text, seed=args.seed,
                         family=family.name, preset=preset, checkpoint=checkpoint)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads or default_threads())
    try:
        out = validate_output_path(args.out)
        sinks: list[FrameSink] = [FileSink(out)]
        if args.hls is not None:
            sinks.append(HLSDirectorySink(validate_hls_directory(args.hls)))
        request = _request(args)
        bar: tqdm | None = None

        def progress(p: RenderProgress) -> None:
            nonlocal bar
            if args.quiet:
                return
            if bar is None:
                bar = tqdm(total=p.num_frames, unit="frame", desc="render", file=sys.stderr)
            bar.update(p.frames_done - bar.n)
            bar.set_postfix(fps=f"{p.frames_done / max(p.elapsed_s, 1e-9):.1f}", refresh=False)

        result = render(request, sinks, mode=args.mode, on_progress=progress)
        if bar is not None:
            bar.close()
    except RenderError as exc:
        where = f" [{exc.field}]" if exc.field else ""
        print(f"longtake render: error{where}: {exc}", file=sys.stderr)
        return 2
    if result.random_init:
        print("note: the model runs on seeded RANDOM weights (no trained checkpoint for preset "
              f"{request.preset!r}); the video shows noise-like motion, not a trained avatar.", file=sys.stderr)
    fps = result.num_frames / result.wall_s if result.wall_s else 0.0
    print(
        f"wrote {out} ({result.num_frames} frames, {result.duration_s:.2f} s of video)\n"
        f"  time to first frame {result.ttff_s:.2f} s | {fps:.1f} frames/s "
        f"({result.duration_s / result.wall_s:.2f}x real time) | wall {result.wall_s:.2f} s | "
        f"peak memory {result.peak_rss_bytes / 2**20:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
