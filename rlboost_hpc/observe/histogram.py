"""A bounded distribution: how many observations fell at or below each of fixed upper bounds, their sum and count.

A long-lived process (the rollout manager of a week-long run sees ~10^6 weight pulls and ~10^5 steps) must not keep
every observation: its memory would grow without bound and each Prometheus scrape would re-count the whole history.
:class:`Histogram` keeps ``len(bounds) + 1`` integers and two numbers whatever the number of observations, and is
exactly what a Prometheus histogram exposes (cumulative ``le`` buckets, ``_sum``, ``_count``).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

#: Upper bounds (seconds) of the step duration histogram: a demo step to a 70B model's long-response step.
STEP_BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
#: Upper bounds (seconds) of the weight-pull duration histogram: a 1 MB demo model to a 140 GB 70B model.
PULL_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Upper bounds (seconds) of an instance's silences (longer than its heartbeat interval): around the heartbeat
#: deadline, up to the expiry of a suspect.
SILENCE_BUCKETS_S = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 15.0, 30.0, 60.0)


@dataclass
class Histogram:
    """Counts per bucket over ``bounds`` (increasing upper bounds, in the unit observed, e.g. seconds) plus the
    ``+Inf`` bucket; ``total`` is the sum of the observations, ``count`` their number. O(len(bounds)) memory, and
    O(log len(bounds)) per observation.

    Raises:
        ValueError: ``bounds`` empty or not strictly increasing.
    """

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # counts[i]: observations in (bounds[i-1], bounds[i]]; last: +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.bounds or any(b >= c for b, c in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"histogram bounds must be strictly increasing and not empty, not {self.bounds}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, x: float) -> None:
        """Count one observation ``x`` in the first bucket whose upper bound is ≥ x (Prometheus' ``le``)."""
        self.counts[bisect_left(self.bounds, x)] += 1
        self.total += x
        self.count += 1

    def mean(self) -> float:
        """Mean of the observations (0.0 when there are none)."""
        return self.total / self.count if self.count else 0.0

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: ``(le, observations ≤ le)`` per bound, then ``("+Inf", count)``."""
        out, run = [], 0
        for b, c in zip(self.bounds, self.counts):
            run += c
            out.append((repr(b), run))
        return out + [("+Inf", self.count)]

    def quantile_bound(self, q: float) -> float:
        """The upper bound of the bucket that holds the ``q``-quantile (0 < q ≤ 1): the smallest bound at or below
        which at least ``q`` of the observations lie; ``inf`` when that is the ``+Inf`` bucket, 0.0 with no
        observations."""
        if not self.count:
            return 0.0
        need, run = q * self.count, 0
        for b, c in zip(self.bounds, self.counts):
            run += c
            if run >= need:
                return b
        return float("inf")

    def copy(self) -> "Histogram":
        """An independent copy (what a scrape snapshot holds)."""
        return Histogram(self.bounds, list(self.counts), self.total, self.count)
