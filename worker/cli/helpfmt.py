"""The ``--help`` formatter of every ``longtake`` command (:mod:`worker.cli`, :mod:`worker.cli.render`)."""

from __future__ import annotations

import argparse


class DefaultsShown(argparse.HelpFormatter):
    """Adds "(default: X)" to every option that has a real default and does not state it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = default is not None and default is not False and default != argparse.SUPPRESS
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text
