"""What every ``rlboost-hpc`` command shares on its way to and from the terminal: the help formatter (each flag's help
ends with its default value), numeric flags checked against their range (:func:`number`), the console tables are
printed to (a closed pipe ends it as any other output does), and the strict parser of the commands a launcher or a
service runs unattended (no abbreviated flags, one-line errors)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console


def number(kind: type, *, above: float | None = None, at_least: float | None = None, at_most: float | None = None):
    """An argparse ``type=`` for a number of ``kind`` (int or float) in a range: ``above`` (exclusive), ``at_least``
    / ``at_most`` (inclusive). A value outside is a usage error (exit 2, the flag and the bound named by argparse),
    never a run that quietly does nothing."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if above is not None and not v > above:
            raise argparse.ArgumentTypeError(f"{text} must be > {above:g}")
        if at_least is not None and not v >= at_least:
            raise argparse.ArgumentTypeError(f"{text} must be >= {at_least:g}")
        if at_most is not None and not v <= at_most:
            raise argparse.ArgumentTypeError(f"{text} must be <= {at_most:g}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its message ("invalid float value")
    return parse


def console() -> "Console":
    """A rich console on stdout whose closed pipe (``| head``) raises :class:`BrokenPipeError`, which the command
    line's boundary ends quietly with status 141 (``rlboost_hpc.cli.main``) — rich's own reaction is to exit 1."""
    from rich.console import Console

    class _PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    return _PipeConsole()


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
