"""The observation law: what the controller learns about the preemptible pool from one finished step.

One function, :func:`observe_remote`, turns per-instance records of a step into the pool's part of a
:class:`~rlboost_hpc.policy.controller.StepObservation`. The live manager (``manager/trainer_calls.py``, at
``SetVersion``) and the simulator (``sim/simulator.py``, at the end of a step) both build the same records
and call it, so the table the simulator prints is what the live system would decide for the same timeline.

The law (seconds, tokens):

* **Who took part**: every preemptible instance that generated at least one token of the step's responses,
  including instances that left (preempted, lost) during the step — their work was done.
* **Work of an instance** (``t_remote`` of :func:`rlboost_hpc.policy.cap.n_prem_cap`): its tokens divided
  by its peak decode rate (:func:`rlboost_hpc.policy.cap.work_seconds`), i.e. time at full efficiency, so
  an instance idling on one long response is not counted as a fully used one. The peak is the instance's own
  learned peak (:attr:`rlboost_hpc.policy.dispatch.PlateauEstimator.peak`, sampled every balancer period
  while it is busy — the manager and the simulator learn it whether or not the balancer moves work); an
  instance without a measurement yet (it served less than one period) uses the mean peak of the step's other
  instances; when no instance of the step has one, the instance's busy seconds (first dispatch → last token)
  stand in.
* ``t_remote_s`` = mean work over the instances that took part; ``n_remote`` = their number.
* ``t_wait_remote_s`` = step end − the moment the step's last response completed (the pool then waits
  for the next version), 0 when no instance took part or the rollout never completed.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rlboost_hpc.policy.cap import work_seconds


@dataclass(frozen=True)
class RemoteWork:
    """One preemptible instance's part in a step.

    Attributes:
        tokens: tokens it generated for the step's responses (accepted by the manager), count.
        peak_tokens_per_s: its learned peak decode rate, tokens/s; ``None`` before any measurement.
        busy_s: seconds from its first dispatch of the step to its last token (the last-resort work measure).
    """

    tokens: int
    peak_tokens_per_s: float | None = None
    busy_s: float = 0.0


@dataclass(frozen=True)
class RemoteObservation:
    """The pool's part of a step observation (see the module docstring for each field's law)."""

    t_remote_s: float
    t_wait_remote_s: float
    n_remote: int
    tokens: int


def _known(peak: float | None) -> bool:
    return peak is not None and peak > 0 and math.isfinite(peak)


def observe_remote(work: Sequence[RemoteWork], *, rollout_done_s: float | None,
                   step_end_s: float) -> RemoteObservation:
    """Apply the observation law to the step's per-instance records.

    Args:
        work: one record per preemptible instance that held work during the step (any order).
        rollout_done_s: when the step's last response completed, seconds on the caller's clock (``None``: never).
        step_end_s: when the step ended (the next version was published), same clock.

    Returns:
        :class:`RemoteObservation`; deterministic in its inputs (the order of ``work`` does not matter).

    Raises:
        ValueError: a negative token count or busy time.
    """
    took = [w for w in work if w.tokens > 0]
    for w in work:
        if w.tokens < 0 or not (w.busy_s >= 0):
            raise ValueError(f"tokens and busy_s must be >= 0, got {w}")
    peaks = sorted(w.peak_tokens_per_s for w in took if _known(w.peak_tokens_per_s))
    pool_peak = sum(peaks) / len(peaks) if peaks else None
    seconds = []
    for w in took:
        peak = w.peak_tokens_per_s if _known(w.peak_tokens_per_s) else pool_peak
        seconds.append(work_seconds(w.tokens, peak) if peak is not None else w.busy_s)
    n = len(took)
    wait = max(0.0, step_end_s - rollout_done_s) if (n and rollout_done_s is not None) else 0.0
    return RemoteObservation(t_remote_s=sum(sorted(seconds)) / n if n else 0.0, t_wait_remote_s=wait,
                             n_remote=n, tokens=sum(w.tokens for w in took))
