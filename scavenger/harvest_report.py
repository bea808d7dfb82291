"""What harvesting cost the capacity's owners, and what it gave the runs: ``rlboost-hpc harvest report``.

From Slurm's accounting alone (``sacct --allusers -D`` over a window, :func:`owners_report`, pure):

- **the owners' delay**: a job that is not a rollout job *preempted a rollout job* when a rollout attempt on one
  of its nodes ended preempted or requeued (``PREEMPTED``/``REQUEUED``) between the job becoming eligible and its
  start (+1 s for sacct's whole seconds). Its delay = its start − its eligible time: the grace time it waited while
  rollout jobs drained (Slurm preempts when it picks the job, which for a job without dependencies is when it
  becomes eligible). Reported as p50 / p99 / max per partition and per day (UTC, of the start).
- **the harvest**: per account and per run (the rollout job's name less its prefix), GPU-hours of rollout attempts
  (elapsed × allocated GPUs), attempts, preemptions (attempts whose end preceded an owner's start as above), the
  saving against reserved GPUs: GPU-hours × (on-demand − harvested price per GPU-hour), and — for the run
  directories given (:func:`add_run_tokens`) — the tokens each run produced on harvested capacity.

Percentiles are nearest-rank (p99 of fewer than 100 delays is the largest but one, or the max).
"""
from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable

from scavenger.slurm_fields import expand_hostlist
from scavenger.slurm_records import SacctRecord

__all__ = ["OwnerDelay", "DelayStats", "HarvestTotals", "OwnersReport", "owners_report", "format_report",
           "plot_report", "add_run_tokens"]

#: Attempt states that mean a rollout attempt was taken away from it (preempted, or requeued by preemption).
TAKEN = frozenset({"PREEMPTED", "REQUEUED"})
#: sacct prints whole seconds: an owner's start may read up to this much before the preempted attempt's end.
SLACK_S = 1.0


@dataclass(frozen=True)
class OwnerDelay:
    """One owner's job that preempted rollout work: its ``delay_s`` = start − eligible (seconds) and the rollout
    attempts (job ids) it preempted."""

    job_id: str
    partition: str
    account: str
    day: str
    delay_s: float
    preempted: tuple[str, ...]


@dataclass(frozen=True)
class DelayStats:
    """Delays of a group of owners' jobs (seconds): count, p50, p99, max."""

    jobs: int
    p50_s: float
    p99_s: float
    max_s: float


@dataclass
class HarvestTotals:
    """What rollout jobs of one account or run harvested: GPU-hours, attempts, preemptions, saving, tokens."""

    gpu_hours: float = 0.0
    attempts: int = 0
    preemptions: int = 0
    saved: float = 0.0
    tokens: int | None = None  # produced on harvested capacity (from the run's directory; None: not given)


@dataclass
class OwnersReport:
    """The report over one accounting window (see the module docstring)."""

    delays: list[OwnerDelay] = field(default_factory=list)
    by_partition: dict[str, DelayStats] = field(default_factory=dict)
    by_day: dict[str, DelayStats] = field(default_factory=dict)
    by_account: dict[str, HarvestTotals] = field(default_factory=dict)
    by_run: dict[str, HarvestTotals] = field(default_factory=dict)

    def to_json(self) -> dict:
        """The report as plain JSON types."""
        return asdict(self)


def _nearest_rank(xs: list[float], q: float) -> float:
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def _stats(delays: Iterable[float]) -> DelayStats:
    xs = sorted(delays)
    return DelayStats(len(xs), _nearest_rank(xs, 0.5), _nearest_rank(xs, 0.99), xs[-1])


def owners_report(rows: Iterable[SacctRecord], *, rollout_prefix: str = "rlboost-rollout-",
                  spot_price_per_gpu_hour: float = 0.0, on_demand_price_per_gpu_hour: float = 0.0) -> OwnersReport:
    """The report of job-level ``sacct -D`` rows (one per attempt; step rows are ignored). Rollout attempts are
    those whose name starts with ``rollout_prefix``; prices are per GPU-hour (0: no saving reported)."""
    rows = [r for r in rows if r.step is None]
    rollout = [r for r in rows if r.name.startswith(rollout_prefix)]
    owners = [r for r in rows if not r.name.startswith(rollout_prefix) and r.start is not None
              and r.eligible is not None]
    taken_on: dict[str, list[SacctRecord]] = defaultdict(list)
    for r in rollout:
        if r.state in TAKEN and r.end is not None:
            for n in expand_hostlist(r.nodelist):
                taken_on[n].append(r)
    rep = OwnersReport()
    preemptions: set[tuple[str, float]] = set()
    for o in owners:
        hit = {(r.job_id, r.end) for n in expand_hostlist(o.nodelist) for r in taken_on.get(n, ())
               if o.eligible - SLACK_S <= r.end <= o.start + SLACK_S}
        if not hit:
            continue
        preemptions |= hit
        day = dt.datetime.fromtimestamp(o.start, dt.timezone.utc).date().isoformat()
        rep.delays.append(OwnerDelay(o.job_id, o.partition, o.account, day, max(0.0, o.start - o.eligible),
                                     tuple(sorted(j for j, _ in hit))))
    for key, attr in (("by_partition", "partition"), ("by_day", "day")):
        groups: dict[str, list[float]] = defaultdict(list)
        for d in rep.delays:
            groups[getattr(d, attr)].append(d.delay_s)
        setattr(rep, key, {k: _stats(v) for k, v in sorted(groups.items())})
    price = max(0.0, on_demand_price_per_gpu_hour - spot_price_per_gpu_hour)
    for r in rollout:
        gh = r.elapsed_s * r.gpus / 3600.0
        for book, key in ((rep.by_account, r.account or "-"), (rep.by_run, r.name[len(rollout_prefix):])):
            t = book.setdefault(key, HarvestTotals())
            t.gpu_hours += gh
            t.attempts += 1
            t.preemptions += int((r.job_id, r.end) in preemptions)
            t.saved += gh * price
    return rep


def format_report(rep: OwnersReport) -> str:
    """The report as aligned text tables."""
    out = ["What harvesting cost the owners (jobs that preempted rollout work; delay = start − eligible, s)"]
    out.append(f"{'partition/day':<24}{'jobs':>6}{'p50':>9}{'p99':>9}{'max':>9}")
    for title, book in (("partition", rep.by_partition), ("day", rep.by_day)):
        for k, s in book.items():
            out.append(f"{title + ' ' + k:<24}{s.jobs:>6}{s.p50_s:>9.1f}{s.p99_s:>9.1f}{s.max_s:>9.1f}")
    if not rep.delays:
        out.append("(no owner's job preempted a rollout job in this window)")
    out.append("")
    out.append("What the runs harvested")
    out.append(f"{'account/run':<32}{'GPU-h':>10}{'attempts':>10}{'preempted':>10}{'saved':>10}{'tokens':>12}")
    for title, book in (("account", rep.by_account), ("run", rep.by_run)):
        for k, t in sorted(book.items()):
            tokens = "-" if t.tokens is None else f"{t.tokens:,}"
            out.append(f"{title + ' ' + k:<32}{t.gpu_hours:>10.3f}{t.attempts:>10}{t.preemptions:>10}"
                       f"{t.saved:>10.2f}{tokens:>12}")
    return "\n".join(out)


def plot_report(rep: OwnersReport, path: str) -> None:
    """Two panels to ``path`` (PNG): the owners' delays per partition (one dot per job, p50 and p99 marked) and
    the harvested GPU-hours per run (preemptions annotated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    parts = sorted(rep.by_partition)
    for i, p in enumerate(parts):
        ys = [d.delay_s for d in rep.delays if d.partition == p]
        ax1.scatter([i] * len(ys), ys, alpha=0.6)
        st = rep.by_partition[p]
        ax1.hlines([st.p50_s, st.p99_s], i - 0.3, i + 0.3, colors=["k", "r"])
    ax1.set_xticks(range(len(parts)), parts)
    ax1.set_ylabel("owner's delay (s): start − eligible")
    ax1.set_title("jobs that preempted rollout work (black p50, red p99)")
    runs = sorted(rep.by_run)
    ax2.bar(range(len(runs)), [rep.by_run[r].gpu_hours for r in runs])
    for i, r in enumerate(runs):
        ax2.annotate(f"{rep.by_run[r].preemptions} preempted", (i, rep.by_run[r].gpu_hours), ha="center",
                     va="bottom", fontsize=8)
    ax2.set_xticks(range(len(runs)), runs, rotation=30, ha="right")
    ax2.set_ylabel("harvested GPU-hours")
    ax2.set_title("what each run harvested")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_run_tokens(rep: OwnersReport, run_dirs: Iterable[str]) -> None:
    """Fill each run's ``tokens`` (produced on harvested capacity, ``rlboost-hpc stats``' figure) from its run
    directory; a run the window has no rollout job of is added with its tokens only. Raises OSError /
    :class:`rlboost_hpc.rundir.RunDirError` for a directory that is not a run's."""
    from rlboost_hpc.rundir import RunDir
    from scavenger.stats import load_run_stats

    for d in run_dirs:
        rd = RunDir(d)
        rd.require("harvest report --run-dir")
        rep.by_run.setdefault(rd.run_id(), HarvestTotals()).tokens = load_run_stats(d).tokens_produced
