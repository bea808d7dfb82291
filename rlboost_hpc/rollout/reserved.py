"""The reserved engines: the rollout engines of the trainer's own allocation, each a process of its own beside the
trainer — as an SGLang server runs beside Megatron on a GPU node — started and kept alive by the trainer.

``python -m rlboost_hpc.rollout.reserved`` is one reserved engine: a rollout agent of kind ``reserved`` (it seeds
every step and generates alone when no preemptible instance serves: the co-located fallback) with

- its own torch thread count (``rollout.reserved_threads``, set before torch is imported), independent of the
  trainer's (``trainer.torch_threads``): in a thread of the trainer process the two shared one setting, and a small
  model's decode steps ran slower at the trainer's two threads;
- its weights mapped from the trainer's share directory (:mod:`rlboost_hpc.rollout.shared_weights`): the version the
  trainer published is loaded without a copy or a socket; a version not there (a sharded one, one evicted meanwhile)
  is pulled over the network as any instance pulls it;
- its own GIL: its decoding no longer contends with the trainer's Python (under bounded staleness both run at once).

:class:`ReservedEngines` is the trainer's side. Invariants:

- every engine lives as long as the run: started with ``PR_SET_PDEATHSIG`` from a thread that lives as long as the
  run (it dies with the trainer, even a SIGKILLed one); one that exits while the run goes on is started again as the
  next attempt (a new identity, never merged with the dead one, whose responses the manager resumed elsewhere) —
  at most :data:`MAX_QUICK_RESTARTS` times within :data:`QUICK_RESTART_WINDOW_S` seconds, then it is left down with
  an error naming its log (the run goes on with what serves, and a step with nothing that generates fails by its
  deadline);
- stopping sends SIGTERM: the agent drains (hands its unfinished responses back) and exits; one that does not exit
  within its grace is killed;
- each engine logs to ``<run dir>/logs/reserved-<i>-attempt<a>.log``.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rlboost_hpc.protocol.identity import reserved_job_id

log = logging.getLogger("rlboost.reserved")

#: Restarts of one engine within :data:`QUICK_RESTART_WINDOW_S` seconds after which it is left down.
MAX_QUICK_RESTARTS = 3
QUICK_RESTART_WINDOW_S = 60.0
#: Seconds a stopped engine has to drain and exit before it is killed.
STOP_GRACE_S = 10.0


class ReservedEngines:
    """Starts, supervises and stops the run's reserved engine processes (module docstring).

    Args:
        count: engines (``rollout.reserved_engines``). manager: the manager's endpoint. run_dir: the run directory
            (the CURVE keys when ``curve``; the engines' logs under ``logs/``). share_dir: the weight server's share
            directory (None: every version is pulled). threads, max_batch: per engine. engine_spec: the engine's JSON
            spec (:func:`~rlboost_hpc.rollout.engines.factory.engine_spec`). weights: the pull settings of the
            fallback (``streams``, ``window``, ``timeout_s``).
    """

    def __init__(self, count: int, *, manager: str, run_dir: str | os.PathLike[str], curve: bool,
                 share_dir: str | os.PathLike[str] | None, threads: int, max_batch: int, engine_spec: dict[str, Any],
                 weights: dict[str, Any]) -> None:
        self.count = count
        self._base = [sys.executable, "-m", "rlboost_hpc.rollout.reserved", "--manager", manager, "--run-dir",
                      str(run_dir), "--threads", str(threads), "--max-batch", str(max_batch), "--engine-spec",
                      json.dumps(engine_spec), "--weights", json.dumps(weights)]
        if curve:
            self._base.append("--curve")
        if share_dir is not None:
            self._base += ["--share-dir", str(share_dir)]
        self.log_dir = Path(run_dir) / "logs"
        self._procs: list[subprocess.Popen | None] = [None] * count
        self._attempts = [0] * count
        self._starts: list[list[float]] = [[] for _ in range(count)]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: engines started again after they exited while the run went on
        self.restarts = 0

    def start(self) -> None:
        """Start every engine and the thread that keeps them alive (whose life bounds theirs)."""
        started = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(started,), name="reserved-engines", daemon=True)
        self._thread.start()
        started.wait()

    def _spawn(self, i: int) -> subprocess.Popen:
        from rlboost_hpc.procutil import die_with_parent

        self.log_dir.mkdir(parents=True, exist_ok=True)
        a = self._attempts[i]
        cmd = self._base + ["--index", str(i), "--attempt", str(a)]
        with open(self.log_dir / f"reserved-{i}-attempt{a}.log", "ab") as logf:
            p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 preexec_fn=die_with_parent)
        self._starts[i].append(time.monotonic())
        return p

    def _watch(self, started: threading.Event) -> None:
        with self._lock:
            for i in range(self.count):
                self._procs[i] = self._spawn(i)
        started.set()
        while not self._stop.wait(0.5):
            with self._lock:
                for i, p in enumerate(self._procs):
                    if p is None or p.poll() is None or self._stop.is_set():
                        continue
                    now = time.monotonic()
                    recent = [t for t in self._starts[i] if now - t < QUICK_RESTART_WINDOW_S]
                    if len(recent) > MAX_QUICK_RESTARTS:
                        log.error("reserved engine %d exited %d times within %.0f s (last code %s); left down — see "
                                  "%s", i, len(recent), QUICK_RESTART_WINDOW_S, p.returncode,
                                  self.log_dir / f"reserved-{i}-attempt{self._attempts[i]}.log")
                        self._procs[i] = None
                        continue
                    log.warning("reserved engine %d (attempt %d) exited with code %s; starting attempt %d", i,
                                self._attempts[i], p.returncode, self._attempts[i] + 1)
                    self._attempts[i] += 1
                    self.restarts += 1
                    self._procs[i] = self._spawn(i)
        self._terminate()

    def _terminate(self) -> None:
        procs = [p for p in self._procs if p is not None and p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("reserved engine pid %d did not drain within %.0f s; killing it", p.pid, STOP_GRACE_S)
                p.kill()
                p.wait()

    def pids(self) -> list[int]:
        """The live engines' process ids."""
        with self._lock:
            return [p.pid for p in self._procs if p is not None and p.poll() is None]

    def stop(self) -> None:
        """Drain and stop every engine (SIGTERM; killed after :data:`STOP_GRACE_S`); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlboost_hpc.rollout.reserved",
                                description="One reserved rollout engine of a run (started by the trainer).")
    p.add_argument("--manager", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, required=True)
    p.add_argument("--engine-spec", required=True, help="the engine's JSON spec")
    p.add_argument("--weights", default="{}", help="JSON: streams, window, timeout_s of network pulls")
    p.add_argument("--share-dir", default=None)
    p.add_argument("--curve", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Serve as reserved engine ``--index`` until SIGTERM (drain, exit 0) or the manager refuses it for good."""
    a = _parse(argv)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # before torch is imported
    from rlboost_hpc.observe.logs import setup_logging

    jid = reserved_job_id(a.index)
    setup_logging(f"reserved:{jid}#{a.attempt}")
    import torch

    torch.set_num_threads(a.threads)
    from rlboost_hpc import defaults as D
    from rlboost_hpc.protocol.auth import RunKeys
    from rlboost_hpc.rollout.agent import RolloutAgent
    from rlboost_hpc.rollout.engines.factory import factory_from_spec
    from rlboost_hpc.rollout.remote_weights import RemoteWeights
    from rlboost_hpc.rollout.shared_weights import SharedVersions

    w = json.loads(a.weights)
    remote = RemoteWeights(w.get("streams", D.WEIGHT_STREAMS), w.get("window", D.WEIGHT_WINDOW),
                           w.get("timeout_s", D.PULL_TIMEOUT_S))
    weights = SharedVersions(Path(a.share_dir), remote) if a.share_dir else remote
    keys = RunKeys.load(a.run_dir).client_view() if a.curve else None
    spec = json.loads(a.engine_spec)
    # it never gives up on a silent manager: the trainer restarts its manager (or ends the run and stops it)
    agent = RolloutAgent(a.manager, jid, a.attempt, kind="reserved", max_batch=a.max_batch, weights=weights,
                         keys=keys, engine_factory=factory_from_spec(spec, a.max_batch, instance_id=jid),
                         engine_name=str(spec.get("kind", "torch")), manager_timeout_s=math.inf)
    signal.signal(signal.SIGTERM, lambda *_: agent.request_stop("run finished"))
    try:
        return agent.run()
    finally:
        weights.close()
        log.info("reserved engine %s#%d: %d tokens generated, versions mapped %s, pulled %s", jid, a.attempt,
                 agent.tokens_generated, getattr(weights, "shared", 0), getattr(weights, "fallbacks", "all"))


if __name__ == "__main__":
    sys.exit(main())
