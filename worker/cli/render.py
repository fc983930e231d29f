"""``longtake render``: one local render from files, with a progress bar and a summary.

Who calls what: :func:`worker.cli.main` hands ``render ...`` to :func:`main` here. It runs the same
``pipeline.render`` the workers run, into a local MP4 (written progressively: a player can open
``OUT.partial`` while it grows) and optionally an HLS directory for live viewing. Imports nothing of
Celery, SQL or S3.

Order, so that a mistake costs a blink, not a torch import: parse the arguments; check the outputs
(one rule for both: an existing ``--out`` file or a ``--hls`` directory holding a render is refused
unless ``--force``), the text, the image (header and pixels) and the audio (header and first samples)
with the torch-free :mod:`pipeline.inputs`; only then import torch and the pipeline and render.
SIGINT (Ctrl-C) and SIGTERM stop the render cleanly: ``OUT.partial`` is removed, one line says so,
exit status 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from pipeline.errors import InvalidInputError, RenderError
from pipeline.inputs import (
    load_reference_image,
    validate_hls_directory,
    validate_output_path,
)
from pipeline.probe import probe_audio
from pipeline.request import MAX_TEXT_CHARS, RenderRequest
from pipeline.sinks import PARTIAL_SUFFIX
from worker.cli.helpfmt import DefaultsShown
from worker.cli.options import add_option_argument, options_of

if TYPE_CHECKING:
    from pipeline.request import RenderResult

# The presets each family knows, first its default (models/presets.py, pipeline/families/wan/presets.py;
# tests/unit/test_render_cli.py checks this against the registries), so --help can name them.
PRESET_NAMES = {
    "tiny": ("tiny", "1.3b", "14b"),
    "wan": ("infinitetalk", "infinitetalk-720p", "flashtalk", "14b", "14b-720p", "1.3b", "1.3b-720p", "tiny",
            "tiny-128"),
}


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by SIGINT/SIGTERM (see :func:`_install_stop_handlers`, which records
    the signal in ``_stop_signal``)."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    presets = "; ".join(f"{fam}: {', '.join(names)}" for fam, names in PRESET_NAMES.items())
    p = argparse.ArgumentParser(
        prog="longtake render",
        description="Render a video of the person in --image speaking --audio (any length). The inputs "
        "are checked before the model loads; Ctrl-C or SIGTERM stops the render and removes OUT.partial.",
        formatter_class=DefaultsShown,
    )
    p.add_argument("--image", required=True, type=Path,
                   help="reference image: 8-bit PNG, JPEG, WebP, BMP, GIF or TIFF; an alpha channel only if "
                   "fully opaque")
    p.add_argument("--audio", required=True, type=Path,
                   help="driving audio (wav, mp3, m4a, flac, ogg, ...); stereo is mixed down to mono")
    p.add_argument("--text", default=None, help=f"optional text / scene prompt, at most {MAX_TEXT_CHARS} characters")
    p.add_argument("--out", required=True, type=Path,
                   help="output file, must end in .mp4; OUT.partial grows while rendering. An existing file "
                   "is refused unless --force")
    p.add_argument("--hls", type=Path, default=None,
                   help="also write a live HLS directory here (new or empty; one holding an earlier render "
                   "is refused unless --force)")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing --out file (replaced when the render succeeds) and an earlier "
                   "render in --hls")
    p.add_argument("--seed", type=int, default=0, help="random seed (>= 0); same seed, same video")
    p.add_argument("--family", default="tiny", choices=sorted(PRESET_NAMES), help="model family")
    p.add_argument("--preset", default=None,
                   help=f"model preset of the family (default: the family's first: {presets})")
    p.add_argument("--checkpoint", "--weights", type=Path, default=None, dest="checkpoint",
                   help="tiny: a safetensors checkpoint (default: the one shipped for the preset); wan: the "
                   "folder holding the downloads side by side (docs/wan.md)")
    p.add_argument("--model", default=None,
                   help="a model name the operator configured (LONGTAKE_MODELS) instead of --weights")
    add_option_argument(p)
    p.add_argument("--mode", choices=["streaming", "batch"], default="streaming",
                   help="streaming or the conventional batch baseline")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads, >= 1 (default: CPU cores - 1, leaving one to the encoder)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def launch_time() -> float:
    """Wall-clock time (``time.time()``) this process was started, from ``/proc`` (10 ms ticks);
    where there is no ``/proc``, the time this module was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); the first two fields precede the ')'
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


def _request(args: argparse.Namespace) -> RenderRequest:
    """The request of the parsed arguments: the family's default preset when none is given;
    ``--model NAME`` looked up in ``Settings.models`` (``--text`` is the wan family's prompt);
    ``--option`` checked by the family for the preset (``ModelFamily.options``, as ``render()`` will).
    Torch-free (the family registry loads no models)."""
    from pipeline.families import FAMILIES

    family = FAMILIES.get(args.family)
    preset = args.preset or family.default_preset
    try:
        options = options_of(args.options)
    except ValueError as exc:
        raise InvalidInputError(str(exc), field="options") from exc
    if options:
        family.options(family.preset(preset), options)  # a bad one fails here, before torch loads
    checkpoint = args.checkpoint
    if args.model is not None:
        if checkpoint is not None:
            raise InvalidInputError("give --weights DIR or --model NAME, not both", field="model")
        from worker.settings import Settings

        checkpoint = Settings().model_weights(args.model)
    return RenderRequest(image=args.image, audio=args.audio, text=args.text, seed=args.seed,
                         family=family.name, preset=preset, checkpoint=checkpoint, options=options)


def check_inputs(args: argparse.Namespace) -> tuple[Path, Path | None, int, RenderRequest]:
    """Everything that can be checked without torch, in the order a user fixes things: the outputs,
    text and seed, the model choice, then the image (header and pixels, as the render will read it)
    and the audio (header and first samples). Returns (out, hls, audio channels, request); raises
    InvalidInputError."""
    out = validate_output_path(args.out, overwrite=args.force)
    hls = validate_hls_directory(args.hls, overwrite=args.force) if args.hls is not None else None
    if args.text is not None and len(args.text) > MAX_TEXT_CHARS:
        raise InvalidInputError(
            f"text has {len(args.text)} characters; the limit is {MAX_TEXT_CHARS}: shorten the prompt",
            field="text")
    if args.seed < 0:
        raise InvalidInputError(f"seed={args.seed}: must be an integer >= 0", field="seed")
    request = _request(args)
    load_reference_image(args.image, 64, 64)
    channels = probe_audio(args.audio).channels
    return out, hls, channels, request


# The signal that stopped this render, recorded by the handler before it raises. Native code the
# exception passes through may replace it with its own error (torch building a tensor from a
# safetensors storage turns it into "could not determine the shape of object type UntypedStorage"),
# so main() asks this record, not the exception's type, whether a failure was a stop.
_stop_signal: list[int] = []


def _install_stop_handlers() -> None:
    """SIGINT and SIGTERM raise :class:`Stopped` in the main thread, so the render unwinds through
    its ``finally`` blocks (the sinks close with ok=False: FileSink removes OUT.partial). A second
    signal while unwinding is ignored."""

    def _stop(signum: int, _frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop_signal.append(signum)
        raise Stopped(signal.Signals(signum).name)

    _stop_signal.clear()
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)


def _render(
    args: argparse.Namespace, request: RenderRequest, out: Path, hls: Path | None
) -> tuple[RenderResult, float]:
    """Import torch and the pipeline (seconds), then render into OUT (and the HLS directory).
    Returns the result and the wall-clock time ``render()`` was called."""
    import torch
    from tqdm import tqdm

    from pipeline.host import default_threads
    from pipeline.media_types import FrameSink
    from pipeline.render import render
    from pipeline.request import RenderProgress
    from pipeline.sinks import FileSink, HLSDirectorySink

    torch.set_num_threads(args.threads or default_threads())
    sinks: list[FrameSink] = [FileSink(out)]
    if hls is not None:
        sinks.append(HLSDirectorySink(hls))
    bar: tqdm | None = None

    def progress(p: RenderProgress) -> None:
        nonlocal bar
        if args.quiet:
            return
        if bar is None:
            bar = tqdm(total=p.num_frames, unit="frame", desc="render", file=sys.stderr)
        bar.update(p.frames_done - bar.n)
        bar.set_postfix(fps=f"{p.frames_done / max(p.elapsed_s, 1e-9):.1f}", refresh=False)

    started_at = time.time()
    try:
        return render(request, sinks, mode=args.mode, on_progress=progress), started_at
    finally:
        if bar is not None:
            bar.close()


def summary(out: Path, result: RenderResult, *, launched_at: float, render_started_at: float) -> str:
    """The closing lines: what was written, and the two first-frame times named for what they
    measure — from launching the command (interpreter, imports, input checks, model load) and from
    the start of ``render()`` (model load included: ``RenderResult.ttff_s``)."""
    fps = result.num_frames / result.wall_s if result.wall_s else 0.0
    startup = render_started_at - launched_at
    return (
        f"wrote {out} ({result.num_frames} frames, {result.duration_s:.2f} s of video)\n"
        f"  first frame written {startup + result.ttff_s:.2f} s after launch "
        f"(start-up {startup:.2f} s: Python, torch import, input checks; then the render's own time to "
        f"first frame {result.ttff_s:.2f} s, model load included)\n"
        f"  {fps:.1f} frames/s ({result.duration_s / result.wall_s:.2f}x real time) | render wall "
        f"{result.wall_s:.2f} s | peak memory {result.peak_rss_bytes / 2**20:.0f} MiB"
    )


def main(argv: list[str] | None = None) -> int:
    launched_at = launch_time()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _install_stop_handlers()
    partial = Path(str(args.out) + PARTIAL_SUFFIX)
    try:
        out, hls, channels, request = check_inputs(args)
        partial = out.with_name(out.name + PARTIAL_SUFFIX)
        if channels > 1:
            print(f"note: {args.audio} has {channels} channels; the video's audio is their mono mix",
                  file=sys.stderr)
        result, render_started_at = _render(args, request, out, hls)
    except Exception as exc:
        if _stop_signal:  # the stop surfaced as another error (a module load wraps what it reads)
            return _stopped(_stop_signal[0], partial)
        if not isinstance(exc, RenderError):
            raise
        where = f" [{exc.field}]" if exc.field else ""
        print(f"longtake render: error{where}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Stopped by a recorded signal, or a Ctrl-C before the handlers were installed
        return _stopped(_stop_signal[0] if _stop_signal else signal.SIGINT, partial)
    if result.random_init:
        print("note: the model runs on seeded RANDOM weights (no trained checkpoint for preset "
              f"{request.preset!r}); the video shows noise-like motion, not a trained avatar.", file=sys.stderr)
    print(summary(out, result, launched_at=launched_at, render_started_at=render_started_at))
    return 0


def _stopped(signum: int, partial: Path) -> int:
    """The one line a stopped render prints, after making sure OUT.partial is gone (the sink removes
    it; not if the signal came before the sink opened or while it closed). Exit 128 + signal."""
    partial.unlink(missing_ok=True)
    name = signal.Signals(signum).name
    print(f"longtake render: stopped by {name}; nothing written ({partial.name} removed)", file=sys.stderr)
    return 128 + int(signum)


if __name__ == "__main__":
    sys.exit(main())
