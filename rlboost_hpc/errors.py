"""The two kinds of failure a user of any ``rlboost-hpc`` command sees, and their exit status.

Every error that reaches a command line derives from exactly one of them, so each command catches two bases (never
a hand-kept list of error types):

* :class:`BadInput` — exit status 2: the input is wrong and nothing ran (or the run stopped before it could do
  harm): a config file or key, a model, data or trace file, a checkpoint or run directory, an option. The message
  names the file or key and the problem.
* :class:`RunFailed` — exit status 1: the input was good but the run could not complete (rollout unrecoverable, a
  service died). The run directory says what was done.
"""
from __future__ import annotations

__all__ = ["BadInput", "RunFailed"]


class BadInput(Exception):
    """Bad input (exit status 2); the message names the file or key."""

    exit_status = 2


class RunFailed(Exception):
    """A run that could not complete (exit status 1)."""

    exit_status = 1
