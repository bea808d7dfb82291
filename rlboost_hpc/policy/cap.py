"""Preemptible-pool cap ``N_prem`` (RLBoost's cap on the preemptible pool).

::

    N_prem = (t_remote · n_prem + T_seed · N_resv) / t_train

The numerator is the step's rollout work in instance-seconds — ``n_prem`` remote instances doing ``t_remote``
seconds of work each (see :func:`work_seconds`), plus ``N_resv`` reserved rollout engines (counted in
preemptible-instance equivalents) seeding for ``T_seed`` seconds — and dividing by the training time gives how
many instances would finish that work while the trainer trains. The manager uses no more instances than that even when more are available, because
extra instances would only wait for the trainer (and cost money).

Rounding and clamping (all deterministic):

* ``raw = (t_remote·n_prem + T_seed·N_resv) / t_train``; the cap is ``ceil(raw − 1e-9)`` (round *up*: one
  instance too many costs a little idle time, one too few makes the trainer wait; the epsilon keeps an exact
  integer such as 4.0000000001 from floating-point noise at 4).
* then clamped to ``[minimum, available]`` (``available=None``: no upper clamp; ``minimum`` defaults to 0).
  ``minimum`` wins over ``available`` only if ``available`` is ``None``; with ``available < minimum`` the
  result is ``available`` (you cannot use instances that do not exist).
* ``t_train <= 0`` (no training-time measurement yet, e.g. before the first step): no information, so no cap —
  the result is ``available`` (or ``None`` when ``available`` is ``None``, meaning "unbounded").
* All-zero work with positive ``t_train`` gives ``raw = 0`` → cap ``minimum``.

Pure function; negative or non-finite inputs raise :class:`ValueError`.

Bounded staleness (``rollout.max_staleness`` ≥ 1) breaks the law's inputs, not its aim. The aim stays: the fewest
instances that have one step's rollout ready whenever the trainer wants it. But the pool no longer does "the step's
work" inside the step: it generates the next steps while the trainer trains, pulls every version while it could
be generating (at k = 0 the seeding window hides the pulls), and a step generated ahead has no seeding window. So
:func:`n_prem_cap_overlap` uses what the pool did instead: ``n_prem`` instances busy for ``busy_s`` of the step
(the step's seconds minus its idle tail, waiting for the window to admit a step) against ``trains_s``, the seconds
the trainer could train (the step minus its waits for data and its seeding window, which held training back because
the step was not ready): ``ceil(n_prem · busy_s / trains_s)``, rounded and clamped as above. A pool busy the whole
step while the trainer never waited keeps its size; one that idled shrinks; one the trainer waited for grows.
"""
from __future__ import annotations

import math


def work_seconds(tokens: float, peak_tokens_per_s: float | None) -> float:
    """Rollout work of an instance in instance-seconds: the tokens it generated divided by its peak decode
    rate (learned online, :attr:`rlboost_hpc.policy.dispatch.PlateauEstimator.peak`). This is the ``t_remote``
    the simulator feeds to :func:`n_prem_cap` (averaged over the instances that took part): time at full
    efficiency, so that an instance idling on one long response does not count as a fully used one.
    Returns 0 when the peak is unknown or not positive."""
    if tokens < 0 or not math.isfinite(tokens):
        raise ValueError(f"tokens must be a finite number >= 0, got {tokens!r}")
    if peak_tokens_per_s is None or not (peak_tokens_per_s > 0) or not math.isfinite(peak_tokens_per_s):
        return 0.0
    return tokens / peak_tokens_per_s


def n_prem_raw(t_remote_s: float, n_prem: float, t_seed_s: float, n_resv: float, t_train_s: float) -> float:
    """The unrounded ``(t_remote·n_prem + T_seed·N_resv)/t_train`` (``inf`` when ``t_train <= 0``)."""
    for name, v in (("t_remote_s", t_remote_s), ("n_prem", n_prem), ("t_seed_s", t_seed_s),
                    ("n_resv", n_resv), ("t_train_s", t_train_s)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if t_train_s <= 0:
        return math.inf
    return (t_remote_s * n_prem + t_seed_s * n_resv) / t_train_s


def n_prem_cap(t_remote_s: float, n_prem: float, t_seed_s: float, n_resv: float, t_train_s: float, *,
               available: int | None = None, minimum: int = 0) -> int | None:
    """How many preemptible instances to use next step (see the module docstring for rounding/clamping).

    Args:
        t_remote_s: mean rollout work per remote instance in the last step, seconds (the simulator uses
            :func:`work_seconds`: tokens generated / peak decode rate; plain busy time also works but
            over-counts instances idling on a long tail).
        n_prem: remote instances that took part in the last step.
        t_seed_s: the seeding window of the last step.
        n_resv: reserved rollout engines, in preemptible-instance equivalents (e.g. 8 GPUs / 2 = 4).
        t_train_s: trainer compute seconds of the last step (waits excluded).
        available: instances that could be used now (upper clamp); ``None``: unbounded.
        minimum: lower clamp (default 0; the co-located fallback covers zero instances).

    Returns:
        The cap, or ``None`` when it is unbounded (``t_train <= 0`` and ``available is None``).
    """
    if minimum < 0:
        raise ValueError(f"minimum must be >= 0, got {minimum}")
    if available is not None and available < 0:
        raise ValueError(f"available must be >= 0, got {available}")
    raw = n_prem_raw(t_remote_s, n_prem, t_seed_s, n_resv, t_train_s)
    if math.isinf(raw):
        return available
    cap = max(minimum, math.ceil(raw - 1e-9))
    if available is not None:
        cap = min(cap, available)
    return int(cap)


def n_prem_cap_overlap(busy_s: float, n_prem: float, trains_s: float, *, available: int | None = None,
                       minimum: int = 0) -> int | None:
    """The cap under bounded staleness (see the module docstring): ``ceil(n_prem · busy_s / trains_s)``, rounded and
    clamped as :func:`n_prem_cap`.

    Args:
        busy_s: seconds of the step the pool was not idle (the step minus the time after every admitted step was
            generated).
        n_prem: remote instances that took part in the step.
        trains_s: seconds of the step the trainer was not held back by data (the step minus its waits for groups
            and its seeding window); ``<= 0``: no information, as ``t_train <= 0`` for :func:`n_prem_cap`.

    Raises:
        ValueError: a negative or non-finite input.
    """
    return n_prem_cap(busy_s, n_prem, 0.0, 0.0, trains_s, available=available, minimum=minimum)
