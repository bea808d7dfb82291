"""What every ``rlboost-hpc`` command shares on its way to the terminal: the help formatter (each flag's help ends with
its default value) and the console tables are printed to (a closed pipe ends it as any other output does)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console


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
