"""Prometheus metrics of the rollout manager (prometheus-client), served over HTTP.

Invariant: the HTTP thread never touches the manager's live state — it reads a snapshot that the manager's own
loop refreshes (:meth:`ManagerMetrics.refresh`), so a scrape can neither block nor race the token path.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

COUNTERS = {
    "tokens_received": "tokens streamed into the manager",
    "responses_migrated": "unfinished responses moved to another instance (seeds, preemptions, releases)",
    "tokens_migrated": "generated tokens carried over by migrations",
    "tokens_regenerated": "tokens lost with an instance (unsent at a kill) and generated again",
    "instances_preempted_with_warning": "instances that deregistered after a preemption warning",
    "instances_time_limit": "instances that deregistered because their job reached its time limit",
    "instances_drained": "instances retired on purpose (scavenger drain, lowered cap, run end)",
    "instances_suspected": "instances that went silent past the heartbeat deadline (taken out of routing)",
    "instances_recovered": "suspect instances that spoke again and returned without re-registering",
    "instances_fenced": "instances fenced (bad version, bad delta, failed weight load)",
    "weight_loads": "complete, verified weight versions loaded by instances",
    "weight_load_failures": "failed weight pulls or loads",
    "dispatched": "request dispatches",
    "responses_delivered": "responses delivered to the trainer",
    "protocol_rejects": "frames rejected by schema or from unknown peers",
    "late_tokens": "tokens dropped because their request had moved on",
    "balancer_moves": "running requests released by the continuous balancer (beyond a learned plateau)",
}


class SnapshotCollector:
    """Base of our collectors: the owner's loop publishes a dict snapshot; scrapes read a copy of it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap: dict = {}

    def publish(self, snap: dict) -> None:
        """Replace the snapshot (called by the owner's loop)."""
        with self._lock:
            self._snap = snap

    def snapshot(self) -> dict:
        """A copy of the last snapshot (``{}`` before the first :meth:`publish`)."""
        with self._lock:
            return dict(self._snap)


class ManagerMetrics(SnapshotCollector):
    """Collector over a stats snapshot (``ManagerCore.stats()``, whose ``instances`` has per-instance details)."""

    def refresh(self, core) -> None:
        """Take a snapshot of ``core`` (call from the manager's loop)."""
        snap = core.stats()
        snap["pull_seconds_sum"] = float(sum(core.pull_seconds))
        snap["pull_seconds_count"] = len(core.pull_seconds)
        self.publish(snap)

    def collect(self):
        s = self.snapshot()
        if not s:
            return
        for name, doc in COUNTERS.items():
            c = CounterMetricFamily(f"rlboost_{name}", doc)
            c.add_metric([], float(s.get(name, 0)))
            yield c
        g = GaugeMetricFamily("rlboost_instances", "rollout instances by kind and state", labels=["kind", "state"])
        counts: dict[tuple[str, str], int] = {}
        for i in s["instances"].values():
            counts[(i["kind"], i["state"])] = counts.get((i["kind"], i["state"]), 0) + 1
        for (kind, state), n in counts.items():
            g.add_metric([kind, state], n)
        yield g
        v = GaugeMetricFamily("rlboost_instance_weight_version", "weight version held per instance", labels=["instance"])
        q = GaugeMetricFamily("rlboost_instance_inflight", "requests in flight per instance", labels=["instance"])
        for key, i in s["instances"].items():
            v.add_metric([key], i["version"])
            q.add_metric([key], i["inflight"])
        yield v
        yield q
        for name, doc, val in [
            ("rlboost_latest_weight_version", "latest published weight version", s["latest_version"]),
            ("rlboost_step", "current RL step", s["step"]),
            ("rlboost_queue_depth", "requests waiting at the manager", s["queued"]),
            ("rlboost_running_requests", "requests running on instances", s["running"]),
            ("rlboost_instances_lost", "instances that went silent and have not come back (lost without warning)",
             s["instances_lost"]),
            ("rlboost_t_seed_seconds", "seeding window T_seed in force", s.get("t_seed_s") or 0.0),
            ("rlboost_n_prem_cap", "N_prem: cap on preemptible instances (-1: none)",
             -1 if s.get("n_prem_cap") is None else s["n_prem_cap"]),
        ]:
            m = GaugeMetricFamily(name, doc)
            m.add_metric([], float(val))
            yield m
        p = CounterMetricFamily("rlboost_weight_pull_seconds", "weight pull durations (sum, count)")
        p.add_metric(["sum"], s["pull_seconds_sum"])
        yield p
        pc = CounterMetricFamily("rlboost_weight_pulls", "weight pulls reported")
        pc.add_metric([], s["pull_seconds_count"])
        yield pc


def serve_metrics(collector, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
    """Serve ``collector`` at ``http://host:port/metrics`` (port 0: a free one). Returns (host, port)."""
    reg = CollectorRegistry()
    reg.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=reg)
    return host, server.server_port
