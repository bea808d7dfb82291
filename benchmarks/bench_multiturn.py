"""Tokens regenerated per migrated trajectory: resuming at the token (this project) vs restarting the interrupted
turn vs restarting the whole trajectory — measured on one real run with tool calls and preemptions.

The run is the local demo (stories260K, the spot trace replayed, preemptions held until the victim holds partial
responses) with multi-turn trajectories: ``task.turns.max`` turns, "." closes a tool call (the calculator answers;
stories are not arithmetic, so the observations are error messages — the mechanics are what is measured). Every time
a partial trajectory moves to another instance (a preemption's hand-off, the end of seeding, a lost instance), the
manager counts what each strategy would regenerate:

* resume at the token: only tokens the lost instance generated and never sent (``tokens_regenerated``);
* restart the interrupted turn: + the tokens of that turn received so far (``tokens_in_interrupted_turns``);
* restart the trajectory: + every assistant token of the trajectory so far
  (``assistant_tokens_in_interrupted_trajectories``), and its earlier tool calls run again.

Run: ``.venv/bin/python benchmarks/bench_multiturn.py [--steps 8] [--max-turns 4] [--max-new-tokens 32]``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32, help="per turn")
    ap.add_argument("--workers", type=int, default=2, help="preemptible workers (cluster.max_workers)")
    ap.add_argument("--kill-fraction", type=float, default=0.5,
                    help="share of preemptions that are SIGKILLs without warning (cluster.kill_fraction)")
    a = ap.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="rlboost-multiturn-")) / "run"
    sets = [f"trainer.steps={a.steps}", f"task.turns.max={a.max_turns}", "task.turns.tool_call_open=''",
            "task.turns.tool_call_close='.'", f"rollout.max_new_tokens={a.max_new_tokens}",
            "cluster.preempt_when_busy=true", f"cluster.max_workers={a.workers}",
            f"cluster.kill_fraction={a.kill_fraction}", "policy.cap=false"]
    cmd = [sys.executable, "-m", "rlboost_hpc.cli", "run", "--config", str(ROOT / "configs/local.toml"), "--out",
           str(out), "--no-progress"] + [x for s in sets for x in ("--set", s)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        print(p.stderr[-3000:], file=sys.stderr)
        return 1
    r = json.loads((out / "report.json").read_text())
    by_turn = {int(t): n for t, n in r["migrations_by_turn"].items()}
    moved = sum(by_turn.values())
    resume = r["tokens_regenerated"]
    restart_turn = resume + r["tokens_in_interrupted_turns"]
    restart_traj = resume + r["assistant_tokens_in_interrupted_trajectories"]
    tools_again = sum(t * n for t, n in by_turn.items())
    print(f"run: {r['steps']} steps, {r['responses_trained']} trajectories, {r['turns_per_trajectory_mean']:.2f} "
          f"turns each, {r['environment_calls']} tool calls ({r['environment_seconds']:.2f} s, "
          f"{100 * r['tool_time_share']:.1f} % of the training wall time), {r['preemptions']} preemptions "
          f"({r['kills_without_warning']} without warning), "
          f"{moved} partial trajectories migrated (by turn: {dict(sorted(by_turn.items()))})")
    print(f"lost {r['responses_lost']}, duplicated {r['responses_duplicated']}, off-version tokens "
          f"{r['tokens_trained_off_version']}, not trained exactly once {r['prompts_not_trained_exactly_once']}")
    if not moved:
        print("no partial trajectory migrated: nothing to compare (raise --steps)")
        return 1
    print(f"{'strategy':<28} {'tokens regenerated':>19} {'per migration':>14} {'× resume':>9}")
    for name, tok in (("resume at the token", resume), ("restart the turn", restart_turn),
                      ("restart the trajectory", restart_traj)):
        ratio = f"{tok / resume:.1f}" if resume else "n/a"
        print(f"{name:<28} {tok:>19} {tok / moved:>14.2f} {ratio:>9}")
    print(f"restarting the trajectory would also re-run {tools_again} tool calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
