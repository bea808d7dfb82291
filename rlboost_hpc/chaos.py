"""Chaos: synthetic, high-churn availability traces that drive the local cluster into frequent preemptions, plus
the faults that make healthy instances look dead.

The trace is written in the Bamboo CSV format (``<ms>,add|remove,<name>``) so the unchanged local cluster
replays it; with ``cluster.kill_fraction`` a share of the removals arrive as SIGKILL without warning, some of
them while a worker is still pulling weights. ``--stall-every-s`` / ``--reset-every-s`` / ``--slow-load-s``
add stalls longer than the heartbeat deadline (SIGSTOP … SIGCONT), TCP resets of every worker's connection
(through a forwarder) and weight loads slower than the deadline (:mod:`rlboost_hpc.cluster.faults`), by wall time.
``--faults-every-steps K`` (default 4) adds faults scheduled by progress: at every K-th step one of each
``--fault-kinds`` kind (preempt, kill, stall, link_reset, slow_load), each kept due until it finds a live worker — so
the fault mix is certain, not a matter of chance and of how fast the host runs (``cluster.faults.every_steps``).
``rlboost-hpc chaos`` runs the demo on such a trace and checks the invariants at the end (responses
lost/duplicated, tokens trained off-version, every prompt trained once); its last line is the verdict.

With ``--trainer-kills K`` the run is a child process (``rlboost-hpc run``) and the harness SIGKILLs either the
trainer or the rollout manager (its pid from the manager journal) K times (``--manager-kills M``: the manager M
times more, waiting for it while the trainer restarts it). A killed trainer is started again and
resumes from its last checkpoint (trainer/checkpoint.py); a killed manager is restarted by the trainer, which waits
while the new manager continues the step from its work log (manager/supervisor.py). Kills are scheduled by progress, not by the clock: kill
``i`` fires a random ``[0, --kill-jitter-s)`` seconds after the run's checkpoint reached step
``round((i + 1) · steps / (K + 1))`` and at least one step past the checkpoint its incarnation resumed from — so
every restart resumes from a checkpoint however slow the machine is. The final report covers every incarnation,
so the invariants are checked across crashes.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

from rlboost_hpc.paths import shipped
from rlboost_hpc.rundir import RunDir


def synthetic_trace(path: str | Path, *, duration_s: float, instances: int, mean_lifetime_s: float,
                    mean_downtime_s: float, seed: int = 0) -> int:
    """Write a trace where each of ``instances`` slots alternates exponential up/down times.

    Returns the number of ``remove`` events (the preemptions the replay will inject).
    """
    rng = random.Random(seed)
    events: list[tuple[int, str, str]] = []
    n = 0
    for slot in range(instances):
        t, up, k = 0.0, True, 0
        name = f"chaos{slot}-{k}"
        events.append((0, "add", name))
        while True:
            t += rng.expovariate(1.0 / (mean_lifetime_s if up else mean_downtime_s))
            if t >= duration_s:
                break
            if up:
                events.append((int(t * 1000), "remove", name))
                n += 1
            else:
                k += 1
                name = f"chaos{slot}-{k}"
                events.append((int(t * 1000), "add", name))
            up = not up
    events.sort(key=lambda e: e[0])
    Path(path).write_text("".join(f"{ms},{kind},{name}\n" for ms, kind, name in events))
    return n


def _kinds(text: str) -> tuple[str, ...]:
    """``--fault-kinds``: comma-separated kinds of :data:`~rlboost_hpc.cluster.faults.FAULT_KINDS`."""
    import argparse

    from rlboost_hpc.cluster.faults import FAULT_KINDS

    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in FAULT_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"{text!r}: kinds are {', '.join(FAULT_KINDS)}")
    return kinds


def _parser():
    """``rlboost-hpc chaos``'s flags."""
    import argparse

    from rlboost_hpc.clihelp import DefaultsHelpFormatter, number

    p = argparse.ArgumentParser(prog="rlboost-hpc chaos", description=chaos_main.__doc__,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--config", help="TOML config of the run (default: the shipped configs/local.toml, the demo)")
    p.add_argument("--out", default="runs/chaos", help="run directory (refused if it holds another run)")
    p.add_argument("--fresh", action="store_true",
                   help="start over in an --out that holds an earlier run (its checkpoints and journal are removed)")
    p.add_argument("--steps", type=number(int, at_least=1), default=40, help="RL steps of the run")
    p.add_argument("--duration-s", type=number(float, above=0), default=600.0, help="length of the synthetic trace (wall s)")
    p.add_argument("--workers", type=number(int, at_least=1), default=3, help="preemptible worker slots of the synthetic trace")
    p.add_argument("--lifetime-s", type=number(float, above=0), default=3.0, help="mean worker lifetime (s)")
    p.add_argument("--downtime-s", type=number(float, above=0), default=1.0, help="mean time a slot stays empty (s)")
    p.add_argument("--kill-fraction", type=number(float, at_least=0, at_most=1), default=0.5, help="share of removals without warning")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace and of the fault schedule")
    p.add_argument("--trainer-kills", type=number(int, at_least=0), default=0,
                   help="SIGKILL the trainer or the manager this many times at random moments, resuming each time "
                        "(only the trainer with --manager-kill-every-s, which kills the manager on its own)")
    p.add_argument("--kill-jitter-s", type=number(float, at_least=0), default=1.0,
                   help="a trainer/manager kill fires up to this many seconds (uniform) after the checkpoint it "
                        "waits for; kills are spread evenly over the run's checkpoints")
    p.add_argument("--manager-kills", type=number(int, at_least=0), default=0,
                   help="SIGKILL the rollout manager this many times, each after a checkpoint, spread over the run "
                        "like --trainer-kills (by progress); the trainer restarts it each time")
    p.add_argument("--manager-kill-every-s", type=number(float, at_least=0), default=0.0,
                   help="also SIGKILL the rollout manager at random moments, this many seconds apart on average (0: "
                        "never); the trainer restarts it each time (manager.restarts is raised to allow it)")
    p.add_argument("--stall-every-s", type=number(float, at_least=0), default=0.0, help="mean seconds between worker stalls (0: none)")
    p.add_argument("--stall-s", type=number(float, above=0), default=6.0, help="length of a stall (past the heartbeat deadline)")
    p.add_argument("--reset-every-s", type=number(float, at_least=0), default=0.0,
                   help="mean seconds between resets of the workers' TCP connections (0: none)")
    p.add_argument("--slow-load-s", type=number(float, at_least=0), default=0.0,
                   help="extra seconds of a slow weight load: of every load on half of the worker attempts, and of "
                        "the scheduled slow_load faults (0: none)")
    p.add_argument("--faults-every-steps", type=number(int, at_least=0), default=4,
                   help="at every k-th step inject one fault of each --fault-kinds kind, by progress: each stays due "
                        "until it finds a live worker, so the mix is certain however slow the host (0: only the "
                        "trace's and the wall-clock faults)")
    p.add_argument("--fault-kinds", default="preempt,kill", type=_kinds,
                   help="what --faults-every-steps injects, comma-separated: preempt, kill, stall, link_reset, "
                        "slow_load (needs --slow-load-s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted config override, e.g. --set rollout.max_new_tokens=32 (repeatable)")
    return p


def chaos_main(argv: list[str] | None = None) -> int:
    """``rlboost-hpc chaos``: run the demo under random preemptions/kills; exit 1 if an invariant broke."""
    from rlboost_hpc.observe.logs import logging_setup

    p = _parser()
    a = p.parse_args(argv)
    if a.faults_every_steps and "slow_load" in a.fault_kinds and a.slow_load_s <= 0:
        p.error("--fault-kinds slow_load needs --slow-load-s > 0 (the slow load's extra seconds)")
    kills = a.trainer_kills + a.manager_kills
    if kills > max(0, a.steps - 1):
        p.error(f"--trainer-kills {a.trainer_kills} and --manager-kills {a.manager_kills} need --steps ≥ {kills + 1} "
                "(one checkpoint per kill)")
    from rlboost_hpc.config import load_config

    a.config = a.config or str(shipped("configs/local.toml"))
    load_config(a.config, a.set)  # bad input is refused before anything is written (ConfigError: exit 2)
    out = RunDir(Path(a.out)).create().root
    earlier = _earlier_run(out)
    if earlier and not a.fresh:
        print(f"rlboost-hpc chaos: {out} holds another run ({', '.join(earlier)}); a chaos run starts from step 0 "
              "and would delete its checkpoints and journal. Use another --out, or --fresh to start over there.",
              file=sys.stderr)
        return 2
    _forget_previous_run(out)  # a chaos run always starts from step 0; its own restarts then resume
    trace = out / "chaos-trace.csv"
    n_remove = synthetic_trace(trace, duration_s=a.duration_s, instances=a.workers, mean_lifetime_s=a.lifetime_s,
                               mean_downtime_s=a.downtime_s, seed=a.seed)
    overrides = [
        f"trainer.steps={a.steps}", f"cluster.trace='{trace}'", "cluster.time_scale=1.0",
        f"cluster.replay_s={a.duration_s}", "cluster.window_start_s=0", f"cluster.max_workers={a.workers}",
        f"cluster.kill_fraction={a.kill_fraction}", f"cluster.seed={a.seed}",
        f"cluster.faults.stall_every_s={a.stall_every_s}", f"cluster.faults.stall_s={a.stall_s}",
        f"cluster.faults.link_reset_every_s={a.reset_every_s}", f"cluster.faults.slow_load_s={a.slow_load_s}",
        f"cluster.faults.every_steps={a.faults_every_steps}", f"cluster.faults.kinds={list(a.fault_kinds)!r}",
        *(["cluster.faults.slow_load_fraction=0"] if a.faults_every_steps and "slow_load" in a.fault_kinds else []),
        *a.set]
    if a.manager_kill_every_s > 0 or a.manager_kills:  # every kill is restarted: the budget is the run's length
        overrides += ["manager.restarts=1000000", "manager.restart_window_s=1"]
    crashes = {"trainer_kills": 0, "manager_kills": 0}
    terminal = sys.stdout.isatty()  # a progress bar then owns the screen; JSON log lines go to <out>/logs/
    with logging_setup("trainer", run_id=RunDir(out).run_id(), log_dir=RunDir(out).logs, console=not terminal):
        return _chaos_run(a, out, overrides, n_remove, crashes, terminal)


def _chaos_run(a, out: Path, overrides: list[str], n_remove: int, crashes: dict, terminal: bool) -> int:
    import json

    from rlboost_hpc.config import load_config
    from rlboost_hpc.observe.report import Bar
    from rlboost_hpc.run import run

    if a.trainer_kills or a.manager_kills or a.manager_kill_every_s > 0:
        with Bar(a.steps, "step", enabled=terminal, transient=True) as bar:
            victims = ["any"] * a.trainer_kills + ["manager"] * a.manager_kills
            random.Random(a.seed + 13).shuffle(victims)
            rc = run_with_restarts(a.config, out, overrides, kill_steps(a.steps, len(victims)), a.kill_jitter_s,
                                   a.seed, crashes, bar=bar, manager_every_s=a.manager_kill_every_s,
                                   victims=victims)
        if rc != 0:
            print(f"rlboost-hpc chaos: FAIL — the final incarnation of the run exited {rc}, so no invariant could be "
                  f"checked (see {RunDir(out).report})", file=sys.stderr)
            return 1
        rep = json.loads(RunDir(out).report.read_text())
    else:
        rep = run(load_config(a.config, overrides), out, progress=terminal)
    faults = {"preemptions_with_warning": rep["preemptions_with_warning"],
              "kills_without_warning": rep["kills_without_warning"],
              "kills_during_weight_transfer": rep["instances_lost_while_pulling"],
              "stalls": rep["stalls"], "link_resets": rep["link_resets"],
              "slow_weight_loads": rep["slow_weight_loads"],
              "worker_starts": rep["worker_starts"], "trace_removals_planned": n_remove, **crashes,
              "resumes": rep.get("resumes", 0), "scheduled": rep.get("faults_scheduled") or {}}
    faults["total"] = sum(faults[k] for k in ("preemptions_with_warning", "kills_without_warning", "stalls",
                                              "link_resets", "slow_weight_loads", "trainer_kills", "manager_kills"))
    liveness = {k: rep[k] for k in ("instances_suspected", "instances_recovered", "deltas_out_of_order")}
    checks = {"responses_lost": rep["responses_lost"], "responses_duplicated": rep["responses_duplicated"],
              "tokens_trained_off_version": rep["tokens_trained_off_version"],
              "tokens_masked_too_stale": rep["tokens_masked_too_stale"],
              "prompts_not_trained_exactly_once": rep["prompts_not_trained_exactly_once"],
              "weight_checksum_mismatches": rep["weight_checksum_mismatches"]}
    print(json.dumps({"faults": faults, "liveness": liveness, "checks": checks, "steps": rep["steps"]}, indent=2))
    ok = all(v == 0 for v in checks.values())
    print(verdict(checks, rep["steps"], faults["total"]), file=sys.stderr)
    return 0 if ok else 1


def verdict(checks: dict[str, int], steps: int, faults: int) -> str:
    """The chaos run's last line: PASS or FAIL, then every invariant checked with its count (each must be 0) —
    what a user reads first (the JSON above it is for scripts)."""
    bad = [k for k, v in checks.items() if v]
    inv = ", ".join(f"{k} {v}" for k, v in checks.items())
    return (f"rlboost-hpc chaos: {'FAIL' if bad else 'PASS'} — {steps} steps, {faults} faults; invariants (each "
            f"must be 0): {inv}" + (f"; broken: {', '.join(bad)}" if bad else ""))


def _earlier_run(out: Path) -> list[str]:
    """What in ``out`` belongs to an earlier run (its checkpoints, manager journal, report)."""
    rd = RunDir(out)
    return [p.name for p in (rd.checkpoints, rd.journal, rd.report) if p.exists()]


def _forget_previous_run(out: Path) -> None:
    """Remove an earlier run's checkpoints, manager journal and work log from ``out`` (the harness's own output
    dir)."""
    import shutil

    shutil.rmtree(RunDir(out).checkpoints, ignore_errors=True)
    RunDir(out).journal.unlink(missing_ok=True)
    RunDir(out).work_log.unlink(missing_ok=True)


def _child_of(pid: int, parent: int) -> bool:
    """``pid`` runs and is a child of ``parent`` (a journal's manager pid may be reused once that manager died)."""
    import psutil

    try:
        return psutil.Process(pid).ppid() == parent
    except psutil.Error:
        return False


def kill_steps(steps: int, kills: int) -> list[int]:
    """Checkpoint steps after which the harness's ``kills`` trainer/manager kills fire: spread evenly over
    ``1 … steps − 1`` (``round((i + 1) · steps / (kills + 1))``), so each kill leaves steps to resume into.

    Raises:
        ValueError: more kills than ``steps − 1`` distinct checkpoints can separate.
    """
    if kills > max(0, steps - 1):
        raise ValueError(f"{kills} trainer/manager kills need at least {kills + 1} steps (got {steps})")
    return [max(1, min(steps - 1, round((i + 1) * steps / (kills + 1)))) for i in range(kills)]


def _kill(out: Path, proc, victim: str, forced: bool, starts: int, killed_pids: set[int], crashes: dict, sleep,
          poll_s: float) -> tuple[int | None, object, int]:
    """One kill of :func:`run_with_restarts`: the current manager (``victim == "manager"``; with ``forced``, waiting
    while the trainer (re)starts it), else — or when this incarnation's manager has not started — the trainer.
    Returns ``(exit code if the run ended first, else None; the run's process, None once the trainer was killed;
    the manager starts seen)``."""
    import signal

    from rlboost_hpc.manager.journal import read

    mgr = [r for r in read(RunDir(out).journal) if r.get("event") == "start"]
    while forced and proc.poll() is None and not (len(mgr) > starts and _child_of(int(mgr[-1]["pid"]), proc.pid)):
        sleep(poll_s)  # a scheduled manager kill waits for the manager the trainer is (re)starting
        mgr = [r for r in read(RunDir(out).journal) if r.get("event") == "start"]
    if proc.poll() is not None:
        return proc.returncode, proc, starts
    if victim == "manager" and len(mgr) > starts and int(mgr[-1]["pid"]) not in killed_pids:
        # the trainer restarts its manager, which continues the step from its work log: same incarnation
        os.kill(int(mgr[-1]["pid"]), signal.SIGKILL)
        killed_pids.add(int(mgr[-1]["pid"]))
        crashes["manager_kills"] += 1
        return None, proc, len(mgr)  # the next manager kill waits for the restarted manager's start
    proc.send_signal(signal.SIGKILL)  # (also when this incarnation's manager has not started yet)
    crashes["trainer_kills"] += 1
    proc.wait()
    return None, None, starts


def run_with_restarts(config: str, out: Path, overrides: list[str], at_steps: list[int], jitter_s: float,
                      seed: int, crashes: dict, poll_s: float = 0.1, bar=None, manager_every_s: float = 0.0,
                      victims: list[str] | None = None) -> int:
    """Run ``rlboost-hpc run`` as a child; SIGKILL the trainer or the manager once per entry of ``at_steps`` —
    ``victims[i]`` says whose (``"manager"``: the manager, waiting for it to be up if it is restarting; ``"any"``,
    the default: either, drawn). A
    killed trainer is started again (it resumes from its checkpoint); a killed manager is restarted by the trainer
    (the step in flight continues from the manager's work log), so the same incarnation goes on. Kill ``i`` fires ``uniform(0, jitter_s)`` seconds after
    the run's latest checkpoint reached ``max(at_steps[i], resumed step + 1)``. Returns the exit code of the final
    incarnation (or of one that ended before its kill). ``crashes`` receives ``trainer_kills`` / ``manager_kills``;
    ``bar`` (a :class:`~rlboost_hpc.observe.report.Bar`) shows the checkpointed steps. With ``manager_every_s``,
    the current manager is also SIGKILLed at exponential intervals of that mean (never again before the trainer has
    started its successor), throughout every incarnation."""
    import signal
    import subprocess
    import sys
    import time

    from rlboost_hpc.manager.journal import read
    from rlboost_hpc.trainer.checkpoint import latest_step

    rng = random.Random(seed + 7)
    mrng = random.Random(seed + 11)
    next_mkill = [time.monotonic() + mrng.expovariate(1 / manager_every_s) if manager_every_s > 0 else float("inf")]
    killed_pids: set[int] = set()

    def sleep(s: float) -> None:  # a wait that fires the periodic manager kills
        if time.monotonic() >= next_mkill[0]:
            mgr = [r for r in read(RunDir(out).journal) if r.get("event") == "start"]
            pid = int(mgr[-1]["pid"]) if mgr else 0
            if pid and pid not in killed_pids and proc is not None and _child_of(pid, proc.pid):
                killed_pids.add(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                    crashes["manager_kills"] += 1
                except ProcessLookupError:  # it ended on its own (an incarnation's end)
                    pass
            next_mkill[0] = time.monotonic() + mrng.expovariate(1 / manager_every_s)
        time.sleep(s)

    cmd = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", config, "--out", str(out), "--no-progress"]
    for o in overrides:
        cmd += ["--set", o]
    log = open(out / "chaos-runs.log", "ab")
    try:
        proc, starts, resumed = None, 0, -1
        for i in range(len(at_steps) + 1):
            if proc is None:  # a new incarnation: it resumes from the latest checkpoint
                starts = sum(r.get("event") == "start" for r in read(RunDir(out).journal))
                resumed = latest_step(out)
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            info = f"kill {i + 1}/{len(at_steps)}, killed trainer {crashes['trainer_kills']} " \
                   f"manager {crashes['manager_kills']}"
            target = max(at_steps[i], resumed + 1) if i < len(at_steps) else None
            while proc.poll() is None and (target is None or latest_step(out) < target):
                if bar is not None:
                    bar.set(max(0, latest_step(out)), info)
                sleep(poll_s)
            if target is None:
                return proc.wait()
            deadline = time.monotonic() + rng.uniform(0.0, jitter_s)
            while time.monotonic() < deadline and proc.poll() is None:
                sleep(poll_s / 2)
            if proc.poll() is not None:  # finished (or failed) before its kill: nothing left to crash
                return proc.returncode
            # (with periodic manager kills every kill of the schedule is the trainer's)
            forced = victims[i] == "manager" if victims else False
            victim = "manager" if forced else "trainer" if manager_every_s > 0 else rng.choice(["trainer", "manager"])
            ended, proc, starts = _kill(out, proc, victim, forced, starts, killed_pids, crashes, sleep, poll_s)
            if ended is not None:
                return ended
        return 0
    finally:
        log.close()
