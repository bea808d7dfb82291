"""Prometheus metrics of the scavenger daemon (prometheus-client), for MLOps dashboards.

Invariant: like the manager's (rlboost_hpc/observe/metrics.py), the HTTP thread reads only a snapshot that the
daemon's own loop refreshes after each reconciliation (:meth:`ScavengerMetrics.refresh`), so a scrape never
runs a Slurm command or races the daemon. Harvest statistics come from the run's ``events.jsonl`` through
``scavenger.stats`` (the same numbers as ``rlboost-hpc stats``).
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rlboost_hpc.observe.metrics import SnapshotCollector


class ScavengerMetrics(SnapshotCollector):
    """Collector over the daemon's last reconciliation and the run's harvest statistics."""

    def __init__(self, spot_price_per_gpu_hour: float = 0.0, on_demand_price_per_gpu_hour: float = 0.0) -> None:
        super().__init__()
        self.spot_price, self.on_demand_price = spot_price_per_gpu_hour, on_demand_price_per_gpu_hour
        self._totals = {"submitted": 0, "cancelled": 0, "signalled": 0, "command_failures": 0, "reconciliations": 0}

    def refresh(self, res, stats) -> None:
        """Record a :class:`~scavenger.daemon.ReconcileResult` and a :class:`~scavenger.stats.RunStats`."""
        t = self._totals
        t["submitted"] += len(res.submitted)
        t["cancelled"] += len(res.cancelled)
        t["signalled"] += len(res.signalled)
        t["command_failures"] += 0 if res.ok else 1
        t["reconciliations"] += 1
        cost = stats.gpu_hours * self.spot_price
        snap = {
            "target": -1 if res.target is None else res.target.n,
            "run_active": 1 if res.target is None or res.target.active else 0,
            "desired": res.desired, "live": res.live, "pending": res.pending, "running": res.running,
            "leaving": res.draining, "free_slots": -1 if res.free_slots is None else res.free_slots,
            "ok": 1 if res.ok else 0, **t,
            "preemptions": stats.preemptions, "requeues": stats.requeues, "attempts": stats.attempts,
            "gpu_hours": stats.gpu_hours, "tokens_produced": stats.tokens_produced,
            "harvest_cost": cost,
            "cost_per_million_tokens": (cost / stats.tokens_produced * 1e6) if stats.tokens_produced else 0.0,
            "saving_vs_on_demand": stats.gpu_hours * (self.on_demand_price - self.spot_price),
        }
        self.publish(snap)

    def collect(self):
        s = self.snapshot()
        if not s:
            return
        jobs = GaugeMetricFamily("rlboost_scavenger_jobs", "our rollout jobs by state at the last reconciliation",
                                 labels=["state"])
        for k in ("live", "pending", "running", "leaving"):
            jobs.add_metric([k], s[k])
        yield jobs
        for name, doc in [("target", "N_prem the run asks for (-1: no target.json)"),
                          ("desired", "jobs the daemon aims for (target capped by max_jobs)"),
                          ("free_slots", "idle GPU slots it may use (-1: not checked this cycle)"),
                          ("run_active", "1 while the run wants rollout capacity"),
                          ("ok", "1 if the last reconciliation's Slurm commands all succeeded"),
                          ("harvested_gpu_hours", "GPU-hours of rollout jobs on harvested capacity"),
                          ("tokens_produced", "tokens generated on harvested capacity"),
                          ("harvest_cost", "harvested GPU-hours × spot_price_per_gpu_hour"),
                          ("cost_per_million_tokens", "harvest cost per million tokens produced there"),
                          ("saving_vs_on_demand", "harvested GPU-hours × (on-demand − spot price)")]:
            key = {"harvested_gpu_hours": "gpu_hours"}.get(name, name)
            g = GaugeMetricFamily(f"rlboost_scavenger_{name}", doc)
            g.add_metric([], float(s[key]))
            yield g
        for name, doc in [("submitted", "sbatch submissions"), ("cancelled", "scancel of surplus/finished jobs"),
                          ("signalled", "drain signals to surplus jobs"),
                          ("command_failures", "reconciliations ended by a failed Slurm command"),
                          ("reconciliations", "reconciliation steps"),
                          ("preemptions", "preemptions of our jobs (warned)"), ("requeues", "requeues of our jobs"),
                          ("attempts", "job attempts started (first starts + requeued restarts)")]:
            c = CounterMetricFamily(f"rlboost_scavenger_{name}", doc)
            c.add_metric([], float(s[name]))
            yield c
