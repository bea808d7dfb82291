"""How a cluster's harvestable GPUs are split between the runs that share them (pure functions, no I/O).

The harvest service (:mod:`scavenger.harvest`) calls these once per cycle with what Slurm listed and what the runs
asked for; the figures they return are the only thing it writes into each run's share.

- :func:`harvestable_gpus`: the pool = idle GPUs (as far as the node's free CPUs can start jobs on them) of usable,
  not excluded nodes of the harvested partitions + the
  GPUs the registered runs' running rollout jobs hold there (per node at most its GPUs), less the share the site
  keeps free for fast starts of priority jobs (``floor((1 - idle_share_free) * pool)``; 0 in a blackout window).
- :func:`proportional_shares`: the open anchor's rule (RLix): the pool split in proportion to each run's demand in
  GPUs, floored to whole instances, the rest by largest remainder — weights ignored, caps kept. A rule to compare
  with (``share_rule = "demand_proportional"``): a run asking for little under contention can get nothing.
- :func:`weighted_shares`: weighted max-min fairness (progressive filling) in whole rollout instances: the next
  instance always goes to the run whose GPUs per unit of weight, that instance included, stay lowest — never more
  than a run asks for, within its own and its account's GPU caps and the pool. Ties go to the lexically smallest
  run id, so the split is deterministic.

Invariants: Σ shares × GPUs per instance ≤ the pool; a run's share ≤ its demand; a run whose demand is not met
has, per unit of weight, no fewer GPUs than any other run minus one of its instances (within the caps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from scavenger.slurm_records import JobClass, JobInfo, NodeInfo

__all__ = ["RunDemand", "harvestable_gpus", "proportional_shares", "weighted_shares"]


@dataclass(frozen=True)
class RunDemand:
    """What one run asks of the pool: ``instances`` rollout instances of ``gpus_per_instance`` GPUs each (0: a
    CPU-only instance, counted as one unit), with ``weight`` > 0 (the site policy's run weight × account weight),
    at most ``max_gpus`` GPUs for this run (None: no cap), charged to ``account``."""

    run_id: str
    instances: int
    gpus_per_instance: int = 1
    weight: float = 1.0
    account: str = ""
    max_gpus: int | None = None

    @property
    def unit(self) -> int:
        """GPUs (or units, for CPU-only instances) one instance of this run takes."""
        return max(1, self.gpus_per_instance)


def harvestable_gpus(nodes: Iterable[NodeInfo], jobs: Iterable[JobInfo], *, partitions: Sequence[str],
                     run_tags: Iterable[str], exclude_nodes: Iterable[str] = (), idle_share_free: float = 0.0,
                     blackout: bool = False, cpus_per_gpu: int = 1) -> tuple[int, int, int]:
    """The pool of GPUs the registered runs may share: ``(pool, idle, held)`` — ``idle``: free GPUs of usable
    nodes in ``partitions`` not in ``exclude_nodes``, each node's as far as its free CPUs can start jobs of
    ``cpus_per_gpu`` CPUs per GPU (a node whose CPUs another job holds has no idle GPU to offer, whatever its GPUs
    say; 0: CPUs not counted); ``held``: GPUs of the running jobs whose comment is one of
    ``run_tags`` on those nodes; ``pool`` = ⌊(1 − ``idle_share_free``) · Σ_nodes min(GPUs of the node, idle + held
    there)⌋, 0 when ``blackout``. The per-node clamp keeps a job that ``squeue`` still lists as completing while
    ``sinfo`` already shows its GPUs free from counting twice.

    A job on several nodes counts where its first node is; pending jobs hold nothing."""
    parts, excluded, tags = set(partitions), set(exclude_nodes), set(run_tags)
    harvested = {n.name: n for n in nodes if n.name not in excluded and parts & set(n.partitions)}
    held_on: dict[str, int] = {}
    for j in jobs:
        first = j.nodes.split(",")[0]
        if j.comment in tags and j.job_class is JobClass.RUNNING and first in harvested:
            held_on[first] = held_on.get(first, 0) + j.gpus
    free = {name: min(n.free_gpus, n.free_cpus // cpus_per_gpu) if cpus_per_gpu > 0 else n.free_gpus
            for name, n in harvested.items()}
    idle = sum(free.values())
    held = sum(held_on.values())
    total = sum(min(n.gres_total_gpus, free[name] + held_on.get(name, 0)) for name, n in harvested.items())
    pool = 0 if blackout else math.floor((1.0 - idle_share_free) * total + 1e-9)
    return pool, idle, held


def weighted_shares(demands: Sequence[RunDemand], pool: int, account_caps: Mapping[str, int] | None = None,
                    groups: Sequence[tuple[frozenset[str], int]] = ()) -> dict[str, int]:
    """Rollout instances per run id: weighted max-min (progressive filling) of ``pool`` GPUs over ``demands``,
    each run within its ``instances`` and ``max_gpus``, each account within ``account_caps`` (GPUs; absent: no
    cap), and each group of runs within its limit (``groups``: (run ids, GPUs) — e.g. the runs whose jobs' time
    limits keep them off the nodes reserved soon, bounded by the GPUs they may use). Every run of ``demands`` is in
    the result (0 when it gets nothing). O(Σ shares · runs · (1 + groups)).

    With nested groups (each the runs of a longer time limit than the last) the result is still max-min fair:
    progressive filling under such limits stops each run only where one of its own limits binds.

    Raises ValueError for a weight ≤ 0 or a negative demand."""
    caps = dict(account_caps or {})
    in_group: dict[str, list[int]] = {}
    for k, (members, _) in enumerate(groups):
        for rid in members:
            in_group.setdefault(rid, []).append(k)
    group_used = [0] * len(groups)
    for d in demands:
        if d.weight <= 0 or d.instances < 0:
            raise ValueError(f"run {d.run_id!r}: weight must be > 0 and instances ≥ 0 (got {d.weight}, "
                             f"{d.instances})")
    alloc = {d.run_id: 0 for d in demands}
    by_account: dict[str, int] = {}
    used = 0
    order = sorted(demands, key=lambda d: d.run_id)
    while True:
        best: RunDemand | None = None
        best_key: tuple[float, str] | None = None
        for d in order:
            n, u = alloc[d.run_id], d.unit
            if n >= d.instances or used + u > pool:
                continue
            if d.max_gpus is not None and (n + 1) * u > d.max_gpus:
                continue
            cap = caps.get(d.account)
            if cap is not None and by_account.get(d.account, 0) + u > cap:
                continue
            if any(group_used[k] + u > groups[k][1] for k in in_group.get(d.run_id, ())):
                continue
            key = ((n + 1) * u / d.weight, d.run_id)  # the level it would reach: the lowest goes first
            if best_key is None or key < best_key:
                best, best_key = d, key
        if best is None:
            return alloc
        alloc[best.run_id] += 1
        used += best.unit
        by_account[best.account] = by_account.get(best.account, 0) + best.unit
        for k in in_group.get(best.run_id, ()):
            group_used[k] += best.unit


def proportional_shares(demands: Sequence[RunDemand], pool: int, account_caps: Mapping[str, int] | None = None,
                        groups: Sequence[tuple[frozenset[str], int]] = ()) -> dict[str, int]:
    """Rollout instances per run id, split as RLix splits leftover GPUs: in proportion to each run's outstanding
    demand in GPUs (``instances`` × GPUs per instance) — ``⌊pool · demand_i / Σ demand⌋ / unit_i`` whole instances,
    never above the demand — then the instances left, one at a time, to the largest remainders (ties: the lexically
    smallest run id). Weights are ignored; ``max_gpus``, ``account_caps`` and ``groups`` hold as in
    :func:`weighted_shares`. Raises ValueError for a negative demand."""
    for d in demands:
        if d.instances < 0:
            raise ValueError(f"run {d.run_id!r}: instances must be ≥ 0 (got {d.instances})")
    want = {d.run_id: d.instances * d.unit for d in demands}
    total = sum(want.values())
    if total <= 0:
        return {d.run_id: 0 for d in demands}
    exact = {rid: min(w, pool * w / total) for rid, w in want.items()}
    floors = {d.run_id: min(d.instances, int(exact[d.run_id] // d.unit)) for d in demands}
    limits = [RunDemand(d.run_id, floors[d.run_id], d.gpus_per_instance, 1.0, d.account, d.max_gpus) for d in demands]
    alloc = weighted_shares(limits, pool, account_caps, groups)  # the floors, within every cap
    used = sum(alloc[d.run_id] * d.unit for d in demands)
    order = sorted(demands, key=lambda d: (-(exact[d.run_id] - alloc[d.run_id] * d.unit), d.run_id))
    for d in order:  # the rest by largest remainder: one more instance each, while it fits
        trial = {**alloc, d.run_id: alloc[d.run_id] + 1}
        if alloc[d.run_id] < d.instances and used + d.unit <= pool and _fits(trial, demands, account_caps, groups):
            alloc, used = trial, used + d.unit
    return alloc


def _fits(alloc: Mapping[str, int], demands: Sequence[RunDemand], account_caps: Mapping[str, int] | None,
          groups: Sequence[tuple[frozenset[str], int]]) -> bool:
    """Whether ``alloc`` keeps every run's ``max_gpus``, every account cap and every group limit."""
    gpus = {d.run_id: alloc[d.run_id] * d.unit for d in demands}
    if any(d.max_gpus is not None and gpus[d.run_id] > d.max_gpus for d in demands):
        return False
    by_account: dict[str, int] = {}
    for d in demands:
        by_account[d.account] = by_account.get(d.account, 0) + gpus[d.run_id]
    if any(a in by_account and by_account[a] > cap for a, cap in (account_caps or {}).items()):
        return False
    return all(sum(gpus.get(r, 0) for r in members) <= limit for members, limit in groups)
