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
    """Collector over the daemon's last reconciliation and the run's harvest statistics (the conventions of
    :class:`rlboost_hpc.observe.metrics.ManagerMetrics`: base units, ``_total`` counters, no sentinels, a ``run``
    label; ``rlboost_scavenger_jobs{state}`` holds parts — pending, running — that sum to the live jobs)."""

    def __init__(self, spot_price_per_gpu_hour: float = 0.0, on_demand_price_per_gpu_hour: float = 0.0,
                 run_id: str = "") -> None:
        super().__init__()
        self.spot_price, self.on_demand_price = spot_price_per_gpu_hour, on_demand_price_per_gpu_hour
        self.run_id = run_id
        self._totals = {"submitted": 0, "cancelled": 0, "signalled": 0, "command_failures": 0, "reconciliations": 0}

    def refresh(self, res, stats) -> None:
        """Record a :class:`~scavenger.daemon.ReconcileResult` and a :class:`~scavenger.stats.RunStats`."""
        t = self._totals
        t["submitted"] += len(res.submitted)
        t["cancelled"] += len(res.cancelled)
        t["signalled"] += len(res.signalled)
        t["command_failures"] += 0 if res.ok else 1
        t["reconciliations"] += 1
        gpu_s = stats.gpu_hours * 3600.0
        cost = stats.gpu_hours * self.spot_price
        snap = {
            "target": None if res.target is None else res.target.n,
            "run_active": 1 if res.target is None or res.target.active else 0,
            "desired": res.desired, "pending": res.pending, "running": res.running,
            "held": res.held, "leaving": res.draining, "idle_slots": res.free_slots,
            "ok": 1 if res.ok else 0, **t,
            "preemptions": stats.preemptions, "requeues": stats.requeues, "attempts": stats.attempts,
            "harvested_gpu_seconds": gpu_s, "tokens_produced": stats.tokens_produced,
            "harvest_cost_dollars": cost,
            "cost_per_token_dollars": (cost / stats.tokens_produced) if stats.tokens_produced else None,
            "saving_vs_on_demand_dollars": stats.gpu_hours * (self.on_demand_price - self.spot_price),
        }
        self.publish(snap)

    def collect(self):
        s = self.snapshot()
        if not s:
            return
        run = [self.run_id]
        jobs = GaugeMetricFamily("rlboost_scavenger_jobs", "our live rollout jobs by state (pending + running = live)",
                                 labels=["run", "state"])
        for k in ("pending", "running"):
            jobs.add_metric([self.run_id, k], s[k])
        yield jobs
        for name, doc, key in [
                ("rlboost_scavenger_jobs_leaving", "live jobs told to leave (drained or cancelled, not gone yet)",
                 "leaving"),
                ("rlboost_scavenger_jobs_held", "pending jobs held (only a release starts them)", "held"),
                ("rlboost_scavenger_target_jobs", "N_prem the run asks for (no sample: no target.json yet)", "target"),
                ("rlboost_scavenger_desired_jobs", "jobs the daemon aims for (target capped by max_jobs)", "desired"),
                ("rlboost_scavenger_idle_slots", "idle slots of the partition for one rollout job (no sample: not "
                 "checked)", "idle_slots"),
                ("rlboost_scavenger_run_active", "1 while the run wants rollout capacity", "run_active"),
                ("rlboost_scavenger_up", "1 if the last reconciliation's Slurm commands all succeeded", "ok"),
                ("rlboost_scavenger_cost_per_token_dollars", "harvest cost per token produced there (no sample: no "
                 "token yet)", "cost_per_token_dollars")]:
            if s[key] is None:
                continue
            g = GaugeMetricFamily(name, doc, labels=["run"])
            g.add_metric(run, float(s[key]))
            yield g
        for name, doc in [("submitted", "sbatch submissions"), ("cancelled", "scancel of surplus/finished jobs"),
                          ("signalled", "drain signals to surplus jobs"),
                          ("command_failures", "reconciliations ended by a failed Slurm command"),
                          ("reconciliations", "reconciliation steps"),
                          ("preemptions", "preemptions of our jobs (warned)"), ("requeues", "requeues of our jobs"),
                          ("attempts", "job attempts started (first starts + requeued restarts)"),
                          ("harvested_gpu_seconds", "GPU-seconds of rollout jobs on harvested capacity"),
                          ("tokens_produced", "tokens generated on harvested capacity"),
                          ("harvest_cost_dollars", "harvested GPU-hours x spot_price_per_gpu_hour"),
                          ("saving_vs_on_demand_dollars", "harvested GPU-hours x (on-demand - spot price)")]:
            c = CounterMetricFamily(f"rlboost_scavenger_{name}", doc, labels=["run"])
            c.add_metric(run, float(s[name]))
            yield c


class HarvestMetrics(SnapshotCollector):
    """Collector over the harvest service's last cycle (:class:`scavenger.harvest.CycleResult`): the pool, each
    run's demand and share (label ``run``), and run-wide counters. Same conventions as :class:`ScavengerMetrics`."""

    run_id = ""  # the service serves every run: no run label on its process metrics

    def __init__(self) -> None:
        super().__init__()
        self._totals = {"cycles": 0, "cycle_failures": 0, "slurm_listings": 0, "vanished_job_cancels": 0}
        self._report = None  # the last OwnersReport (the owners' delay, the harvest per run)
        self._last: dict = {}

    def refresh_report(self, rep) -> None:
        """Record a :class:`scavenger.harvest_report.OwnersReport` (published with the next cycle's figures)."""
        self._report = rep
        if self._last:
            self.publish({**self._last, "report": rep})

    def refresh(self, res) -> None:
        """Record one cycle's result."""
        t = self._totals
        t["cycles"] += 1
        t["cycle_failures"] += 0 if res.ok else 1
        t["slurm_listings"] += res.slurm_listings
        t["vanished_job_cancels"] += len(res.cancelled)
        self._last = {"ok": res.ok, "pool": res.pool_gpus, "idle": res.idle_gpus, "held": res.held_gpus,
                      "blackout": res.blackout, "shares": dict(res.shares), "demands": dict(res.demands), **t}
        self.publish({**self._last, "report": self._report})

    def collect(self):
        s = self.snapshot()
        if not s:
            return
        for name, doc, key in [("rlboost_harvest_pool_gpus", "GPUs the runs share this cycle (idle + held by their "
                                "rollout jobs, less the share left free; 0 in a blackout)", "pool"),
                               ("rlboost_harvest_idle_gpus", "idle GPUs of the harvested partitions", "idle"),
                               ("rlboost_harvest_held_gpus", "GPUs the runs' running rollout jobs hold", "held"),
                               ("rlboost_harvest_blackout", "1 inside a blackout window", "blackout"),
                               ("rlboost_harvest_up", "1 if the last cycle's Slurm listing succeeded", "ok")]:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(s[key]))
            yield g
        for name, doc, key in [("rlboost_harvest_share_instances", "rollout instances granted to the run", "shares"),
                               ("rlboost_harvest_demand_instances", "rollout instances the run asks for", "demands")]:
            g = GaugeMetricFamily(name, doc, labels=["run"])
            for run, v in sorted(s[key].items()):
                g.add_metric([run], float(v))
            yield g
        rep = s["report"]
        if rep is not None:
            g = GaugeMetricFamily("rlboost_harvest_owner_delay_seconds", "delay of owners' jobs that preempted "
                                  "rollout work (start - eligible) over the report window, by partition",
                                  labels=["partition", "quantile"])
            for part, st in sorted(rep.by_partition.items()):
                for q, v in (("0.5", st.p50_s), ("0.99", st.p99_s), ("1", st.max_s)):
                    g.add_metric([part, q], v)
            yield g
            g = GaugeMetricFamily("rlboost_harvest_owner_jobs_delayed", "owners' jobs that preempted rollout work "
                                  "over the report window, by partition", labels=["partition"])
            for part, st in sorted(rep.by_partition.items()):
                g.add_metric([part], float(st.jobs))
            yield g
            for name, doc, key in [("rlboost_harvest_run_gpu_seconds", "GPU-seconds of the run's rollout jobs over "
                                    "the report window (sacct)", "gpu_seconds"),
                                   ("rlboost_harvest_run_preemptions", "preemptions of the run's rollout jobs by "
                                    "owners' jobs over the report window", "preemptions")]:
                g = GaugeMetricFamily(name, doc, labels=["run"])
                for run, t in sorted(rep.by_run.items()):
                    g.add_metric([run], t.gpu_hours * 3600.0 if key == "gpu_seconds" else float(t.preemptions))
                yield g
        for name, doc in [("cycles", "service cycles"), ("cycle_failures", "cycles whose Slurm listing failed"),
                          ("slurm_listings", "Slurm listings (sinfo, squeue) made for all runs together"),
                          ("vanished_job_cancels", "scancels of rollout jobs of runs that stopped posting demand")]:
            c = CounterMetricFamily(f"rlboost_harvest_{name}", doc)
            c.add_metric([], float(s[name]))
            yield c
