"""Entry point of a preemptible rollout-worker process: ``rlboost-hpc worker`` / ``python -m rlboost_hpc.rollout.worker``.

Invariants:
- Identity = (job id, attempt). Under Slurm: ``SLURM_JOB_ID`` and ``SLURM_RESTART_COUNT`` (a requeued job is
  a new instance that never merges with its previous attempt).
- A warning signal (SIGTERM, or the configured preemption signal — SIGUSR2 by default; never SIGUSR1, which
  NCCL claims) makes the agent drain: flush every produced token, release its requests, deregister.
  Under Slurm the job then requeues itself (``scontrol requeue``), because a job that exits on its own during
  the grace time is COMPLETED, not requeued. A drain requested by the manager (run finished) exits
  without requeue. Each warning is classified once, when it arrives (:func:`classify_warning`): ``drained`` (the
  scavenger's drain marker exists: no requeue), ``time_limit`` (within :data:`TIME_LIMIT_WINDOW_S` of the job's
  own end time: requeued, counted apart from preemptions) or ``preempted``; under Slurm a SIGTERM that is not
  the warning signal is a cancellation (``scancel``): ``stopped``, never requeued — unless the warning signal
  follows before the worker deregisters (Slurm preempts with both, in either order; it waits
  :data:`SLURM_CAUSE_SETTLE_S` for it), which makes it a preemption. The class travels in
  ``Deregister.cause`` and the ``warned`` event — at any point of the worker's life, registered or not yet.
  Without a warning (SIGKILL) the manager detects the loss by missed heartbeats.
- Life-cycle events (warned, tokens, requeue) are appended to the run directory's ``events.jsonl`` when one
  is given.
- A rollout job outlives a trainer crash: when the manager goes silent, a worker with ``--run-dir`` waits
  (``--reconnect`` seconds) for the restarted trainer's new ``endpoints.json`` and registers there, keeping its
  engine (weights of the old epoch are never trusted: they are pulled again, rollout/agent_weights.py).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

# imported before the signal handlers exist: a handler must never import (a warning that interrupts the main
# thread's import of the same module sees it half-initialised)
from rlboost_hpc.events import append_event, drain_requested, take_slow_load  # light: no torch
from rlboost_hpc.protocol.identity import instance_ids, instance_key  # light: no torch

log = logging.getLogger("rlboost.worker")


#: Environment variable naming the file a worker creates once its warning handler is installed (set by the
#: batch shell of ``sbatch/rollout.sbatch``, which holds a warning until then).
READY_FILE_ENV = "RLBOOST_WORKER_READY_FILE"


#: Under Slurm, the longest (seconds) a worker stopped by SIGTERM waits, before it deregisters, for what tells a
#: preemption from a cancellation: the warning signal (Slurm sends both at preemption, in either order, when
#: ``preempt_send_user_signal`` is set) or Slurm's answer about the job (:func:`preempted_in_slurm`), whichever
#: settles it first.
SLURM_CAUSE_SETTLE_S = 3.0


def _event(run_dir: str | None, record: dict) -> None:
    if not run_dir:
        return
    try:
        append_event(run_dir, record)
    except Exception as e:  # statistics must never take a worker down
        log.warning("could not append event %s: %s", record.get("event"), e)


#: A warning that arrives this close to the job's own end time (seconds) is the time limit's warning
#: (``--signal=B:USR2@N`` sends it N seconds before the end; N is 10 in sbatch/rollout.sbatch), not a preemption.
TIME_LIMIT_WINDOW_S = 60.0


def classify_warning(now_s: float, *, drained: bool, job_end_s: float | None,
                     window_s: float = TIME_LIMIT_WINDOW_S) -> str:
    """What a warning signal means, as the counted kind of end (``protocol.messages.LeaveCause``).

    ``drained`` (the scavenger wrote this job's drain marker before signalling it) wins; else a warning within
    ``window_s`` seconds of the job's own end time (``job_end_s``, epoch seconds as read when the job started;
    ``None``: no time limit known) is ``time_limit``; anything else is ``preempted``. Classified from the job's end
    time, never from the signal, which is the same for all three."""
    if drained:
        return "drained"
    if job_end_s is not None and now_s >= job_end_s - window_s:
        return "time_limit"
    return "preempted"


def job_end_time(job_id: str | None) -> float | None:
    """The job's end time (epoch seconds) from ``$SLURM_JOB_END_TIME``, else ``squeue -o %e``; ``None`` outside
    Slurm, without a time limit, or when Slurm does not answer within 5 s (then warnings count as preemptions)."""
    env = os.environ.get("SLURM_JOB_END_TIME", "")
    if env.isdigit() and int(env) > 0:
        return float(env)
    if not job_id or not os.environ.get("SLURM_JOB_ID"):
        return None
    try:
        p = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%e"], capture_output=True, text=True,
                           timeout=5)
        import datetime as _dt

        return _dt.datetime.fromisoformat(p.stdout.strip()).timestamp() if p.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def preemption_seen(show_job: str, attempt: int) -> bool | None:
    """Whether ``scontrol show job -o`` output (one line of ``Key=Value`` fields) shows attempt ``attempt`` of the job
    being preempted: Slurm stamps ``PreemptTime`` when it selects a job for preemption (during the grace time; it
    stays ``None`` for a ``scancel``, a time limit, a node failure), and once the grace time is over and it kills the
    job to requeue it, ``Restarts`` is already above the attempt's ``SLURM_RESTART_COUNT`` (the stamp is gone then).
    None when neither field is there (not Slurm's answer about a job)."""
    fields = dict(f.split("=", 1) for f in show_job.split() if "=" in f)
    if "PreemptTime" not in fields and "Restarts" not in fields:
        return None
    restarts = fields.get("Restarts", "")
    return (fields.get("PreemptTime", "None") not in ("None", "Unknown", "")
            or (restarts.isdigit() and int(restarts) > attempt))


def preempted_in_slurm(job_id: str, attempt: int, timeout_s: float = 2.0) -> bool | None:
    """Ask Slurm whether attempt ``attempt`` of job ``job_id`` is being preempted (:func:`preemption_seen`); None when
    ``scontrol`` does not answer within ``timeout_s`` seconds or fails (the caller keeps what the signal said)."""
    try:
        p = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return preemption_seen(p.stdout, attempt) if p.returncode == 0 else None


def requeue_self(job_id: str, timeout_s: float = 15.0) -> bool:
    """``scontrol requeue JOB`` with a deadline; True on success, or when Slurm has requeued the job already ("pending
    execution": it preempted it and the grace time is over); errors are logged, not raised."""
    try:
        p = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("scontrol requeue %s failed: %s", job_id, e)
        return False
    if p.returncode != 0 and "pending execution" in p.stderr:
        log.info("job %s is requeued already (Slurm requeues a job it preempts once the grace time is over)", job_id)
        return True
    if p.returncode != 0:
        log.error("scontrol requeue %s exited %d: %s", job_id, p.returncode, p.stderr.strip())
        return False
    return True


def _run_keys(run_dir: str, ends: dict):
    """The run's CURVE client keys when the run is authenticated (from the owner-only run directory)."""
    if not ends.get("curve"):
        return None
    from rlboost_hpc.protocol.auth import RunKeys

    return RunKeys.load(run_dir).client_view()


def _next_endpoints(run_dir: str, previous: dict, wait_s: float) -> dict | None:
    """Wait up to ``wait_s`` for an ``endpoints.json`` newer than ``previous`` (a restarted trainer's)."""
    from rlboost_hpc.rundir import RunDir, RunDirError

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            ends = RunDir(run_dir).read_endpoints()
        except RunDirError:
            ends = {}
        if ends and (ends.get("written_at"), ends.get("manager")) != (previous.get("written_at"), previous.get("manager")):
            return ends
        time.sleep(0.5)
    return None


class WarningHandler:
    """What ended this worker, decided once, when the signal arrives. Installed for SIGTERM and the warning signal ``warn`` before the slow imports, so a
    warning is never missed; :meth:`attach` hands it the current agent (again after a reconnect).

    Invariant, per signal:

    - the first one fixes ``warned_at`` (epoch seconds) and ``signal`` and classifies the end: under Slurm a SIGTERM
      that is not ``warn`` is a cancellation (``scancel``) — ``stopped``, or ``drained`` when the scavenger's drain
      marker exists — until Slurm says otherwise: a thread asks Slurm about the job (``ask_slurm(job_id)``; default
      :func:`preempted_in_slurm` for ``attempt``), and a job Slurm is preempting becomes ``preempted`` (or
      ``time_limit``) with signal ``SIGTERM+PreemptTime`` — a cluster without ``preempt_send_user_signal`` sends
      only SIGTERM at preemption, and such a job must still count and requeue as one; :attr:`settled` is true once
      nothing more can refine the cause (Slurm answered, or the warning came; at once in every other case); any
      other warning goes through
      :func:`classify_warning` (``drained`` / ``time_limit`` / ``preempted``). An unreachable shared filesystem
      reads as no drain marker: a warning is a preemption unless shown otherwise;
    - a later ``warn`` after a Slurm SIGTERM (Slurm preempts with both, in either order; the agent waits
      :data:`SLURM_CAUSE_SETTLE_S` for it before it deregisters) refines ``stopped`` into the warning's class and
      records ``SIGTERM+<warn>``; every other later signal changes nothing;
    - every attached agent is asked to drain with that cause (``RolloutAgent.request_stop``: the first request wins,
      a cause refines ``stopped``). A process hosting several instances (``--instances``) attaches one agent per
      instance: the warning is the process's, so all of them drain.

    The handler never imports (the main thread may be half-way through importing the module it would need)."""

    def __init__(self, warn: signal.Signals, *, run_dir: str | None, job_id: str, in_slurm: bool, attempt: int = 0,
                 ask_slurm: Callable[[str], bool | None] | None = None) -> None:
        self.warn, self.run_dir, self.job_id, self.in_slurm = warn, run_dir, job_id, in_slurm
        self.ask_slurm = ask_slurm or (lambda job: preempted_in_slurm(job, attempt))
        self.settled = False  # nothing can refine the cause any more (see the class docstring)
        self.job_end_s: float | None = None  # the job's own end time (epoch s), read once it is known
        self.warned_at: float | None = None
        self.signal: str | None = None
        self.cause: str | None = None  # protocol.messages.LeaveCause once warned
        self.agents: dict[str, object] = {}  # instance job id -> the RolloutAgent to stop (the latest attached)

    def install(self) -> None:
        """Handle SIGTERM and ``warn`` from now on, then take what a launcher held back until this moment: the
        signals are unblocked (the local cluster starts workers with them blocked, so one sent before this point is
        pending and arrives here) and the file named by ``$RLBOOST_WORKER_READY_FILE`` is created (the batch
        shell of ``sbatch/rollout.sbatch``, which cannot block signals in its child, forwards a warning only
        once that file exists)."""
        sigs = {signal.SIGTERM, self.warn}
        for sig in sigs:
            signal.signal(sig, self)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
        ready = os.environ.pop(READY_FILE_ENV, "")
        if ready:
            try:
                with open(ready, "a"):
                    pass
            except OSError as e:  # the shell then holds a warning until the grace time ends: say why
                log.error("cannot create the ready file %s (%s): a warning is not forwarded to this worker",
                          ready, e)

    @property
    def warned(self) -> bool:
        return self.warned_at is not None

    def stop_reason(self) -> str:
        return f"{(self.cause or '').replace('_', ' ')} ({self.signal})"

    def attach(self, agent) -> None:
        """Stop ``agent`` on the next warning — at once when one came already (e.g. while importing). It replaces
        the agent attached before for the same instance (``agent.job_id``; a reconnect builds a new one)."""
        self.agents[getattr(agent, "job_id", "")] = agent
        agent.cause_settled = lambda: self.settled  # its Deregister waits for a settled cause (cause_settle_s)
        if self.warned:
            agent.request_stop(self.stop_reason(), self.cause)

    def _stop_agents(self) -> None:
        for agent in list(self.agents.values()):
            agent.request_stop(self.stop_reason(), self.cause)

    def _drained(self) -> bool:
        try:
            return bool(self.run_dir) and drain_requested(self.run_dir, self.job_id)
        except OSError:
            return False

    def __call__(self, s: int, _frame) -> None:
        if self.warned:
            if s == self.warn and self.cause == "stopped" and self.signal == "SIGTERM":
                self.cause = classify_warning(self.warned_at, drained=False, job_end_s=self.job_end_s)
                self.signal = f"SIGTERM+{signal.Signals(s).name}"
                self.settled = True
                self._stop_agents()
            return
        self.warned_at = time.time()
        self.signal = signal.Signals(s).name
        drained = self._drained()
        if s != self.warn and self.in_slurm:
            self.cause = "drained" if drained else "stopped"
        else:
            self.cause = classify_warning(self.warned_at, drained=drained, job_end_s=self.job_end_s)
        self.settled = self.cause != "stopped"
        self._stop_agents()
        if not self.settled:  # scancel, or a preemption without the warning signal: Slurm knows which
            threading.Thread(target=self._ask, name="preempted?", daemon=True).start()

    def _ask(self) -> None:
        """Refine a Slurm SIGTERM's ``stopped`` when Slurm is preempting the job. Slurm's answer settles the cause;
        no answer (``scontrol`` failed or timed out) leaves it open, so the agent waits out ``cause_settle_s`` for
        a warning signal, as it did before it could ask."""
        answer = None
        try:
            answer = self.ask_slurm(self.job_id)
        finally:
            if answer and self.cause == "stopped":
                self.cause = classify_warning(self.warned_at, drained=False, job_end_s=self.job_end_s)
                self.signal = "SIGTERM+PreemptTime"
                self._stop_agents()
            if answer is not None:
                self.settled = True


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    from rlboost_hpc.clihelp import DefaultsHelpFormatter

    p = argparse.ArgumentParser(prog="rlboost-hpc worker", description="Run one preemptible rollout instance.",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--manager", help="manager endpoint, e.g. tcp://127.0.0.1:5555 (or use --run-dir)")
    p.add_argument("--run-dir", help="shared run directory holding endpoints.json (Slurm rollout jobs)")
    p.add_argument("--wait-endpoints", type=float, default=600.0, help="seconds to wait for endpoints.json")
    p.add_argument("--job-id", default=os.environ.get("SLURM_JOB_ID"),
                   help="instance identity (default $SLURM_JOB_ID)")
    p.add_argument("--attempt", type=int, default=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                   help="restart count (default $SLURM_RESTART_COUNT)")
    # Rollout settings come from the run's worker spec (endpoints.json, rollout/spec.py). An operator overrides
    # only what differs per node of a heterogeneous partition (RLBOOST_WORKER_ARGS of sbatch/rollout.sbatch):
    # the batch a smaller GPU holds and the CPU threads a node has; the override is logged and in worker_started.
    p.add_argument("--max-batch", type=int, default=None, help="override rollout.max_batch on this node")
    p.add_argument("--threads", type=int, default=None, help="override rollout.torch_threads on this node")
    p.add_argument("--fault-load-delay-s", type=float, default=0.0,
                   help="chaos runs: every weight load after the first takes this many seconds longer")
    p.add_argument("--register-timeout", type=float, default=15.0, help="seconds to wait for the manager's Welcome")
    p.add_argument("--manager-timeout", type=float, default=10.0,
                   help="seconds of manager silence (it sends Alive every second) before it counts as gone")
    p.add_argument("--reconnect", type=float, default=600.0,
                   help="with --run-dir: seconds to wait for a restarted trainer's new endpoints.json after the "
                        "manager is gone (0: exit at once); the engine and its process are kept meanwhile")
    p.add_argument("--signal", default="SIGUSR2", help="preemption warning signal (SIGTERM is always honoured)")
    p.add_argument("--requeue", choices=["auto", "yes", "no"], default="auto",
                   help="after a warned preemption, requeue the Slurm job (auto: when SLURM_JOB_ID is set)")
    p.add_argument("--instances", type=int, default=1,
                   help="rollout instances this process hosts, one thread each with its own identity "
                        "(<job id>.<i>), sockets, heartbeat and weights; > 1 only for rollout.engine = emulated "
                        "(load tests: hundreds of instances on one machine)")
    args = p.parse_args(argv)
    if args.instances < 1:
        p.error(f"--instances {args.instances}: must be ≥ 1")
    if not args.job_id:
        p.error("--job-id is required outside Slurm")
    if not (args.manager or args.run_dir):
        p.error("give --manager or --run-dir")
    if getattr(signal, args.signal, None) is None:
        p.error(f"--signal {args.signal}: not a signal name")
    if getattr(signal, args.signal) == signal.SIGUSR1:
        p.error("SIGUSR1 is taken by NCCL; use SIGUSR2")
    return args


def _worker_spec(args: argparse.Namespace, handler: WarningHandler):
    """``(manager endpoint, CURVE client keys or None, endpoints.json's content, WorkerSpec)`` for this worker: the
    run's (``--run-dir``), with this node's overrides; the defaults for a worker given ``--manager`` alone.
    ``None`` when ``handler`` was warned while the run's endpoints.json did not exist yet (nothing to serve, nothing
    to hand over). Raises BadInput naming the file or key (a malformed endpoints.json or worker spec)."""
    import msgspec

    from rlboost_hpc.rollout.spec import WorkerSpec
    from rlboost_hpc.rundir import RunDir

    manager, keys, ends, wspec = args.manager, None, {}, WorkerSpec()
    if args.run_dir:
        ends = RunDir(args.run_dir).read_endpoints(wait_s=args.wait_endpoints, stop=lambda: handler.warned)
        if ends is None:
            return None
        wspec = WorkerSpec.from_json(ends.get("worker"), where=str(RunDir(args.run_dir).endpoints))
        if ends.get("run_id"):
            from rlboost_hpc.observe.logs import set_run_id

            set_run_id(str(ends["run_id"]))
        manager = args.manager or ends["manager"]
        keys = _run_keys(args.run_dir, ends)
    overrides = {k: v for k, v in (("max_batch", args.max_batch), ("torch_threads", args.threads)) if v is not None}
    if overrides:
        log.info("this node's overrides of the run's worker spec: %s", overrides)
        wspec = msgspec.structs.replace(wspec, **overrides)
    return manager, keys, ends, wspec


class _Instance:
    """What outlives a reconnect to a restarted trainer: the engine factory, the one builder thread (an SGLang
    server dies with the thread that started it, PR_SET_PDEATHSIG, so that thread must live as long as the
    process) and the weight puller with its base version. Raises EngineError for an engine spec that cannot be
    built here."""

    def __init__(self, args: argparse.Namespace, wspec) -> None:
        from rlboost_hpc.rollout.engines.factory import factory_from_spec, receive_buffer_factory
        from rlboost_hpc.rollout.remote_weights import RemoteWeights
        from rlboost_hpc.weights.lora_base import NodeBaseCache

        self.args, self.wspec, self.spec = args, wspec, wspec.engine
        server_log = None
        if args.run_dir:
            server_log = os.path.join(args.run_dir, "workers", f"{args.job_id}-attempt{args.attempt}-engine.log")
            os.makedirs(os.path.dirname(server_log), exist_ok=True)
        self.factory = factory_from_spec(self.spec, wspec.max_batch, log_path=server_log, instance_id=args.job_id)
        self.builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"worker-{args.job_id}-builder")
        self.weights = RemoteWeights(wspec.weight_streams, wspec.weight_window, wspec.pull_timeout_s,
                                     keep_base=wspec.weight_delta, peer_timeout_s=wspec.relay_timeout_s,
                                     buffer_factory=receive_buffer_factory(self.spec),
                                     base_cache=NodeBaseCache(wspec.base_cache_dir or None, wspec.base_cache_keep))

    def relay_endpoint(self, keys) -> str:
        """Serve held versions to peers (with the run's current keys); "" when relay is off or cannot bind."""
        if not self.wspec.weight_relay:
            return ""
        from rlboost_hpc.protocol.auth import RunKeys

        host = self.wspec.relay_bind_host
        advertise = socket.gethostname() if host in ("0.0.0.0", "*") else host
        try:
            server_keys = RunKeys.load(self.args.run_dir) if keys is not None else None
            return self.weights.serve_relay(host, advertise, server_keys)
        except Exception as e:  # noqa: BLE001 - relay is an optimisation: pull from the trainer alone
            log.warning("relay off for this worker: %s: %s", type(e).__name__, e)
            return ""

    def agent(self, manager: str, keys, engine=None, engine_epoch=None):
        """A RolloutAgent for ``manager`` — keeping ``engine`` (built in an earlier epoch) when given."""
        from rlboost_hpc.rollout.agent import RolloutAgent

        a, w = self.args, self.wspec
        agent = RolloutAgent(
            manager, a.job_id, a.attempt, kind="preemptible", max_batch=w.max_batch,
            register_timeout_s=a.register_timeout, manager_timeout_s=a.manager_timeout,
            node=os.environ.get("SLURMD_NODENAME", ""), keys=keys, engine_factory=self.factory,
            fault_load_delay_s=a.fault_load_delay_s,
            fault_slow_load=(lambda: take_slow_load(a.run_dir, instance_key(a.job_id, a.attempt))) if a.run_dir
            else None,
            engine_name=self.spec.get("kind", "torch"), engine=engine, engine_epoch=engine_epoch,
            close_engine=False, builder=self.builder, relay_endpoint=self.relay_endpoint(keys),
            relay_wait_s=w.relay_wait_s, weights=self.weights)
        if os.environ.get("SLURM_JOB_ID"):
            agent.cause_settle_s = SLURM_CAUSE_SETTLE_S
        agent.on_ready = lambda phases: _event(a.run_dir, {"event": "instance_ready", "source": "worker",
                                                            "job_id": a.job_id, "attempt": a.attempt, **phases})
        return agent

    def close(self, agent) -> None:
        if agent is not None and agent.engine is not None:
            agent.engine.close()
        self.weights.close()
        self.builder.shutdown(wait=False, cancel_futures=True)


def _serve(args: argparse.Namespace, inst: _Instance, handler: WarningHandler, manager: str, keys,
           ends: dict) -> tuple[int, str, int, int]:
    """Serve the manager until the agent exits; when the manager is gone (trainer crash) and a run directory is
    given, wait ``--reconnect`` seconds for the restarted trainer's endpoints.json and serve it with the same engine.
    Returns ``(exit code, stop reason, tokens produced, tokens handed off)`` over every connection."""
    from rlboost_hpc.rollout.agent import EXIT_UNREACHABLE

    produced = handed_off = 0
    agent = None
    try:
        agent = inst.agent(manager, keys)
        handler.attach(agent)
        code = agent.run()
        while (code == EXIT_UNREACHABLE and args.run_dir and args.reconnect > 0 and agent.stop_reason is None
               and not handler.warned):
            log.warning("manager %s is gone; waiting up to %.0fs for a restarted trainer's endpoints.json",
                        manager, args.reconnect)
            nxt = _next_endpoints(args.run_dir, ends, args.reconnect)
            if nxt is None or handler.warned:
                break
            ends, manager = nxt, nxt["manager"]
            keys = _run_keys(args.run_dir, nxt)
            _event(args.run_dir, {"event": "reconnect", "source": "worker", "job_id": args.job_id,
                                  "attempt": args.attempt, "manager": manager})
            produced, handed_off = produced + agent.tokens_generated, handed_off + agent.tokens_handed_off
            agent = inst.agent(manager, keys, engine=agent.engine, engine_epoch=agent.engine_epoch)
            handler.attach(agent)
            code = agent.run()
    finally:
        inst.close(agent)
    return code, agent.stop_reason or "", produced + agent.tokens_generated, handed_off + agent.tokens_handed_off


def _report_exit(args: argparse.Namespace, handler: WarningHandler, code: int, stop_reason: str, produced: int,
                 handed_off: int, *, instance: str | None = None, requeue_job: bool = True) -> None:
    """The exit's events of ``instance`` (default: the job itself; tokens; warned, with its cause) and, when
    ``requeue_job``, for a preempted or timed-out Slurm job, the requeue: a drained (surplus) or cancelled job must
    not come back. A process hosting several instances reports each and requeues its job once."""
    ids = {"source": "worker", "job_id": instance or args.job_id, "attempt": args.attempt}
    _event(args.run_dir, {"event": "tokens", **ids, "produced": produced, "handed_off": handed_off,
                          "exit_code": code, "stop_reason": stop_reason})
    if handler.cause is None:
        return
    _event(args.run_dir, {"event": "warned", **ids, "signal": handler.signal, "warned_at": handler.warned_at,
                          "cause": handler.cause, "drained_s": time.time() - handler.warned_at})
    requeue = args.requeue == "yes" or (args.requeue == "auto" and handler.in_slurm)
    if handler.cause in ("preempted", "time_limit") and requeue and requeue_job:
        _event(args.run_dir, {"event": "requeue_requested", **ids, "job_id": args.job_id,
                              "ok": requeue_self(args.job_id)})


def _serve_hosted(args: argparse.Namespace, hosted: list[argparse.Namespace], insts: list["_Instance"],
                  handler: WarningHandler, manager: str, keys, ends: dict) -> list[tuple[int, str, int, int]]:
    """:func:`_serve` for each hosted instance: the first on this thread, the others on one thread each; returns
    their results in order (an instance whose thread raised reports exit 1)."""
    import threading

    results: list[tuple[int, str, int, int] | None] = [None] * len(hosted)

    def run(i: int) -> None:
        try:
            results[i] = _serve(hosted[i], insts[i], handler, manager, keys, ends)
        except Exception:  # noqa: BLE001 - one instance's failure is reported as its exit, the others serve on
            log.exception("instance %s failed", hosted[i].job_id)
            results[i] = (1, "failed", 0, 0)

    threads = [threading.Thread(target=run, args=(i,), name=f"instance-{a.job_id}", daemon=True)
               for i, a in enumerate(hosted) if i > 0]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    return results  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    """Run one preemptible rollout instance (``--instances K``: K emulated ones) until it is preempted, drained or
    stopped, or the run ends. Exit 0 after a drain, 2 for a malformed run directory or engine spec (or several
    instances of an engine that is not emulated), the agent's code otherwise (the first non-zero of K)."""
    args = _parse_args(argv)
    from rlboost_hpc.observe.logs import setup_logging

    setup_logging(f"worker:{instance_key(args.job_id, args.attempt)}")
    handler = WarningHandler(getattr(signal, args.signal), run_dir=args.run_dir, job_id=args.job_id,
                             in_slurm=bool(os.environ.get("SLURM_JOB_ID")), attempt=args.attempt)
    handler.install()  # before the slow imports: a warning is never missed
    handler.job_end_s = job_end_time(args.job_id)
    from rlboost_hpc.errors import BadInput
    from rlboost_hpc.procutil import reclaim_leftovers

    reclaim_leftovers()  # what an earlier attempt on this node left when its whole tree was SIGKILLed
    try:
        found = _worker_spec(args, handler)
    except BadInput as e:
        log.error("%s", e)
        return BadInput.exit_status
    if found is None:
        log.info("warned (%s) before the run's endpoints.json existed: leaving", handler.stop_reason())
        _report_exit(args, handler, 0, handler.stop_reason(), 0, 0)
        return 0
    manager, keys, ends, wspec = found
    if args.instances > 1 and wspec.engine.get("kind") != "emulated":
        log.error("--instances %d: only emulated instances share a process; this run's rollout.engine is %s",
                  args.instances, wspec.engine.get("kind", "torch"))
        return BadInput.exit_status
    hosted = [argparse.Namespace(**{**vars(args), "job_id": jid}) for jid in instance_ids(args.job_id, args.instances)]
    for a in hosted:
        _event(args.run_dir, {"event": "worker_started", "source": "worker", "job_id": a.job_id, "attempt": a.attempt,
                              "node": os.environ.get("SLURMD_NODENAME", ""), "pid": os.getpid(),
                              "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "settings": wspec.to_json()})
    os.environ["OMP_NUM_THREADS"] = str(wspec.torch_threads)  # before torch is imported
    import torch

    from rlboost_hpc.rollout.engines.base import EngineError

    torch.set_num_threads(wspec.torch_threads)
    try:
        insts = [_Instance(a, wspec) for a in hosted]
    except EngineError as e:
        log.error("%s", e)
        return 2
    results = _serve_hosted(args, hosted, insts, handler, manager, keys, ends)
    for i, (a, (code, stop_reason, produced, handed_off)) in enumerate(zip(hosted, results)):
        _report_exit(args, handler, code, stop_reason, produced, handed_off, instance=a.job_id,
                     requeue_job=i == len(hosted) - 1)
    return next((r[0] for r in results if r[0] != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
