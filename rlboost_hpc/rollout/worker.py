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
  engine (weights of the old epoch are never trusted: they are pulled again, rollout/agent.py).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# imported before the signal handlers exist: a handler must never import (a warning that interrupts the main
# thread's import of the same module sees it half-initialised)
from rlboost_hpc.events import append_event, drain_requested  # light: no torch

log = logging.getLogger("rlboost.worker")


#: Under Slurm, how long (seconds) a worker stopped by SIGTERM waits, before it deregisters, for the warning signal
#: that tells a preemption from a cancellation (Slurm sends both at preemption, in either order).
SLURM_CAUSE_SETTLE_S = 0.5

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


def requeue_self(job_id: str, timeout_s: float = 15.0) -> bool:
    """``scontrol requeue JOB`` with a deadline; True on success (errors are logged, not raised)."""
    try:
        p = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("scontrol requeue %s failed: %s", job_id, e)
        return False
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
    from rlboost_hpc.rundir import RunDirError, read_endpoints

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            ends = read_endpoints(run_dir)
        except RunDirError:
            ends = {}
        if ends and (ends.get("written_at"), ends.get("manager")) != (previous.get("written_at"), previous.get("manager")):
            return ends
        time.sleep(0.5)
    return None


def _drained(run_dir: str | None, job_id: str) -> bool:
    return bool(run_dir) and drain_requested(run_dir, job_id)


def _stop_reason(holder: dict) -> str:
    return f"{holder['cause'].replace('_', ' ')} ({holder['signal']})"


def main(argv: list[str] | None = None) -> int:
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
    # Rollout settings come from the run's worker spec (endpoints.json, rollout/spec.py); these flags only
    # override it by hand (logged), and give the settings of a worker started with --manager alone.
    p.add_argument("--max-batch", type=int, default=None, help="override rollout.max_batch")
    p.add_argument("--engine", choices=["torch", "sglang"], default=None, help="override rollout.engine")
    p.add_argument("--threads", type=int, default=None, help="override rollout.torch_threads")
    p.add_argument("--streams", type=int, default=None, help="override weights.streams")
    p.add_argument("--window", type=int, default=None, help="override weights.window")
    p.add_argument("--pull-timeout", type=float, default=None, help="override weights.pull_timeout_s")
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
    args = p.parse_args(argv)
    if not args.job_id:
        p.error("--job-id is required outside Slurm")
    if args.engine is not None and args.engine != "torch" and not args.run_dir:
        p.error("--engine sglang needs --run-dir (the engine's settings come from the run's endpoints.json)")
    if not (args.manager or args.run_dir):
        p.error("give --manager or --run-dir")

    from rlboost_hpc.observe.logs import setup_logging

    setup_logging(f"worker:{args.job_id}#{args.attempt}")
    warn = getattr(signal, args.signal)
    if warn == signal.SIGUSR1:
        p.error("SIGUSR1 is taken by NCCL; use SIGUSR2")
    holder: dict = {}

    def on_signal(s, _f):
        if "warned_at" in holder:
            # Slurm preempts with SIGTERM and the warning signal, in either order: the warning refines a SIGTERM's
            # "stopped" (the agent waits SLURM_CAUSE_SETTLE_S for it before it deregisters)
            if s == warn and holder.get("cause") == "stopped" and holder.get("signal") == "SIGTERM":
                holder["cause"] = classify_warning(holder["warned_at"], drained=False,
                                                   job_end_s=holder.get("job_end_s"))
                holder["signal"] = f"SIGTERM+{signal.Signals(s).name}"
                if "agent" in holder:
                    holder["agent"].request_stop(_stop_reason(holder), holder["cause"])
            return
        holder["warned_at"] = time.time()
        holder["signal"] = signal.Signals(s).name
        try:
            drained = _drained(args.run_dir, args.job_id)
        except OSError:  # an unreachable shared filesystem: a warning is a preemption unless shown otherwise
            drained = False
        if s != warn and os.environ.get("SLURM_JOB_ID"):
            # Under Slurm the preemption warning is --signal (USR2); a SIGTERM is scancel (a user's, or the end
            # of a grace time): the job is being cancelled and must not requeue itself
            holder["cause"] = "drained" if drained else "stopped"
        else:
            holder["cause"] = classify_warning(holder["warned_at"], drained=drained,
                                               job_end_s=holder.get("job_end_s"))
        if "agent" in holder:
            holder["agent"].request_stop(_stop_reason(holder), holder["cause"])

    for sig in {signal.SIGTERM, warn}:  # installed before the slow imports: a warning is never missed
        signal.signal(sig, on_signal)
    holder["job_end_s"] = job_end_time(args.job_id)
    from rlboost_hpc.procutil import reclaim_leftovers

    reclaim_leftovers()  # what an earlier attempt on this node left when its whole tree was SIGKILLed
    import msgspec

    from rlboost_hpc.errors import BadInput
    from rlboost_hpc.rollout.spec import WorkerSpec
    from rlboost_hpc.rundir import RunDir, read_endpoints

    manager, keys, ends, wspec = args.manager, None, {}, WorkerSpec()
    if args.run_dir:
        try:
            ends = read_endpoints(args.run_dir, wait_s=args.wait_endpoints)
            wspec = WorkerSpec.from_json(ends.get("worker"), where=str(RunDir(args.run_dir).endpoints))
        except BadInput as e:
            log.error("%s", e)
            return BadInput.exit_status
        if ends.get("run_id"):
            from rlboost_hpc.observe.logs import set_run_id

            set_run_id(str(ends["run_id"]))
        manager = args.manager or ends["manager"]
        keys = _run_keys(args.run_dir, ends)
    overrides = {k: v for k, v in (("max_batch", args.max_batch), ("torch_threads", args.threads),
                                   ("weight_streams", args.streams), ("weight_window", args.window),
                                   ("pull_timeout_s", args.pull_timeout)) if v is not None}
    if args.engine is not None:
        overrides["engine"] = dict(wspec.engine, kind=args.engine)
    if overrides:
        log.info("command-line overrides of the run's worker spec: %s", overrides)
        wspec = msgspec.structs.replace(wspec, **overrides)
    _event(args.run_dir, {"event": "worker_started", "source": "worker", "job_id": args.job_id, "attempt": args.attempt,
                          "node": os.environ.get("SLURMD_NODENAME", ""), "pid": os.getpid(),
                          "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "settings": wspec.to_json()})
    os.environ["OMP_NUM_THREADS"] = str(wspec.torch_threads)  # before torch is imported
    import torch

    torch.set_num_threads(wspec.torch_threads)
    from rlboost_hpc.protocol.auth import RunKeys
    from rlboost_hpc.rollout.agent import EXIT_UNREACHABLE, RolloutAgent
    from rlboost_hpc.rollout.remote_weights import RemoteWeights
    from rlboost_hpc.rollout.engines.base import EngineError
    from rlboost_hpc.rollout.engines.factory import factory_from_spec, receive_buffer_factory

    spec = wspec.engine
    server_log = None
    if args.run_dir:
        server_log = os.path.join(args.run_dir, "workers", f"{args.job_id}-attempt{args.attempt}-engine.log")
        os.makedirs(os.path.dirname(server_log), exist_ok=True)
    try:
        factory = factory_from_spec(spec, wspec.max_batch, log_path=server_log)
    except EngineError as e:
        log.error("%s", e)
        return 2
    # One builder thread for every connection: an SGLang server dies with the thread that started it
    # (PR_SET_PDEATHSIG), so that thread must outlive reconnects.
    builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"worker-{args.job_id}-builder")
    weights = RemoteWeights(wspec.weight_streams, wspec.weight_window, wspec.pull_timeout_s,
                            keep_base=wspec.weight_delta, peer_timeout_s=wspec.relay_timeout_s,
                            buffer_factory=receive_buffer_factory(spec))  # survives reconnects

    def relay_endpoint() -> str:
        """Serve held versions to peers (with the run's current keys); "" when relay is off or cannot bind."""
        if not wspec.weight_relay:
            return ""
        host = wspec.relay_bind_host
        advertise = socket.gethostname() if host in ("0.0.0.0", "*") else host
        try:
            server_keys = RunKeys.load(args.run_dir) if keys is not None else None
            return weights.serve_relay(host, advertise, server_keys)
        except Exception as e:  # noqa: BLE001 - relay is an optimisation: pull from the trainer alone
            log.warning("relay off for this worker: %s: %s", type(e).__name__, e)
            return ""
    produced = handed_off = 0

    def make_agent(manager: str, keys, engine=None, engine_epoch=None) -> RolloutAgent:
        agent = RolloutAgent(
            manager, args.job_id, args.attempt, kind="preemptible", max_batch=wspec.max_batch,
            register_timeout_s=args.register_timeout, manager_timeout_s=args.manager_timeout,
            node=os.environ.get("SLURMD_NODENAME", ""), keys=keys, engine_factory=factory,
            fault_load_delay_s=args.fault_load_delay_s,
            engine_name=spec.get("kind", "torch"), engine=engine, engine_epoch=engine_epoch,
            close_engine=False, builder=builder, relay_endpoint=relay_endpoint(), relay_wait_s=wspec.relay_wait_s,
            weight_source_factory=lambda ep, shards="": weights.source(ep, keys, shards))
        if os.environ.get("SLURM_JOB_ID"):
            agent.cause_settle_s = SLURM_CAUSE_SETTLE_S
        return agent

    agent = make_agent(manager, keys)
    holder["agent"] = agent
    if "warned_at" in holder:  # the warning came while importing
        agent.request_stop(_stop_reason(holder), holder["cause"])
    try:
        code = agent.run()
        while (code == EXIT_UNREACHABLE and args.run_dir and args.reconnect > 0 and agent.stop_reason is None
               and "warned_at" not in holder):
            log.warning("manager %s is gone; waiting up to %.0fs for a restarted trainer's endpoints.json",
                        manager, args.reconnect)
            nxt = _next_endpoints(args.run_dir, ends, args.reconnect)
            if nxt is None or "warned_at" in holder:
                break
            ends, manager = nxt, nxt["manager"]
            keys = _run_keys(args.run_dir, nxt)
            _event(args.run_dir, {"event": "reconnect", "source": "worker", "job_id": args.job_id,
                                  "attempt": args.attempt, "manager": manager})
            produced, handed_off = produced + agent.tokens_generated, handed_off + agent.tokens_handed_off
            agent = make_agent(manager, keys, engine=agent.engine, engine_epoch=agent.engine_epoch)
            holder["agent"] = agent
            code = agent.run()
    finally:
        if agent.engine is not None:
            agent.engine.close()
        weights.close()
        builder.shutdown(wait=False, cancel_futures=True)
    cause = holder.get("cause")
    _event(args.run_dir, {"event": "tokens", "source": "worker", "job_id": args.job_id, "attempt": args.attempt,
                          "produced": produced + agent.tokens_generated,
                          "handed_off": handed_off + agent.tokens_handed_off,
                          "exit_code": code, "stop_reason": agent.stop_reason or ""})
    if cause is not None:
        _event(args.run_dir, {"event": "warned", "source": "worker", "job_id": args.job_id, "attempt": args.attempt,
                              "signal": holder.get("signal"), "warned_at": holder.get("warned_at"), "cause": cause,
                              "drained_s": time.time() - holder.get("warned_at", time.time())})
        in_slurm = bool(os.environ.get("SLURM_JOB_ID"))
        # a preempted or timed-out job requeues; a drained (surplus) or cancelled one must not come back
        if cause in ("preempted", "time_limit") and (args.requeue == "yes" or (args.requeue == "auto" and in_slurm)):
            ok = requeue_self(args.job_id)
            _event(args.run_dir, {"event": "requeue_requested", "source": "worker", "job_id": args.job_id,
                                  "attempt": args.attempt,
                                  "ok": ok})
    return code


if __name__ == "__main__":
    sys.exit(main())
