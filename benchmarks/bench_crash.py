"""Benchmark: what a crash of the rollout manager or of the trainer costs, before and after the work log (issue 33).

Each run is the real thing — ``rlboost-hpc run`` as a child process on the local cluster (the reserved engine and
two preemptible workers, real processes and sockets) — and each kill is a SIGKILL while a step's rollout is in
flight: after step record ``k`` is written and the work log holds tokens of the next step, plus ``--delay-s``.
Modes, side by side on the same config and kill points:

- ``none``: no kill (the wall-time baseline).
- ``manager/after``: the manager is killed; the trainer restarts it (``manager.restarts``) and the new manager
  continues the step from its work log, its instances resending what they hold.
- ``manager/before``: the manager is killed with ``manager.restarts = 0`` and the work log deleted: the trainer
  exits 1 and the run is started again, resuming from its checkpoint — the step is generated again (what every
  manager crash cost before).
- ``trainer/after``: the trainer is killed and started again; it resumes from its checkpoint and the new manager
  restores the work log: responses of the checkpoint's version are reused, others discarded and counted.
- ``trainer/before``: the same with the work log deleted before the restart (the step generated again).

Printed per mode: wall seconds to finish the run, seconds lost per kill (÷ the ``none`` run), tokens the
restarted manager restored from its work log, responses its instances adopted (tokens kept), tokens of a
discarded version, seconds from the kill to the end of the restarted manager's hold (the step's work running
again) and the exactly-once checks. Shapes: ``--shape demo`` (8 × 8, 48 tokens) and ``--shape paper`` (32 × 8,
256 tokens).

Run: ``.venv/bin/python benchmarks/bench_crash.py [--shape demo paper] [--kills 2] [--steps 6]``
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlboost_hpc.manager import worklog as W  # noqa: E402
from rlboost_hpc.manager.journal import read as read_journal  # noqa: E402
from rlboost_hpc.rundir import RunDir  # noqa: E402

SHAPES = {"demo": [], "paper": ["rollout.prompts_per_step=32", "rollout.max_new_tokens=256"]}
MODES = ("none", "manager/after", "manager/before", "trainer/after", "trainer/before")


def _lines(rd: RunDir) -> int:
    return len(rd.metrics.read_text().splitlines()) if rd.metrics.exists() else 0


def _start(out: Path, overrides: list[str], log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--out", str(out), "--no-progress"]
    for o in overrides:
        cmd += ["--set", o]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _wait_for_rollout(rd: RunDir, proc: subprocess.Popen, after_line: int, delay_s: float) -> bool:
    """Until step record ``after_line`` is written and the work log holds tokens of the next step; False if the
    run ended first."""
    while proc.poll() is None and _lines(rd) < after_line:
        time.sleep(0.02)
    while proc.poll() is None and not any(isinstance(r, W.Frame) for r in W.read(rd.work_log)[0]):
        time.sleep(0.01)
    time.sleep(delay_s)
    return proc.poll() is None


def run_mode(mode: str, shape: str, args) -> dict:
    """One run of ``mode`` (see the module docstring); its figures."""
    victim, _, when = mode.partition("/")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "run"
        rd = RunDir(out)
        overrides = [f"trainer.steps={args.steps}", "trainer.checkpoint_every=1", *SHAPES[shape]]
        if mode == "manager/before":
            overrides.append("manager.restarts=0")
        at = [round((i + 1) * args.steps / (args.kills + 1)) for i in range(args.kills)] if victim != "none" else []
        log = open(Path(d) / "runs.log", "ab")
        t0 = time.monotonic()
        proc = _start(out, overrides, log)
        kills: list[float] = []
        for line in at:
            if not _wait_for_rollout(rd, proc, line, args.delay_s):
                break
            kills.append(time.time())
            if victim == "manager":
                starts = [r for r in read_journal(rd.journal) if r.get("event") == "start"]
                os.kill(int(starts[-1]["pid"]), signal.SIGKILL)
                if when == "before":  # the trainer exits 1; start it again as a requeue would
                    proc.wait()
                    rd.work_log.unlink(missing_ok=True)
                    proc = _start(out, overrides, log)
            else:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                if when == "before":
                    rd.work_log.unlink(missing_ok=True)
                proc = _start(out, overrides, log)
        rc = proc.wait(timeout=1800)
        wall = time.monotonic() - t0
        log.close()
        if rc != 0:
            raise RuntimeError(f"{mode}: the run exited {rc}; see {Path(d) / 'runs.log'}")
        rep = json.loads(rd.report.read_text())
        restored, holds = [], []
        for line in (rd.logs / "manager.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "restored from the work log" in rec["msg"]:
                restored.append(int(rec["msg"].split(" unfinished, ")[1].split(" tokens")[0]))
            elif "the hold after the restart is over" in rec["msg"]:
                holds.append(rec["ts"])
        resume_s = [h - k for k, h in zip(kills, holds)] if len(holds) >= len(kills) else []
        return dict(mode=mode, shape=shape, kills=len(kills), wall_s=wall, tokens_restored=sum(restored),
                    adopted=rep["responses_adopted"], discarded=rep["tokens_discarded_stale"],
                    resume_s=sum(resume_s) / len(resume_s) if resume_s else float("nan"),
                    restarts=rep["manager_restarts"], resumes=rep["resumes"],
                    ok=(rep["responses_lost"] == rep["responses_duplicated"] == rep["tokens_trained_off_version"]
                        == rep["prompts_not_trained_exactly_once"] == 0 and rep["steps"] == args.steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["demo"])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--delay-s", type=float, default=0.3, help="after the step's first journaled tokens")
    args = ap.parse_args()
    print(f"{args.steps} steps, {args.kills} kills per run, each {args.delay_s} s after a step's rollout began; "
          f"{os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f}")
    hdr = (f"{'shape':>5} {'mode':>15} {'kills':>5} {'wall s':>7} {'lost s/kill':>11} {'tok restored':>12} "
           f"{'adopted':>7} {'discarded':>9} {'kill→resumed s':>14} {'restarts':>8} {'resumes':>7} {'check':>5}")
    print(hdr)
    print("-" * len(hdr))
    for shape in args.shape:
        base = None
        for mode in args.modes:
            r = run_mode(mode, shape, args)
            if mode == "none":
                base = r["wall_s"]
            lost = (r["wall_s"] - base) / r["kills"] if base is not None and r["kills"] else float("nan")
            print(f"{shape:>5} {mode:>15} {r['kills']:>5} {r['wall_s']:>7.1f} {lost:>11.2f} {r['tokens_restored']:>12} "
                  f"{r['adopted']:>7} {r['discarded']:>9} {r['resume_s']:>14.2f} {r['restarts']:>8} {r['resumes']:>7} "
                  f"{'ok' if r['ok'] else 'FAIL':>5}", flush=True)
    print("lost s/kill = (wall − the none run's wall) ÷ kills; tok restored = tokens the restarted managers read back "
          "from the work log; adopted = unfinished responses instances resent and kept; kill→resumed = kill → the "
          "restarted manager's hold over (its instances resent, the rest queued).")


if __name__ == "__main__":
    main()
