"""The help formatter of every ``rlboost-hpc`` command (each flag's help ends with its default value), and the strict
parser of the commands a launcher or a service runs unattended (no abbreviated flags, one-line errors)."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to each flag's help, except where there is nothing to say (no default, an off
    switch, an empty list) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class StrictParser(argparse.ArgumentParser):
    """An argument parser that takes no abbreviation of a flag (``--max-job`` is an error, not ``--max-jobs``: a
    launcher must not guess) and reports bad usage in one line on stderr — ``PROG: error: MESSAGE (see PROG --help)``
    — with exit status 2, instead of the whole usage text."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
