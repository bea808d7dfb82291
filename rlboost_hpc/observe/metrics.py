"""Prometheus metrics of the rollout manager (prometheus-client), served over HTTP.

Invariant: the HTTP thread never touches the manager's live state — it reads a snapshot that the manager's own
loop refreshes (:meth:`ManagerMetrics.refresh`), so a scrape can neither block nor race the token path.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from rlboost_hpc.observe.histogram import Histogram
from rlboost_hpc.protocol.stats import ManagerStats

COUNTERS = {
    "tokens_received": "tokens streamed into the manager",
    "tokens_received_preemptible": "tokens streamed into the manager by preemptible instances (harvested capacity)",
    "messages_received": "messages the manager received from rollout instances (every kind; per token: the "
                         "control plane's cost driver)",
    "messages_sent": "messages the manager sent to rollout instances (every kind)",
    "responses_migrated": "unfinished responses moved to another instance (seeds, preemptions, releases)",
    "tokens_migrated": "generated tokens carried over by migrations",
    "tokens_regenerated": "tokens lost with an instance (unsent at a kill) and generated again",
    "instances_preempted_with_warning": "instances that deregistered after a preemption warning",
    "instances_time_limit": "instances that deregistered because their job reached its time limit",
    "instances_drained": "instances retired on purpose (scavenger drain, lowered cap, run end)",
    "instances_suspected": "instances that went silent past the heartbeat deadline (taken out of routing)",
    "instances_recovered": "suspect instances that spoke again and returned without re-registering",
    "responses_assigned_to_vanished": "responses assigned to an instance after its last message and taken back "
                                      "when it was suspected (work handed to a node that had already vanished)",
    "instances_fenced": "instances fenced (bad version, bad delta, failed weight load)",
    "weight_loads": "complete, verified weight versions loaded by instances",
    "weight_load_failures": "failed weight pulls or loads",
    "weight_checksum_mismatches": "weight loads whose checksum differs from the trainer's manifest (instance drained)",
    "weight_loads_of_another_lineage": "weight versions loaded that the current trainer lineage never made (after "
                                       "a resume from an older checkpoint; never routed to)",
    "weight_pulled_bytes": "bytes instances received for weight versions (delta pulls count their payloads)",
    "emulated_modelled_seconds": "wall seconds the emulated engines' profile asked for (rollout.engine = emulated)",
    "emulated_late_seconds": "wall seconds emulated engines ran behind their profile (a host slower than the profile)",
    "base_loads_from_path": "LoRA: bases instances loaded from model.path on their node (no network bytes)",
    "base_loads_from_cache": "LoRA: bases instances loaded from their node's cache of an earlier pull",
    "base_loads_pulled": "LoRA: bases instances pulled from the trainer's base server (kept in the node's cache)",
    "base_loads_in_trainer": "LoRA: bases the reserved engine took from the trainer's memory",
    "base_pulled_bytes": "LoRA: bytes instances received pulling the base",
    "dispatched": "request dispatches",
    "responses_delivered": "responses delivered to the trainer",
    "protocol_rejects": "frames rejected by schema or from unknown peers",
    "late_tokens": "tokens dropped because their request had moved on",
    "balancer_moves": "running requests released by the continuous balancer (beyond a learned plateau)",
    "turns_completed": "assistant turns finished (a single-turn response is one turn)",
    "environment_calls": "tool calls of multi-turn trajectories sent to the environment",
    "environment_errors": "tool calls answered with an error observation (malformed call, failing tool)",
    "environment_timeouts": "tool calls past their deadline (worker replaced; an error observation continues)",
    "environment_seconds": "seconds tool calls took (summed over calls)",
    "environment_replays": "stateful environments rebuilt by replaying their trajectory (a worker replaced, a "
                           "manager restarted)",
    "observation_tokens": "observation tokens appended to trajectories (never trained)",
}


#: The trainer's per-step engine–trainer mismatch (``metrics.jsonl`` key → gauge of its last step).
MISMATCH_GAUGES = (
    ("logprob_diff", "rlboost_step_logprob_diff_nats",
     "last step: mean |trainer logprob − engine (behaviour) logprob| per generated token"),
    ("logprob_diff_max", "rlboost_step_logprob_diff_max_nats",
     "last step: largest |trainer logprob − engine (behaviour) logprob| of a generated token"),
    ("mismatch_kl", "rlboost_step_mismatch_kl_nats",
     "last step: k3 estimate (bounded) of KL(engine policy ‖ trainer policy) per generated token"),
    ("mismatch_outside_clip_share", "rlboost_step_mismatch_outside_clip_ratio",
     "last step: share of generated tokens whose ratio trainer/engine probability leaves the PPO clip band"),
    ("mismatch_capped_share", "rlboost_step_mismatch_capped_ratio",
     "last step: share of importance-correction units (tokens or responses) whose ratio exceeds trainer.behaviour_cap"),
    ("behaviour_ess", "rlboost_step_behaviour_ess_ratio",
     "last step: effective sample size of the importance weights, (sum w)^2 / sum w^2, divided by the units"),
    ("behaviour_dropped_share", "rlboost_step_behaviour_dropped_ratio",
     "last step: share of importance-correction units MIS dropped (weight 0 past trainer.behaviour_cap)"),
)


class SnapshotCollector:
    """Base of our collectors: the owner's loop publishes a snapshot (an object it no longer changes); scrapes
    read that object."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap: Any = None

    def publish(self, snap: Any) -> None:
        """Replace the snapshot (called by the owner's loop; the owner must not change ``snap`` afterwards)."""
        with self._lock:
            self._snap = snap

    def snapshot(self) -> Any:
        """The last published snapshot (``None`` before the first :meth:`publish`)."""
        with self._lock:
            return self._snap


@dataclass(frozen=True)
class _ManagerSnapshot:
    """What one scrape reads: the manager's stats, its step / pull durations and instance silences (seconds)."""

    stats: ManagerStats
    pull_seconds: Histogram
    full_pull_seconds: Histogram
    step_seconds: Histogram
    silence_seconds: Histogram
    version_serving_seconds: Histogram
    step_phase_s: dict[str, float]
    step_fixed_overhead_s: float


class ManagerMetrics(SnapshotCollector):
    """Collector over a stats snapshot (``ManagerCore.stats()``, whose ``instances`` has per-instance details).

    Conventions (Prometheus'): base units in names (``_seconds``), counters end in ``_total``, durations are
    Histograms, no sentinel values (a value that does not exist yet has no sample), every series carries the
    ``run`` label, per-instance series label the instance ``rollout_instance`` (``instance`` is Prometheus' own
    target label), and a labelled metric holds parts that sum to a whole, never the whole beside its parts.
    """

    def __init__(self, run_id: str = "") -> None:
        super().__init__()
        self.run_id = run_id

    def refresh(self, core) -> None:
        """Take a snapshot of ``core`` (call from the manager's loop)."""
        d = core.dist
        self.publish(_ManagerSnapshot(stats=core.stats(), pull_seconds=d.pull_seconds.copy(),
                                      full_pull_seconds=d.full_pull_seconds.copy(),
                                      step_seconds=d.step_seconds.copy(), silence_seconds=d.silence_seconds.copy(),
                                      version_serving_seconds=d.version_serving_seconds.copy(),
                                      step_phase_s=dict(core.step_account.phase_s),
                                      step_fixed_overhead_s=core.step_account.fixed_overhead_s))

    def collect(self):
        snap = self.snapshot()
        if snap is None:
            return
        s = snap.stats
        run = [self.run_id]
        for name, doc in COUNTERS.items():
            c = CounterMetricFamily(f"rlboost_{name}", doc, labels=["run"])
            c.add_metric(run, float(getattr(s, name)))
            yield c
        g = GaugeMetricFamily("rlboost_instances", "rollout instances by kind and state (parts of the whole)",
                              labels=["run", "kind", "state"])
        counts: dict[tuple[str, str], int] = {}
        for i in s.instances.values():
            counts[(i.kind, i.state)] = counts.get((i.kind, i.state), 0) + 1
        for (kind, state), n in counts.items():
            g.add_metric([self.run_id, kind, state], n)
        yield g
        v = GaugeMetricFamily("rlboost_instance_weight_version", "weight version held per rollout instance",
                              labels=["run", "rollout_instance"])
        q = GaugeMetricFamily("rlboost_instance_inflight_requests", "requests in flight per rollout instance",
                              labels=["run", "rollout_instance"])
        for key, i in s.instances.items():
            if i.version >= 0:  # no version loaded yet: no sample
                v.add_metric([self.run_id, key], i.version)
            q.add_metric([self.run_id, key], i.inflight)
        yield v
        yield q
        for name, doc, val in [
            ("rlboost_latest_weight_version", "latest published weight version", s.latest_version),
            ("rlboost_step", "current RL step", s.step),
            ("rlboost_queued_requests", "requests waiting at the manager", s.queued),
            ("rlboost_running_requests", "requests running on instances", s.running),
            ("rlboost_instances_lost", "instances that went silent and have not come back (lost without warning)",
             s.instances_lost),
            ("rlboost_t_seed_seconds", "seeding window T_seed in force", s.t_seed_s),
            ("rlboost_n_prem_cap", "N_prem: the cap on preemptible instances (no sample: no cap)", s.n_prem_cap),
        ]:
            if val is None or (name in ("rlboost_latest_weight_version", "rlboost_step") and val < 0):
                continue  # does not exist yet: no sample, never a sentinel
            m = GaugeMetricFamily(name, doc, labels=["run"])
            m.add_metric(run, float(val))
            yield m
        yield _histogram("rlboost_weight_pull_duration_seconds",
                         "verified weight pulls by duration (pull + verify + load)", run, snap.pull_seconds)
        yield _histogram("rlboost_weight_full_pull_duration_seconds", "of them, the pulls that moved the whole "
                         "version (no delta: first pulls, pulls without a usable base)", run, snap.full_pull_seconds)
        yield _histogram("rlboost_step_duration_seconds", "RL steps by wall time", run, snap.step_seconds)
        yield _histogram("rlboost_instance_silence_seconds", "silences between a rollout instance's messages longer "
                         "than two heartbeat intervals, measured when it spoke again (what heartbeat_timeout_s is "
                         "chosen from)", run, snap.silence_seconds)
        yield _histogram("rlboost_version_serving_seconds", "seconds from a weight version's SetVersion until each "
                         "preemptible instance live at that moment loaded it", run, snap.version_serving_seconds)
        yield self._counter_by("rlboost_step_phase_seconds", "trainer step wall time by phase (parts of the steps' "
                               "wall time)", "phase", snap.step_phase_s)
        fo = CounterMetricFamily("rlboost_step_fixed_overhead_seconds", "step wall time in which no engine "
                                 "generated and the trainer did not compute", labels=["run"])
        fo.add_metric(run, float(snap.step_fixed_overhead_s))
        yield fo
        yield self._counter_by("rlboost_migrations_by_turn", "partial responses migrated, by the index of the "
                               "assistant turn they were in (0 = the first)", "turn", s.migrations_by_turn)
        yield self._counter_by("rlboost_responses_truncated", "finished responses cut by a budget, by cause (length: "
                               "rollout.max_new_tokens; turn_cap: task.turns.max; trajectory_budget: "
                               "task.turns.max_tokens; environment_error)", "cause", s.responses_truncated_by_cause)
        yield from self._mismatch(s.last_step_mismatch)
        if s.last_step_rewards:  # a user's task (TRL's rewards/<name>)
            g = GaugeMetricFamily("rlboost_step_reward", "mean value of each reward function (and reward model) "
                                  "over the trainer's last step", labels=["run", "function"])
            for name, v in sorted(s.last_step_rewards.items()):
                g.add_metric([self.run_id, name], float(v))
            yield g
        yield from self._heldout(s)
        yield self._counter_by("rlboost_rollout_instance_seconds", "instance-seconds of all rollout instances by "
                               "activity (busy, idle, pulling)", "activity", s.instance_activity_s)
        per = CounterMetricFamily("rlboost_instance_activity_seconds", "seconds per live rollout instance by "
                                  "activity (busy, idle, pulling)", labels=["run", "rollout_instance", "activity"])
        for key, i in s.instances.items():
            for a, sec in sorted(i.activity_s.items()):
                per.add_metric([self.run_id, key, a], sec)
        yield per

    def _heldout(self, s: ManagerStats):
        """Gauges of the run's held-out evaluations (``when``: before = the starting policy, after = the trained
        one): the mean reward by decoding and the unbiased pass@k by k (no sample before the first evaluation)."""
        if not s.heldout:
            return
        r = GaugeMetricFamily("rlboost_heldout_reward", "mean reward of the held-out evaluation by when (before: "
                              "the starting policy, after: the trained one) and decoding (sampled, greedy)",
                              labels=["run", "when", "decoding"])
        p = GaugeMetricFamily("rlboost_heldout_pass_at_k_ratio", "unbiased pass@k of the held-out evaluation "
                              "(Chen et al. 2021; trainer.eval_pass_k) by when and k", labels=["run", "when", "k"])
        v = GaugeMetricFamily("rlboost_heldout_weight_version", "weight version the held-out evaluation ran",
                              labels=["run", "when"])
        for when, e in sorted(s.heldout.items()):
            r.add_metric([self.run_id, when, "sampled"], e.reward_sampled)
            r.add_metric([self.run_id, when, "greedy"], e.reward_greedy)
            for k, x in sorted(e.pass_at_k.items(), key=lambda kv: int(kv[0])):
                p.add_metric([self.run_id, when, k], x)
            v.add_metric([self.run_id, when], e.version)
        yield from (r, p, v)

    def _mismatch(self, last: dict[str, float]):
        """Gauges of the trainer's last step's engine–trainer mismatch (no sample before the first step)."""
        for key, name, doc in MISMATCH_GAUGES:
            if key in last:
                g = GaugeMetricFamily(name, doc, labels=["run"])
                g.add_metric([self.run_id], float(last[key]))
                yield g

    def _counter_by(self, name: str, doc: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["run", label])
        for key, val in sorted(values.items()):
            c.add_metric([self.run_id, key], val)
        return c


def _histogram(name: str, doc: str, run: list[str], hist: Histogram):
    h = HistogramMetricFamily(name, doc, labels=["run"])
    h.add_metric(run, hist.cumulative(), float(hist.total))
    return h


class ProcessMetrics:
    """The serving process's own resources — prometheus_client's ``ProcessCollector`` (``process_cpu_seconds_total``,
    ``process_resident_memory_bytes``, ``process_open_fds``, ``process_max_fds``, ``process_start_time_seconds``,
    virtual memory) — each sample labelled with the ``run``, as every series of this project is."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._inner = ProcessCollector(registry=None)

    def collect(self):
        for fam in self._inner.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for smp in fam.samples:
                out.add_sample(smp.name, {**smp.labels, "run": self.run_id}, smp.value, smp.timestamp, smp.exemplar)
            yield out


def serve_metrics(collector, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
    """Serve ``collector`` (it has a ``run_id``) and the process's own resources (:class:`ProcessMetrics`) at
    ``http://host:port/metrics`` (port 0: a free one). Returns (host, port)."""
    reg = CollectorRegistry()
    reg.register(collector)
    reg.register(ProcessMetrics(collector.run_id))
    server, _thread = start_http_server(port, addr=host, registry=reg)
    return host, server.server_port
