"""The scavenger daemon: keeps the number of live rollout jobs at the target the run publishes.

One :meth:`Scavenger.reconcile_once` step:

1. read the target (``RUN_DIR/target.json``, :class:`rlboost_hpc.rundir.TargetFile`; missing → 0: nothing is
   submitted before the run says how many jobs of which size; unreadable → keep the last good target and submit
   nothing new); a ``gpus_per_instance`` from the run replaces ``gpus_per_job`` (jobs are submitted with the run's
   instance size);
2. list OUR jobs — those whose ``--comment`` equals the run's tag — in every state (so a restarted daemon
   reconciles with what is already queued; with ``trainer_job``, the trainer job too), and log every lifecycle
   change it sees to ``RUN_DIR/events.jsonl`` (:mod:`scavenger.job_log`); write the capacity view
   (``RUN_DIR/capacity.json``: live jobs not leaving + idle slots of the partition) that the trainer's N_prem cap
   is clamped to;
3. cancel surplus jobs (target dropped), newest pending first, then newest running: a running job first gets
   the warning signal on its batch shell (``scancel --signal=USR2 --batch``) and a drain marker, so it can hand
   off its tokens and exit; if it is still alive ``grace_s`` later, a plain ``scancel``. ``active: false`` — or
   a trainer job that has ended while the target still says active (it failed or was cancelled) — → plain
   ``scancel`` of everything at once (the run is over);
4. submit the missing jobs, never more than the partition's idle capacity allows — none while the trainer job
   waits (pending or held: not started, or requeued): no manager serves them; once it has waited
   ``trainer_pending_release_s`` its live rollout jobs are cancelled too (under the harvest service it asks for
   none), and the run's target holds again when it runs.

With ``harvest_dir`` (the cluster's harvest service, :mod:`scavenger.harvest`) step 2 posts the run's demand — the
rollout jobs the run could use (``target.json``'s ``wanted``: the N_prem law before its clamp to capacity, within
``max_jobs``), never its clamped target, which would tie the demand to the share it asks for — and reads its share
instead of listing Slurm: the share's listing of the run's jobs (and of its trainer job) replaces ``squeue``, the
share replaces the idle slots (desired ≤ share; ``capacity.json`` = live jobs + share − live jobs), and the daemon
acts only on a listing taken after its last action. Without a fresh share (the service is down) it lists its own
jobs, submits nothing new and still cancels what the run no longer wants. Why the run keeps fewer jobs than it
asks for (no target yet, a stale share, a share below the ask and the service's reason, no idle slot) is logged
once per change.

Invariants:

* desired = 0 if not active else min(n_prem, max_jobs); live jobs (pending, running, requeued, completing)
  minus those already draining are what is compared with it; a draining job is never counted twice.
* Submissions never exceed capacity: pending_ours + new ≤ Σ_nodes ⌊free_gpus / gpus_per_job⌋ (free CPUs for
  CPU-only jobs) over usable nodes of the partition; our running jobs already hold their GPUs, so the
  effective target is min(desired, running_ours + free slots). Pending jobs beyond capacity that already
  exist (e.g. requeued after a preemption) are kept: they start when capacity returns.
* Every sbatch/scancel is preceded by a fresh listing in the same step; a job is counted from the listing,
  never from memory, so a crash between sbatch and the event write cannot cause a duplicate.
* One event per observed change, also across daemon restarts (:mod:`scavenger.job_log`).
* A failing Slurm command aborts the step (nothing after it runs), is logged as one line, and the next step
  comes after an exponential backoff (``poll_s`` · 2^k, at most ``max_backoff_s``). Rollout jobs that FAIL
  within a minute of starting pause submissions (``failed_job_backoff_s`` · 2^k) so a broken script does not
  become a submission storm.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from scavenger.config import ScavengerConfig, ScavengerConfigError, time_limit_seconds
from scavenger.harvest import HarvestLink
from scavenger.job_log import VANISH_AFTER, JobLog, JobTrack
from rlboost_hpc.events import drain_marker_path
from rlboost_hpc.rundir import CapacityView, RunDir, RunDirError
from scavenger.pyslurm_api import slurm_api
from scavenger.slurm import SlurmCommandError
from scavenger.slurm_records import JobClass, JobInfo, NodeInfo, job_number, signal_number
from scavenger.stats import RECONCILE_LOG, load_run_stats
from scavenger.tracking import ScavengerTracking

log = logging.getLogger("scavenger")


#: Job classes (``scavenger.slurm_records.classify_job``) that wait for resources: they hold no allocation yet.
WAITING = frozenset({JobClass.PENDING, JobClass.HELD})
#: A FAILED attempt shorter than this (seconds) counts toward the crash-loop pause.
QUICK_FAILURE_S = 60.0
#: An unchanged view is still logged this often (seconds), so a plot shows it held.
VIEW_EVERY_S = 30.0


class SlurmAPI(Protocol):
    """What the daemon needs from a Slurm client (:class:`scavenger.slurm.SlurmClient` and test doubles)."""

    def sinfo_nodes(self, partition: str | None = None) -> list[NodeInfo]: ...
    def squeue_jobs(self, name_prefix: str | None = None, comment_tag: str | None = None,
                    all_states: bool = False, only_mine: bool = True) -> list[JobInfo]: ...
    def sbatch(self, script_path: Any, args: Any = (), env: Any = None) -> str: ...
    def scancel(self, job_ids: Any, signal: str | None = None, batch: bool = False) -> None: ...


class Clock(Protocol):
    def time(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Wall clock; :meth:`sleep` returns early when :meth:`wake` is called (daemon stop)."""

    def __init__(self) -> None:
        self._wake = threading.Event()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        self._wake.wait(max(0.0, seconds))

    def wake(self) -> None:
        self._wake.set()


@dataclass(frozen=True)
class Target:
    """The run's wish: ``n`` live rollout jobs while ``active``; ``wanted`` how many it could use (what it asks the
    harvest service for: the N_prem law before the clamp to the capacity it was offered, ``n`` when the run does not
    say). ``source``: file | default | last_good."""

    n: int
    active: bool
    source: str
    gpus_per_instance: int | None = None
    wanted: int | None = None

    @property
    def asks(self) -> int:
        """Rollout jobs the run could use (``wanted``, else ``n``); 0 once the run is over."""
        return 0 if not self.active else self.n if self.wanted is None else self.wanted


def read_target(run_dir: str | os.PathLike[str], default_n: int) -> Target:
    """``RUN_DIR/target.json`` (:class:`rlboost_hpc.rundir.TargetFile`, its one reader); missing →
    ``Target(default_n, True, "default")``. Raises :class:`rlboost_hpc.rundir.RunDirError` when it cannot be read
    or has the wrong shape."""
    t = RunDir(run_dir).read_target()
    if t is None:
        return Target(default_n, True, "default")
    return Target(t.n_prem, t.active, "file", t.gpus_per_instance, t.wanted)


@dataclass
class ReconcileResult:
    """Outcome of one step. ``ok`` is False when a command failed (``error`` has the one-line reason);
    counts are of OUR live jobs as listed at the start of the step."""

    ok: bool = True
    error: str | None = None
    target: Target | None = None
    desired: int = 0
    free_slots: int | None = None
    live: int = 0
    pending: int = 0  # waiting for resources, held ones included
    held: int = 0  # waiting, but only a release starts them (cancelled with everything else at run end)
    running: int = 0
    draining: int = 0  # live jobs already signalled or cancelled (leaving)
    submitted: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    signalled: list[str] = field(default_factory=list)
    submit_paused_until: float | None = None
    share: int | None = None  # instances the harvest service granted (harvest_dir; None: harvesting alone)
    harvest_wait: str = ""  # why no fresh share was acted on this step ("" when it was, or alone)
    listed: bool = True  # False: the step waited for the harvest service's next listing (the counts are not known)
    held_back: str = ""  # why fewer jobs are kept than the run asks for ("" when nothing holds it back)


class Scavenger:
    """Keeps OUR rollout jobs (tagged ``--comment=<tag>``) at the run's target. See the module docstring.

    ``config``: :class:`ScavengerConfig`; ``run_dir``: the run directory (target.json in, events.jsonl out);
    ``slurm``: a :class:`SlurmAPI` (default: :func:`scavenger.pyslurm_api.slurm_api` of ``config.slurm_api`` —
    the CLI client, or pyslurm when configured/available — with the configured timeout);
    ``clock``: ``time()``/``sleep()`` (default: wall clock); ``script``: the sbatch script to submit
    (default: ``config.resolved_script()``, resolved lazily at the first submission).
    """

    def __init__(self, config: ScavengerConfig, run_dir: str | os.PathLike[str], slurm: SlurmAPI | None = None,
                 clock: Clock | None = None, script: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.slurm: SlurmAPI = slurm if slurm is not None else slurm_api(config.slurm_api,
                                                                          timeout_s=config.command_timeout_s)
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._script = Path(script) if script is not None else None
        self.tag = config.resolved_tag(self.run_dir)
        self.job_name = config.job_name(self.run_dir)
        self.jobs = JobLog(self.run_dir, self.tag, self.clock.time)
        self._unknown_seen: set[tuple[str, str]] = set()
        self._last_view: dict | None = None
        self._last_view_ts = float("-inf")
        self.unknown_states_total = 0  # jobs seen in a state classify_job does not know
        self._last_target: Target | None = None
        self._failed_streak = 0
        self._submit_paused_until = 0.0
        self._stop = threading.Event()
        self.consecutive_errors = 0
        self.metrics = None  # a ScavengerMetrics refreshed after every reconciliation (start_metrics)
        # the run's experiment trackers (trainer.report_to), joined once the trainer names them in trackers.json
        self.tracking = ScavengerTracking(self.run_dir, config.spot_price_per_gpu_hour,
                                          config.on_demand_price_per_gpu_hour, config.resolved_run_id(self.run_dir))
        self._last_held_back = ""
        self._trainer_waiting_since: float | None = None  # the trainer job is listed waiting (requeued) since then
        self._trainer_over_in = 0  # listings in a row showing the trainer job over (or not at all)
        self._trainer_gone = ""  # why the trainer job is over (once it is: for good)
        self.harvest: HarvestLink | None = None  # the cluster's harvest service grants the share (harvest_dir)
        if config.harvest_dir:
            self.harvest = HarvestLink(config.harvest_dir, config.resolved_run_id(self.run_dir), self.tag,
                                       account=config.account or "", partition=config.partition,
                                       qos=config.qos or "", max_age_s=config.harvest_max_age_s,
                                       trainer_job=config.trainer_job or "", cpus_per_instance=config.cpus_per_job,
                                       time_limit_s=time_limit_seconds(config.time_limit), clock=self.clock.time)
        self.jobs.replay()

    # ---------------------------------------------------------------------------------------------
    def _note_finish(self, j: JobInfo, t: JobTrack, now: float) -> None:
        # A job that ended because it was told to leave — this daemon drained it, or the warning signal (a
        # preemption, the time limit) killed it before its batch shell trapped it — says nothing about whether
        # rollout jobs can start: it never counts as a quick failure (nor pauses submissions).
        warn = signal_number(self.config.signal)
        told_to_leave = t.drain_signalled_at is not None or j.exit_signal == warn or j.exit_code == 128 + warn
        if j.state in ("FAILED", "OUT_OF_MEMORY", "BOOT_FAIL") and told_to_leave:
            log.info("scavenger: rollout job %s %s (exit %s, signal %s): it was told to leave — not a crash",
                     j.job_id, j.state, j.exit_code, j.exit_signal)
        elif j.state in ("FAILED", "OUT_OF_MEMORY", "BOOT_FAIL"):
            start = j.start_time or t.start_ts
            end = j.end_time or now
            if start is None or end - start < QUICK_FAILURE_S:
                self._failed_streak += 1
                pause = min(self.config.max_backoff_s,
                            self.config.failed_job_backoff_s * 2 ** (self._failed_streak - 1))
                self._submit_paused_until = max(self._submit_paused_until, now + pause)
                log.warning("scavenger: rollout job %s %s after %s s (exit %s); pausing submissions %.0f s "
                            "(%d quick failure(s) in a row) — see its log in %s", j.job_id, j.state,
                            f"{end - start:.0f}" if start else "?", j.exit_code, pause, self._failed_streak,
                            self._log_dir())
                return
        if j.state == "COMPLETED":
            self._failed_streak = 0

    # ---------------------------------------------------------------------------------------------
    def _log_dir(self) -> Path:
        return Path(self.config.log_dir) if self.config.log_dir else self.run_dir / "scavenger" / "logs"

    def _free_slots(self) -> int:
        nodes = self.slurm.sinfo_nodes(self.config.partition)
        g = self.config.gpus_per_job
        slots = 0
        for n in nodes:
            if self.config.partition not in n.partitions:
                continue
            if g > 0:  # a job needs its CPUs as well: GPUs of a node whose CPUs are taken start nothing
                slots += min(n.free_gpus // g, n.free_cpus // self.config.cpus_per_job)
            else:
                slots += n.free_cpus // self.config.cpus_per_job
        return slots

    def _record_view(self, res: ReconcileResult) -> None:
        """Append this reconciliation's view to the reconcile log when it changed (or every
        :data:`VIEW_EVERY_S`): the time series of target, live jobs and idle capacity that ``stats`` plots and
        the acceptance test checks."""
        if not res.ok:
            return
        now = self.clock.time()
        view = {"target": res.target.n if res.target else None, "active": res.target.active if res.target else None,
                "desired": res.desired, "live": res.live, "draining": res.draining, "pending": res.pending,
                "held": res.held, "running": res.running, "idle_slots": res.free_slots}
        if view == self._last_view and now - self._last_view_ts < VIEW_EVERY_S:
            return
        self._last_view, self._last_view_ts = view, now
        try:
            path = self.run_dir / RECONCILE_LOG
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps({"ts": round(now, 3), **view}) + "\n")
        except OSError as e:
            log.warning("scavenger: could not append to %s: %s", RECONCILE_LOG, e)

    def _note_unknown(self, live: list[JobInfo]) -> None:
        """Log (once per job and state) and count jobs in a state this code does not know."""
        for j in live:
            if j.job_class is JobClass.UNKNOWN and (j.job_id, j.state) not in self._unknown_seen:
                self._unknown_seen.add((j.job_id, j.state))
                self.unknown_states_total += 1
                log.warning("scavenger: job %s is in state %s (flags %s), unknown to this version; counted as "
                            "occupying capacity", j.job_id, j.state, ",".join(j.state_flags) or "-")

    def _write_capacity(self, live: int, free: int, now: float) -> None:
        """The run's view of capacity for the trainer's cap (``capacity.json``); never fails a reconciliation."""
        try:
            RunDir(self.run_dir).write_capacity(CapacityView(live_jobs=live, idle_slots=max(0, free),
                                                      gpus_per_instance=self.config.gpus_per_job, ts=now))
        except OSError as e:
            log.warning("scavenger: could not write capacity.json: %s", e)

    def _read_target(self) -> Target | None:
        try:
            # no target yet: the run has not started, and its job size is unknown; a rollout job submitted now
            # would hold GPUs of a possibly wrong size only to wait for endpoints.json
            t = read_target(self.run_dir, 0)
            self._last_target = t
            return t
        except RunDirError as e:
            log.warning("scavenger: %s; keeping the last good target, submitting nothing new", e)
            if self._last_target is None:
                return None
            return dataclasses.replace(self._last_target, source="last_good")

    def reconcile_once(self) -> ReconcileResult:
        """One reconciliation step (see the module docstring). Never raises on Slurm failures, a missing
        rollout script or an unwritable log directory: they end the step and come back as ``ok=False``
        with ``error`` set (one line)."""
        res = ReconcileResult()
        now = self.clock.time()
        target = self._read_target()
        res.target = target
        if target is None or target.source == "default":
            res.held_back = self._held_back(None, None, "", 0, 0)
        if target is not None and target.gpus_per_instance is not None \
                and target.gpus_per_instance != self.config.gpus_per_job:
            log.info("scavenger: the run's rollout instances take %d GPU(s); submitting --gres=gpu:%d (was %d)",
                     target.gpus_per_instance, target.gpus_per_instance, self.config.gpus_per_job)
            self.config = self.config.model_copy(update={"gpus_per_job": target.gpus_per_instance})
        try:
            share = None
            if self.harvest is not None:  # ask for what the run could use; the share caps what it keeps
                wanted = min(target.asks, self.config.max_jobs) if target is not None else 0
                if self._trainer_released(now):  # (as the last listing showed it: nothing to serve, ask none)
                    wanted = 0
                share, why, stale = self.harvest.exchange(wanted, self.config.gpus_per_job,
                                                          target is None or target.active)
                res.harvest_wait = why
                if share is None and not stale:
                    res.listed = False
                    return res  # the service lists again after our last action: act on that listing
            jobs, trainer, looked = self._listing(share)
            ended = self._trainer_ended(trainer, looked)
            if ended and (target is None or target.active):  # the run is over without having said so
                target = res.target = Target(0, False, "trainer_ended", self.config.gpus_per_job)
            live, leaving, active = self._observe(jobs, now, res)
            if self.harvest is None:
                free = self._free_slots()
                self._write_capacity(len(active), free, now)
            else:  # the granted share: what the run may keep live (nothing new without a fresh one)
                free = res.share = share.instances if share is not None else 0
                self._write_capacity(len(active), free - len(active), now)
            res.free_slots = free
            if target is not None and not target.active:
                res.desired = 0
                self._cancel_all(live, now, res, "run_inactive")
                return res
            waiting = self._trainer_waiting(trainer, looked, now)
            if waiting:  # no manager to serve: nothing new; released once it has waited long enough
                res.desired, res.held_back = 0, waiting
                if self._trainer_released(now):
                    self._cancel_all(live, now, res, "trainer_pending")
                return res
            desired = min(target.n, self.config.max_jobs) if target is not None else len(active)
            if self.harvest is not None and target is not None:  # (no target yet: keep what is there)
                desired = min(desired, share.instances if share is not None else len(active))
            res.desired = desired
            res.held_back = self._held_back(target, share, res.harvest_wait, free, len(active))
            self._finish_leaving(leaving, now, res)
            surplus = len(active) - desired
            if surplus > 0:
                self._cancel_surplus(active, surplus, now, res)
                return res
            if target is None or desired - len(active) <= 0:
                return res
            if now < self._submit_paused_until:
                res.submit_paused_until = self._submit_paused_until
                return res
            pending_active = sum(1 for j in active if j.job_class in WAITING)
            n_new = min(desired - len(active), free - pending_active, self.config.max_submit_per_cycle)
            for _ in range(max(0, n_new)):
                res.submitted.append(self._submit())
        except (SlurmCommandError, ScavengerConfigError, OSError) as e:
            res.ok = False
            res.error = str(e)
        finally:
            if self.harvest is not None and (res.submitted or res.cancelled or res.signalled):
                self.harvest.acted()
        return res

    def _observe(self, jobs: list[JobInfo], now: float, res: ReconcileResult
                 ) -> tuple[list[JobInfo], list[JobInfo], list[JobInfo]]:
        """Log the listing's changes and count it into ``res``; returns our live jobs (unknown states count: they may
        hold capacity), those of them leaving (signalled or cancelled) and the others (active)."""
        self.jobs.observe(jobs, now, self._note_finish)
        live = [j for j in jobs if j.live]
        self._note_unknown(live)
        leaving = [j for j in live if self.jobs.tracks[j.job_id].drain_signalled_at is not None
                   or self.jobs.tracks[j.job_id].cancel_sent_at is not None]
        leaving_ids = {j.job_id for j in leaving}
        res.live, res.draining = len(live), len(leaving)
        res.pending = sum(1 for j in live if j.job_class in WAITING)
        res.held = sum(1 for j in live if j.job_class is JobClass.HELD)
        res.running = res.live - res.pending
        return live, leaving, [j for j in live if j.job_id not in leaving_ids]

    def _listing(self, share) -> tuple[list[JobInfo], JobInfo | None, bool]:
        """This step's listing: OUR jobs (every state), the trainer job (``None`` when not listed) and whether the
        listing looked for it. Under the harvest service both come with the share (no Slurm call of our own);
        alone, one ``squeue`` of our jobs (of all our jobs, when the trainer job is to be found among them too)."""
        tj = self.config.trainer_job
        if share is not None:
            looked = bool(tj) and share.trainer_job == tj  # (a service that does not look says "")
            return share.jobs, share.trainer if looked else None, looked
        if not tj:
            return self.slurm.squeue_jobs(comment_tag=self.tag, all_states=True), None, False
        every = self.slurm.squeue_jobs(all_states=True)
        return [j for j in every if j.comment == self.tag], next((j for j in every if j.job_id == tj), None), True

    def _trainer_ended(self, trainer: JobInfo | None, looked: bool) -> str:
        """Why the run's trainer job is over ("" while it lives, or when it is not known or was not looked for): it
        ended (any terminal state: failed, cancelled, completed) or Slurm stopped listing it — in ``VANISH_AFTER``
        listings in a row, so that a state seen once while Slurm requeues the job does not end the run. Logged once,
        as an error, when first seen; for good after that."""
        if not looked or self._trainer_gone:
            return self._trainer_gone
        if trainer is not None and not trainer.terminal:
            self._trainer_over_in = 0
            return ""
        self._trainer_over_in += 1
        if self._trainer_over_in < VANISH_AFTER:
            return ""
        if trainer is None:
            why = f"the trainer job {self.config.trainer_job} is no longer listed by Slurm"
        else:
            code = f", exit code {trainer.exit_code}" if trainer.exit_code is not None else ""
            why = f"the trainer job {trainer.job_id} ended {trainer.state}{code}"
        log.error("scavenger: %s before the run said it was over (target.json): the run is over; cancelling its "
                  "rollout jobs", why)
        self._trainer_gone = why
        return why

    def _trainer_waiting(self, trainer: JobInfo | None, looked: bool, now: float) -> str:
        """Why the run's rollout jobs wait for its trainer job ("" while it runs, or when it is not looked for): it
        is listed pending or held — not started yet, or requeued after a preemption or a node failure — so no
        manager serves them. Logged when it starts waiting and when it runs again (its jobs are released
        ``trainer_pending_release_s`` after it started waiting: :meth:`_trainer_released`)."""
        if not looked or trainer is None or trainer.job_class not in WAITING:
            if self._trainer_waiting_since is not None:
                log.info("scavenger: the trainer job %s runs again: rollout jobs are submitted to the run's target",
                         self.config.trainer_job)
            self._trainer_waiting_since = None
            return ""
        release_s = self.config.trainer_pending_release_s
        if self._trainer_waiting_since is None:
            self._trainer_waiting_since = now
            log.warning("scavenger: the trainer job %s is %s (%s): no rollout job is submitted while it waits; its "
                        "live ones are cancelled if it still waits %g s from now", trainer.job_id,
                        trainer.state, trainer.state_reason or "no reason given", release_s)
        released = self._trainer_released(now)
        return (f"the trainer job {trainer.job_id} is {trainer.state} ({trainer.state_reason or 'waiting'}): no "
                "manager to serve, " + ("its rollout jobs are released until it runs" if released else
                                        f"none is submitted; the live ones are released after {release_s:g} s"))

    def _trainer_released(self, now: float) -> bool:
        """The trainer job has waited ``trainer_pending_release_s`` (its rollout jobs are cancelled, none asked)."""
        since = self._trainer_waiting_since
        return since is not None and now - since >= self.config.trainer_pending_release_s

    def _held_back(self, target: Target | None, share, harvest_why: str, free: int, n_active: int) -> str:
        """Why the run keeps fewer rollout jobs than it asks for, in words ("" when nothing holds it back): no
        target yet, a stale or missing share, a share below the ask (with the service's reason: blackout, the
        policy, other runs), or no idle slot of the partition."""
        if target is None or target.source == "default":
            return "no target.json yet: the trainer has not said how many rollout jobs of which size it wants"
        asked = min(target.asks, self.config.max_jobs)
        if not target.active or asked <= n_active:
            return ""
        if self.harvest is not None:
            if share is None:
                return f"no fresh share from the harvest service ({harvest_why}): keeping the jobs, submitting none"
            if share.instances < asked:
                why = share.reason or (f"the pool of {share.pool_gpus} GPUs is shared with other runs"
                                       if share.pool_gpus else "the pool is empty (no idle GPU)")
                return f"the harvest service grants {share.instances} of the {asked} rollout jobs asked: {why}"
            return ""
        if free <= 0:
            return f"no idle slot in partition {self.config.partition} for a job of {self.config.gpus_per_job} GPU(s)"
        return ""

    def _log_held_back(self, res: ReconcileResult) -> None:
        """Log why the run is held back once per change of the reason (and once when it is no longer)."""
        if not res.ok or (not res.listed and not res.held_back) or res.held_back == self._last_held_back:
            return  # (a step that waited for the service's listing knows only that there is no target yet)
        if res.held_back:
            log.warning("scavenger: holding back: %s", res.held_back)
        elif res.target is not None and res.target.active:  # (a run that is over is not "no longer held back")
            log.info("scavenger: no longer held back (%d live rollout job(s), desired %d)", res.live, res.desired)
        self._last_held_back = res.held_back

    # ---------------------------------------------------------------------------------------------
    def _submit(self) -> str:
        if self._script is None:
            self._script = self.config.resolved_script()
        self._log_dir().mkdir(parents=True, exist_ok=True)  # sbatch does not create --output directories
        args = self.config.sbatch_args(self.run_dir)
        jid = self.slurm.sbatch(self._script, args)
        self.jobs.tracks[jid] = JobTrack(state="PENDING", restart_cnt=0)
        self.jobs.emit("submitted", jid, 0, name=self.job_name, partition=self.config.partition,
                   gpus=self.config.gpus_per_job, state="PENDING")
        log.info("scavenger: submitted rollout job %s (%s, gpu:%d)", jid, self.config.partition,
                 self.config.gpus_per_job)
        return jid

    def _scancel(self, jobs: list[JobInfo], now: float, res: ReconcileResult, reason: str) -> None:
        ids = [j.job_id for j in jobs]
        if not ids:
            return
        for jid in ids:  # scancel's SIGTERM reaches the worker as a warning: it must not requeue itself
            self._mark_drain(jid, now, reason)
        self.slurm.scancel(ids)
        for j in jobs:
            self.jobs.tracks[j.job_id].cancel_sent_at = now
            self.jobs.emit("cancelled", j.job_id, j.restart_cnt, mode="cancel", reason=reason, state=j.state)
        res.cancelled += ids
        log.info("scavenger: cancelled %s (%s)", ",".join(ids), reason)

    def _mark_drain(self, job_id: str, now: float, reason: str) -> None:
        """The job's drain marker: a worker warned while it exists leaves for good (no requeue)."""
        marker = drain_marker_path(self.run_dir, job_id)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"ts": now, "reason": reason}) + "\n")

    def _resend_due(self, t: JobTrack, now: float) -> bool:
        return t.cancel_sent_at is None or now - t.cancel_sent_at >= self.config.grace_s

    def _cancel_all(self, live: list[JobInfo], now: float, res: ReconcileResult, reason: str) -> None:
        due = [j for j in live if self._resend_due(self.jobs.tracks[j.job_id], now)]
        self._scancel(due, now, res, reason)

    def _finish_leaving(self, leaving: list[JobInfo], now: float, res: ReconcileResult) -> None:
        """Plain-cancel jobs on their way out that did not leave: drained jobs that requeued themselves
        anyway (pending) or outlived the grace, and cancelled jobs still live a grace period later."""
        again, drained = [], []
        for j in leaving:
            t = self.jobs.tracks[j.job_id]
            if t.cancel_sent_at is not None:
                if self._resend_due(t, now):
                    again.append(j)
            elif t.drain_signalled_at is not None:
                if j.job_class in WAITING or now - t.drain_signalled_at >= self.config.grace_s:
                    drained.append(j)
        self._scancel(again, now, res, "still_live_after_cancel")
        self._scancel(drained, now, res, "drain_grace_expired")

    def _cancel_surplus(self, active: list[JobInfo], surplus: int, now: float, res: ReconcileResult) -> None:
        """Newest pending first (plain scancel), then newest running (warning signal + drain marker)."""
        def newest(j: JobInfo) -> tuple[float, int]:
            # a pending job's start_time is Slurm's estimate: order pending ones by submission
            t = j.submit_time if j.job_class in WAITING else (j.start_time or j.submit_time)
            return (t or 0.0, job_number(j.job_id))

        pending = sorted((j for j in active if j.job_class in WAITING), key=newest, reverse=True)
        running = sorted((j for j in active if j.job_class not in WAITING), key=newest, reverse=True)
        victims = (pending + running)[:surplus]
        self._scancel([j for j in victims if j.job_class in WAITING], now, res, "surplus")
        to_signal = [j for j in victims if j.job_class not in WAITING]
        if not to_signal:
            return
        for j in to_signal:
            self._mark_drain(j.job_id, now, "surplus")
        ids = [j.job_id for j in to_signal]
        self.slurm.scancel(ids, signal=self.config.signal, batch=True)
        for j in to_signal:
            self.jobs.tracks[j.job_id].drain_signalled_at = now
            self.jobs.emit("cancelled", j.job_id, j.restart_cnt, mode="signal", signal=self.config.signal,
                       reason="surplus", state=j.state)
        res.signalled += ids
        log.info("scavenger: asked %s to drain (SIG%s to the batch shell; scancel after %d s)",
                 ",".join(ids), self.config.signal, self.config.grace_s)

    # ---------------------------------------------------------------------------------------------
    def start_metrics(self) -> str:
        """Serve Prometheus metrics (``config.metrics_port``/``metrics_host``); returns the URL, also written to
        ``RUN_DIR/scavenger-metrics.json``. Refreshed after every reconciliation of :meth:`run_forever`."""
        from rlboost_hpc.observe.metrics import serve_metrics
        from rlboost_hpc.rundir import write_json_atomic
        from scavenger.metrics import ScavengerMetrics

        self.metrics = ScavengerMetrics(self.config.spot_price_per_gpu_hour, self.config.on_demand_price_per_gpu_hour,
                                        run_id=self.config.resolved_run_id(self.run_dir))
        host, port = serve_metrics(self.metrics, host=self.config.metrics_host, port=self.config.metrics_port or 0)
        url = f"http://{host}:{port}/metrics"
        write_json_atomic(self.run_dir / "scavenger-metrics.json", {"url": url, "tag": self.tag})
        RunDir(self.run_dir).write_file_sd("rlboost-scavenger", url, self.config.resolved_run_id(self.run_dir))
        log.info("scavenger: metrics at %s", url)
        return url

    def _refresh_metrics(self, res: ReconcileResult) -> None:
        """The run's statistics after a reconciliation, to the Prometheus snapshot (when served) and the run's
        experiment trackers (when it has any)."""
        try:
            now = self.clock.time()
            stats = load_run_stats(self.run_dir, now=now)
            if self.metrics is not None:
                self.metrics.refresh(res, stats)
            self.tracking.refresh(res, stats, now)
        except Exception as e:  # noqa: BLE001 - metrics must never stop the daemon
            log.warning("scavenger: metrics refresh failed: %s", e)

    def close(self) -> None:
        """Send what is queued for the run's trackers and leave them (waits a bounded time); call once the loop
        is over."""
        self.tracking.close()

    def stop(self) -> None:
        """Ask :meth:`run_forever` to return after the current step (safe from signal handlers/threads)."""
        self._stop.set()
        wake = getattr(self.clock, "wake", None)
        if callable(wake):
            wake()

    def next_delay(self, res: ReconcileResult, poll_s: float) -> float:
        """Seconds to wait after ``res``: ``poll_s`` after success, else ``poll_s`` · 2^k (k = consecutive
        failures, capped at ``max_backoff_s``). Updates the failure counter."""
        if res.ok:
            self.consecutive_errors = 0
            return poll_s
        self.consecutive_errors += 1
        return min(self.config.max_backoff_s, poll_s * 2 ** min(self.consecutive_errors, 16))

    def run_forever(self, poll_s: float | None = None, max_cycles: int | None = None,
                    exit_when_done: bool = False) -> int:
        """Reconcile every ``poll_s`` seconds (default ``config.poll_s``) until :meth:`stop`, ``max_cycles``
        steps, or — with ``exit_when_done`` — the target is inactive and none of our jobs is live.
        Returns 0. Failures are logged (one line each) and retried with backoff; they never end the loop."""
        poll = self.config.poll_s if poll_s is None else poll_s
        cycles = 0
        while not self._stop.is_set():
            res = self.reconcile_once()
            cycles += 1
            if res.listed:  # (a step that waited for the harvest service's listing saw nothing to record)
                self._record_view(res)
                if self.metrics is not None or self.tracking.wanted():
                    self._refresh_metrics(res)
            self._log_held_back(res)
            delay = self.next_delay(res, poll)
            if not res.ok:
                log.warning("scavenger: %s; retrying in %.0f s (failure %d in a row)", res.error, delay,
                            self.consecutive_errors)
            elif res.submitted or res.cancelled or res.signalled:
                log.info("scavenger: target %s desired %d live %d (pending %d) free slots %s → submitted %s "
                         "cancelled %s signalled %s", res.target and res.target.n, res.desired, res.live,
                         res.pending, res.free_slots, res.submitted, res.cancelled, res.signalled)
            if exit_when_done and res.ok and res.listed and res.target is not None and not res.target.active \
                    and res.live == 0:
                log.info("scavenger: run inactive and no rollout job left; exiting")
                if self.harvest is not None:
                    self.harvest.leave()
                return 0
            if max_cycles is not None and cycles >= max_cycles:
                return 0
            if self._stop.is_set():
                break
            self.clock.sleep(delay)
        return 0
