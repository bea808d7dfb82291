"""The help formatter of every ``rlboost-hpc`` command: each flag's help ends with its default value."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to each flag's help, except where there is nothing to say (no default, an off
    switch, an empty list) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)
