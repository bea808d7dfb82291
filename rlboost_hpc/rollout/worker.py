"""Entry point of a preemptible rollout-worker process: ``python -m rlboost_hpc.rollout.worker``.

Invariant: a warning signal (SIGTERM, or the configured preemption signal such as SIGUSR2 — never SIGUSR1,
which NCCL claims; case S1) makes the agent drain — flush every produced token, release its requests,
deregister — and exit 0. Without a warning (SIGKILL) the manager detects the loss by missed heartbeats.
"""
from __future__ import annotations

import argparse
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlboost-hpc worker", description="Run one preemptible rollout instance.")
    p.add_argument("--manager", required=True, help="manager endpoint, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--job-id", required=True, help="instance identity (Slurm job id or local slot name)")
    p.add_argument("--attempt", type=int, default=0, help="restart count (SLURM_RESTART_COUNT)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--streams", type=int, default=4, help="parallel weight-pull streams")
    p.add_argument("--window", type=int, default=4, help="outstanding chunk requests per stream")
    p.add_argument("--pull-timeout", type=float, default=30.0)
    p.add_argument("--register-timeout", type=float, default=15.0, help="seconds to wait for the manager's Welcome")
    p.add_argument("--signal", default="SIGUSR2", help="preemption warning signal (SIGTERM is always honoured)")
    args = p.parse_args(argv)

    from rlboost_hpc.observe.logs import setup_logging

    setup_logging(f"worker:{args.job_id}#{args.attempt}")
    import torch

    torch.set_num_threads(args.threads)
    from rlboost_hpc.rollout.agent import RolloutAgent, remote_weight_source

    agent = RolloutAgent(
        args.manager, args.job_id, args.attempt, kind="preemptible", max_batch=args.max_batch,
        register_timeout_s=args.register_timeout,
        weight_source_factory=lambda ep: remote_weight_source(ep, args.streams, args.window, args.pull_timeout),
    )
    warn = getattr(signal, args.signal)
    if warn == signal.SIGUSR1:
        p.error("SIGUSR1 is taken by NCCL; use SIGUSR2 (case S1)")
    for sig in {signal.SIGTERM, warn}:
        signal.signal(sig, lambda s, f: agent.request_stop(f"preempted ({signal.Signals(s).name})"))
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
