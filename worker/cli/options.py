"""``--option KEY=VALUE``: a family option (``JobSpec.options`` / ``RenderRequest.options``) on the
command line, shared by ``longtake render``, ``submit`` and ``live``. Parsing only: the family checks
the keys and values (``ModelFamily.options``) — the API at submit, ``render`` before torch loads."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

OPTION_HELP = (
    "a family option as KEY=VALUE, repeatable, e.g. --option steps=3 --option audio_guidance=2.0; "
    "VALUE is read as an int, else a float, else a string; a key the family does not take is refused "
    "naming the ones it does (docs/api.md)"
)


def parse_option(text: str) -> tuple[str, str | int | float]:
    """``KEY=VALUE`` -> (key, value): the value as an int, else a finite float, else the string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE; write e.g. --option steps=3")
    try:
        return key, int(raw)
    except ValueError:
        pass
    try:
        number = float(raw)
    except ValueError:
        return key, raw
    return key, number if math.isfinite(number) else raw


def options_of(pairs: Sequence[tuple[str, str | int | float]] | None) -> dict[str, str | int | float]:
    """The ``--option`` pairs as a dict; a key given twice is a usage error (``ValueError``)."""
    out: dict[str, str | int | float] = {}
    for key, value in pairs or ():
        if key in out:
            raise ValueError(f"--option {key}= is given twice ({out[key]!r} and {value!r}); give it once")
        out[key] = value
    return out


def add_option_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--option", action="append", type=parse_option, dest="options", metavar="KEY=VALUE",
                   help=OPTION_HELP)
