"""The embedded local preemptible cluster: rollout-worker processes that come and go as a real spot trace says.

Stands in for Slurm + the scavenger on one machine (the local embedded default); nothing else in the
run changes. Invariants: workers are real OS processes (``python -m rlboost_hpc.rollout.worker``); a trace
``remove`` ends one with the warning signal (SIGTERM by default) or, for ``kill_fraction`` of removals,
SIGKILL without warning; each restart of a slot is a new attempt (new identity ``local-slot<k>#<attempt>``, case
S2); with ``cfg.preempt_when_busy`` a due removal waits (at most ``cfg.busy_wait_max_s``) until its worker holds a
partial response at the manager (a warned preemption scheduled by progress waits for such a worker as long as it
takes: it stays due); chaos faults (``cfg.faults``: ``stall_every_s``, ``link_reset_every_s``, ``slow_load_s``:
:mod:`rlboost_hpc.cluster.faults`) stall workers, reset their connections and slow their weight loads — by wall time,
and (``every_steps``, ``kinds``) by progress: one fault of each kind every k steps, kept due until it finds a target
(:meth:`LocalCluster.at_step`); :meth:`stop` continues every stalled worker and leaves no worker process behind.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from rlboost_hpc.cluster.faults import FaultPlan, StepFaults, TcpForwarder
from rlboost_hpc.cluster.replay import ReplayDriver
from rlboost_hpc.cluster.replay_plan import ReplayPlan, choose_window
from rlboost_hpc.cluster.traces import load_trace
from rlboost_hpc.config import ConfigError, ClusterCfg
from rlboost_hpc.events import LOCAL_CLUSTER_SOURCE, append_event, drain_marker_path, slow_load_marker_path
from rlboost_hpc.procutil import die_with_parent, hold_signals
from rlboost_hpc.protocol.identity import instance_ids, instance_key

log = logging.getLogger("rlboost.cluster")


def replay_plan(cfg: ClusterCfg) -> tuple[ReplayPlan, float]:
    """The replay plan of ``cfg`` and its trace window's start (seconds): deterministic, so the simulator can
    replay the same window a run saw (``sim/calibrate.py``).

    Raises:
        ConfigError: the settings ask for a window the trace does not have.
    """
    events = load_trace(cfg.trace)
    window_s = cfg.replay_s * cfg.time_scale
    slots = worker_slots(cfg)
    start = cfg.window_start_s
    if start is None:
        try:
            start = choose_window(events, window_s, cfg.min_changes, max_workers=slots,
                                  min_removals=cfg.min_removals, min_starts=cfg.min_starts)
        except ValueError as e:
            raise ConfigError(f"cluster.trace {cfg.trace}: {e}; lower cluster.min_changes / min_removals / "
                              "min_starts, or set cluster.window_start_s, max_workers or replay_s") from None
    plan = ReplayPlan.from_trace(events, window_start_s=start, window_s=window_s, time_scale=cfg.time_scale,
                                 max_workers=slots, kill_fraction=cfg.kill_fraction, seed=cfg.seed)
    return plan, start


def worker_slots(cfg: ClusterCfg) -> int:
    """Worker processes the trace is replayed onto: ``ceil(max_workers / instances_per_worker)`` (each hosts
    ``instances_per_worker`` rollout instances)."""
    return -(-cfg.max_workers // cfg.instances_per_worker)


class LocalCluster:
    """Replays ``cfg.trace`` compressed by ``cfg.time_scale`` onto at most ``cfg.max_workers`` instances.

    A slot is one worker process (a job) hosting ``cfg.instances_per_worker`` = K instances (K > 1: emulated ones);
    every count this cluster reports (offered, live, starts, preemptions, kills, exits) is in instances, K per slot,
    and a cap of n instances keeps ``ceil(n / K)`` slots.

    The replayed window is ``cfg.replay_s`` wall seconds long (``replay_s × time_scale`` trace seconds).
    ``partial_by_instance``: returns ``{instance key: partial responses it holds}`` from the manager (called from
    the cluster's thread, only while ``cfg.preempt_when_busy`` holds a removal back). ``instance_states``: returns
    ``{instance key: state}`` from the manager (called from the cluster's thread while a stall scheduled by progress
    is due: it stops an instance the manager has ready, so that its silence is the manager's to notice).
    """

    def __init__(self, cfg: ClusterCfg, manager_endpoint: str, run_dir: Path, *,
                 t_origin: float | None = None,
                 partial_by_instance: Callable[[], dict[str, int]] | None = None,
                 instance_states: Callable[[], dict[str, str]] | None = None) -> None:
        if cfg.preempt_when_busy and partial_by_instance is None:
            raise ValueError("cluster.preempt_when_busy needs the manager's view of partial responses")
        self.cfg = cfg
        self.partial_by_instance = partial_by_instance
        self.instance_states = instance_states
        self.manager_endpoint = manager_endpoint
        self.run_dir = Path(run_dir)  # workers find endpoints.json (and the run's keys) here, like Slurm jobs
        self.log_dir = Path(run_dir) / "workers"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.driver: ReplayDriver | None = None
        self._recorded = 0  # driver events already written to the run's event log
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.live_series: list[tuple[float, int]] = []  # (seconds since t_origin, live workers)
        self.t_origin = time.monotonic() if t_origin is None else t_origin
        f = cfg.faults
        self.faults = FaultPlan(f.stall_every_s, f.link_reset_every_s, f.slow_load_fraction if f.slow_load_s else 0.0,
                                seed=cfg.seed)
        self.fault_counts = {"stalls": 0, "link_resets": 0, "slow_load_attempts": 0, "slow_loads_scheduled": 0}
        self._stalled: list[tuple[float, int]] = []  # (continue at, pid)
        now = time.monotonic()
        self._next_stall = now + self.faults.next_gap(cfg.faults.stall_every_s)
        self._next_reset = now + self.faults.next_gap(cfg.faults.link_reset_every_s)
        self.step_faults = StepFaults(f.every_steps, tuple(f.kinds))
        self._slow_markers: dict[Path, int] = {}  # scheduled slow loads not taken yet: marker → its worker's pid
        self._frozen = False
        resets = f.link_reset_every_s > 0 or (f.every_steps > 0 and "link_reset" in f.kinds)
        self.link = TcpForwarder(manager_endpoint) if resets and cfg.max_workers else None
        if cfg.max_workers == 0:
            self.plan = None
            return
        self.plan, self.window_start_s = replay_plan(cfg)

    @staticmethod
    def job_id(slot: int) -> str:
        """The job id of the workers of ``slot`` (the manager's instance key is ``<job id>#<attempt>``, or
        ``<job id>.<i>#<attempt>`` for the instances of a process hosting several)."""
        return f"local-slot{slot}"

    def instance_ids(self, slot: int) -> list[str]:
        """The instance identities a worker of ``slot`` hosts (:func:`~rlboost_hpc.protocol.identity.instance_ids`)."""
        return instance_ids(self.job_id(slot), self.cfg.instances_per_worker)

    def _partial(self) -> dict[str, int]:
        """The manager's partial responses by instance key (one call); ``{}`` when it does not answer (a held
        removal keeps holding, bounded by max_hold_s; a scheduled preemption stays due)."""
        try:
            return self.partial_by_instance()
        except Exception as e:  # noqa: BLE001
            log.warning("cluster: cannot ask the manager which workers hold partial responses: %s", e)
            return {}

    def _holds(self, partial: dict[str, int], slot: int, attempt: int) -> bool:
        return any(partial.get(instance_key(i, attempt), 0) > 0 for i in self.instance_ids(slot))

    def _busy(self, slot: int, attempt: int) -> bool:
        return self._holds(self._partial(), slot, attempt)

    def _busy_slots(self, slots: list[int]) -> list[int]:
        """Those of ``slots`` whose live worker holds a partial response at the manager — one question to the
        manager for all of them."""
        attempts = self.driver.live_attempts()
        if not any(s in attempts for s in slots):
            return []
        partial = self._partial()
        return [s for s in slots if s in attempts and self._holds(partial, s, attempts[s])]

    def _spawn(self, slot: int, attempt: int) -> subprocess.Popen:
        logf = open(self.log_dir / f"slot{slot}-attempt{attempt}.log", "ab")
        cmd = [sys.executable, "-m", "rlboost_hpc.rollout.worker", "--run-dir", str(self.run_dir),
               "--job-id", self.job_id(slot), "--attempt", str(attempt), "--signal", self.cfg.preempt_signal]
        # every rollout setting comes from the run's worker spec in endpoints.json, as for Slurm rollout jobs
        if self.cfg.instances_per_worker > 1:
            cmd += ["--instances", str(self.cfg.instances_per_worker)]
        if self.link is not None:  # through the forwarder whose connections the chaos run resets
            cmd += ["--manager", self.link.endpoint]
        if self.faults.slow_load():
            cmd += ["--fault-load-delay-s", str(self.cfg.faults.slow_load_s)]
            self.fault_counts["slow_load_attempts"] += 1
        env = dict(os.environ, RLBOOST_SPAWNED_AT=repr(time.time()))
        warnings = {signal.SIGTERM, getattr(signal, self.cfg.preempt_signal)}

        cpus = self.cfg.worker_cpus

        def preexec() -> None:
            die_with_parent()  # the simulated cluster ends with the trainer process, even when it is SIGKILLed
            hold_signals(warnings)  # a preemption in the worker's first instants waits for its handler
            if cpus:  # the emulated preemptible nodes' own cores
                os.sched_setaffinity(0, cpus)

        try:
            return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    preexec_fn=preexec)
        finally:
            logf.close()

    def start(self) -> None:
        """Start replaying in a background thread (no-op with ``max_workers = 0``)."""
        if self.plan is None:
            return
        self.driver = ReplayDriver(self.plan, self._spawn, preempt_signal=getattr(signal, self.cfg.preempt_signal),
                                   fire_when=self._busy if self.cfg.preempt_when_busy else None,
                                   max_hold_s=self.cfg.busy_wait_max_s, before_retire=self._mark_drain)
        self.driver.start()
        self._thread = threading.Thread(target=self._loop, name="local-cluster", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        t0 = self.t_origin
        while not self._stop.is_set():
            with self._lock:
                try:
                    new = self.driver.poll()
                except Exception:  # a failed spawn is recorded by the driver; keep replaying
                    log.exception("cluster: spawning a worker failed")
                    new = []
                for ev in new:
                    if ev["action"] in ("start", "preempt", "kill", "exit", "spawn_failed"):
                        log.info("cluster: %s slot %s attempt %s pid %s exit %s held %.1fs", ev["action"],
                                 ev["slot"], ev["attempt"], ev["pid"], ev.get("exit_code"), ev.get("held_s", 0.0))
                self._record_lifecycle()
                self.live_series.append((time.monotonic() - t0, self.live()))
                self._inject_faults()
            self._stop.wait(0.1)

    def _mark_drain(self, slot: int, attempt: int) -> None:
        """A lowered cap retires this worker: its drain marker makes the warning count as a drain."""
        path = drain_marker_path(self.run_dir, self.job_id(slot))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    def _record_lifecycle(self) -> None:
        """Append the driver's new start/exit records to the run's event log as job life-cycle events (the same
        records the scavenger writes for Slurm jobs; a slot is a job, each spawn an attempt): ``started`` per
        attempt and exactly one terminal ``finished`` per attempt, with the Slurm-like state its end maps to —
        PREEMPTED (trace removal, warned or killed), CANCELLED (retired by the cap: a drain; or the run ended),
        COMPLETED / FAILED (it exited on its own)."""
        evs = self.driver.events
        for ev in evs[self._recorded:]:
            job = self.job_id(ev["slot"])
            try:
                if ev["action"] == "start":
                    drain_marker_path(self.run_dir, job).unlink(missing_ok=True)  # a new attempt is not drained
                for inst in self.instance_ids(ev["slot"]):  # one record per instance, as one per Slurm job
                    base = {"source": LOCAL_CLUSTER_SOURCE, "job_id": inst, "restart_cnt": ev["attempt"]}
                    if ev["action"] == "start":
                        append_event(self.run_dir, {"event": "started", **base, "gpus": 0, "node": "local",
                                                    "pid": ev["pid"]})
                    elif ev["action"] == "exit":
                        cause = ev.get("cause")
                        state = {"preempt": "PREEMPTED", "kill": "PREEMPTED", "retire": "CANCELLED",
                                 "stop": "CANCELLED"}.get(cause) or ("COMPLETED" if ev.get("exit_code") == 0
                                                                     else "FAILED")
                        append_event(self.run_dir, {"event": "finished", **base, "state": state,
                                                    "cause": {"retire": "drain", "stop": "run_end"}.get(cause, cause),
                                                    "exit_code": ev.get("exit_code")})
            except (OSError, ValueError) as e:  # statistics never stop the cluster
                log.warning("cluster: could not record %s of %s: %s", ev["action"], job, e)
        self._recorded = len(evs)

    def _inject_faults(self) -> None:
        """Chaos (cluster/faults.py): continue stalls that are over, start a stall or a link reset when due."""
        now = time.monotonic()
        for until, pid in [x for x in self._stalled if x[0] <= now]:
            self._signal(pid, signal.SIGCONT)
            self._stalled.remove((until, pid))
        if now >= self._next_stall:
            self._next_stall = now + self.faults.next_gap(self.cfg.faults.stall_every_s)
            stalled = {pid for _, pid in self._stalled}
            pids = [p for p in self.driver.live_pids().values() if p is not None and p not in stalled]
            if pids:
                pid = self.faults.rng.choice(pids)
                if self._signal(pid, signal.SIGSTOP):
                    self._stalled.append((now + self.cfg.faults.stall_s, pid))
                    self.fault_counts["stalls"] += 1
                    log.info("cluster: stalled pid %d for %.1f s", pid, self.cfg.faults.stall_s)
        if self.link is not None and now >= self._next_reset:
            self._next_reset = now + self.faults.next_gap(self.cfg.faults.link_reset_every_s)
            if self.link.reset():
                self.fault_counts["link_resets"] += 1
        if not self._frozen:
            self._inject_scheduled(now)

    def _ready(self, slots: list[int]) -> list[int]:
        """Those of ``slots`` whose instance the manager has ready (all of them without ``instance_states``; none
        when the manager does not answer — it may be restarting: the fault stays due)."""
        if self.instance_states is None:
            return slots
        try:
            states = self.instance_states()
        except Exception as e:  # noqa: BLE001 - the manager may be restarting: try again on the next round
            log.debug("cluster: no instance states from the manager: %s", e)
            return []
        attempts = self.driver.live_attempts()
        return [s for s in slots if states.get(instance_key(self.instance_ids(s)[0], attempts.get(s, -1))) == "ready"]

    def at_step(self, step: int) -> None:
        """The run reached step boundary ``step`` (the next step): faults scheduled by progress become due
        (:class:`~rlboost_hpc.cluster.faults.StepFaults`); the cluster's thread injects them."""
        with self._lock:
            self.step_faults.at_step(step)

    def _inject_scheduled(self, now: float) -> None:
        """Every fault :attr:`step_faults` has due, each on a live worker the seeded RNG picks; one that finds no
        target stays due. A scheduled slow load is injected once its worker took it (removed the marker at its
        next weight load); one whose worker ended first is withdrawn and placed again."""
        live_pids = self.driver.live_pids()
        for path, pid in list(self._slow_markers.items()):
            if not path.exists():
                del self._slow_markers[path]
                self.fault_counts["slow_loads_scheduled"] += 1
                self.step_faults.done("slow_load")
            elif pid not in live_pids.values():
                path.unlink(missing_ok=True)
                del self._slow_markers[path]
        stalled = {pid for _, pid in self._stalled}
        live = {slot: pid for slot, pid in live_pids.items() if pid is not None and pid not in stalled}
        marked = set(self._slow_markers.values())  # not ended until its slow load is taken
        # the faults that leave their worker alive first: a slow load needs its worker until its next load, and an
        # ended worker's replacement is not yet one the manager has ready (what a stall must stop); the stall picks
        # first, as it can take only a ready worker (on a loaded host few are: a slow load picking first took the
        # only one round after round — a CI run under two test workers injected 0 stalls in 20 steps)
        order = {"stall": 0, "slow_load": 1, "link_reset": 2, "kill": 3, "preempt": 4}
        for kind in sorted(self.step_faults.pending(), key=order.__getitem__):
            if kind == "link_reset":
                if self.link is not None and self.link.reset():
                    self.fault_counts["link_resets"] += 1
                    self.step_faults.done(kind)
                continue
            targets = sorted(s for s, p in live.items() if kind == "stall" or p not in marked)
            if kind == "stall":
                targets = self._ready(targets)
            elif kind == "preempt" and self.cfg.preempt_when_busy:  # a warning that hands tokens off, as the trace's
                targets = self._busy_slots(targets)
            if not targets:
                continue
            slot = self.faults.rng.choice(targets)
            pid = live.pop(slot)  # one fault per worker per round
            if kind in ("preempt", "kill"):
                if self.driver.end_now(slot, kind):
                    log.info("cluster: scheduled %s of slot %d (pid %d)", kind, slot, pid)
                    self.step_faults.done(kind)
            elif kind == "stall":
                if self._signal(pid, signal.SIGSTOP):
                    self._stalled.append((now + self.cfg.faults.stall_s, pid))
                    self.fault_counts["stalls"] += 1
                    self.step_faults.done(kind)
                    log.info("cluster: scheduled stall of pid %d for %.1f s", pid, self.cfg.faults.stall_s)
            elif kind == "slow_load" and len(self._slow_markers) < self.step_faults.due[kind]:
                attempt = self.driver.live_attempts()[slot]
                path = slow_load_marker_path(self.run_dir, instance_key(self.instance_ids(slot)[0], attempt))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(repr(self.cfg.faults.slow_load_s))
                self._slow_markers[path] = pid  # injected once taken (above)
                marked.add(pid)
                log.info("cluster: scheduled a slow weight load (%.1f s) on slot %d", self.cfg.faults.slow_load_s,
                         slot)

    @staticmethod
    def _signal(pid: int, sig: int) -> bool:
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False

    def set_cap(self, n: int | None) -> None:
        """Obey an instance cap (N_prem): never more than ``n`` live instances — in whole worker processes of K
        instances, so ``ceil(n / K)`` of them (at most K − 1 instances over ``n``)."""
        if self.driver is not None:
            with self._lock:
                self.driver.set_cap(None if n is None else -(-n // self.cfg.instances_per_worker))

    def offered(self) -> int:
        """Instances the replayed trace offers now (live or held back by the cap): the cluster's capacity."""
        return len(self.driver.offered_slots()) * self.cfg.instances_per_worker if self.driver else 0

    def live(self) -> int:
        """Instances of the live worker processes."""
        return len(self.driver.live_slots()) * self.cfg.instances_per_worker if self.driver else 0

    def freeze(self, settle_s: float = 10.0) -> None:
        """Replay no more of the trace (no start, preemption or kill from now on) and wait up to ``settle_s`` until
        every worker already warned or killed has exited — so the report's counts of the cluster's faults and the
        manager's view of them describe the same events (a preemption fired during the final evaluation was
        counted by the cluster but not yet by the manager). The workers alive keep serving."""
        if self.driver is None:
            return
        with self._lock:
            self.driver.freeze()
            self._frozen = True  # no fault scheduled by progress either
        deadline = time.monotonic() + settle_s
        while self.driver.dying_pids() and time.monotonic() < deadline and self._thread is not None \
                and self._thread.is_alive():
            time.sleep(0.05)  # the replay thread reaps them

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop replaying and end every worker (warning first, SIGKILL after ``grace_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for _, pid in self._stalled:  # a stopped process cannot exit on its warning
            self._signal(pid, signal.SIGCONT)
        self._stalled.clear()
        for path in self._slow_markers:  # scheduled slow loads no worker took
            path.unlink(missing_ok=True)
        self._slow_markers.clear()
        if self.link is not None:
            self.link.close()
        if self.driver is not None:
            with self._lock:
                for slot in self.driver.live_slots():  # the run ends: a drain, not a preemption
                    self._mark_drain(slot, 0)
                self.driver.stop_all(grace_s)
                self._record_lifecycle()

    def summary(self) -> dict:
        """Counts of what the cluster did, in instances: starts, preemptions with warning, kills without warning,
        exits."""
        if self.driver is None:
            return {"starts": 0, "preemptions_warned": 0, "kills": 0, "exits": 0, "window_start_s": None,
                    **self.fault_counts, "scheduled": dict(self.step_faults.injected)}
        c, k = self.driver.counts, self.cfg.instances_per_worker
        return {"starts": k * c["start"], "preemptions_warned": k * c["preempt"], "kills": k * c["kill"],
                "exits": k * c["exit"],
                "window_start_s": self.window_start_s, "plan_actions": len(self.plan), **self.fault_counts,
                "scheduled": dict(self.step_faults.injected)}
