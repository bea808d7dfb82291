"""Per-turn overhead of an environment reached over the network (issue 58's performance goal: ≤ 2 ms per turn beyond
the environment's own time, on loopback), and one process holding many concurrent OpenEnv sessions.

The environment is the counter of ``examples/env_counter`` in both shapes: the user's class (``envs.py:Counter``) and
the same counter as an OpenEnv server (``examples/openenv_counter/server.py``, ``openenv-core``, its own process). Per
turn, in one run:

* **own time** — the class's ``step`` called in this process (the physical limit of a turn: nothing but the
  environment's own work);
* **OpenEnv session** — :class:`~rlboost_hpc.tasks.openenv.OpenEnvEpisode.step`: one WebSocket round trip to the
  server (which runs the same counter, pydantic validation and JSON around it);
* **tool process, class** / **tool process, OpenEnv** — what the manager pays per turn: a
  :class:`~rlboost_hpc.tasks.environment.EnvironmentCalls` call (the pipe to a persistent tool process, the turn's
  ids decoded, the observation rendered into ids with the tokenizer) around each of the two.

Then ``--sessions`` OpenEnv episodes open at once in this process (one event loop, one socket each), every one
reset and stepped ``--turns`` times, interleaved: turns lost (an answer missing or wrong) must be 0.

Run: ``.venv/bin/python benchmarks/bench_env_overhead.py [--turns 400] [--sessions 1000]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples/env_counter"))

ROW = {"prompt": "Tom had a toy car.", "start": 5, "target": 100_000}  # never reached: every turn a full step
MOVES = ("up", "down up", "up", "down")


def per_turn_ms(fn, turns: int) -> float:
    """Median of 5 rounds of ``turns`` calls of ``fn(k)``, milliseconds per call."""
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for k in range(turns):
            fn(k)
        rounds.append((time.perf_counter() - t) / turns * 1e3)
    return statistics.median(rounds)


def start_server(port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples/openenv_counter/server.py"), "--port", str(port),
                             "--max-sessions", "4096"], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the OpenEnv server did not start: {log.read_text()[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--turns", type=int, default=400, help="turns per timed round")
    ap.add_argument("--sessions", type=int, default=1000, help="OpenEnv sessions open at once")
    ap.add_argument("--session-turns", type=int, default=3, help="steps per session in the concurrency part")
    a = ap.parse_args(argv)

    import numpy as np
    from envs import Counter

    from rlboost_hpc.config_task import EnvironmentCfg, OpenEnvCfg
    from rlboost_hpc.models.llama2c import ensure_converted
    from rlboost_hpc.rollout.engines.sglang_server import free_port
    from rlboost_hpc.tasks.environment import EnvironmentCalls, EnvironmentRunner, TurnCall, row_json
    from rlboost_hpc.tasks.openenv import OpenEnvEpisode

    tmp = Path(tempfile.mkdtemp(prefix="rlboost-env-overhead-"))
    model = ensure_converted(tmp / "models")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    turn_ids = [np.asarray(tok.encode(m, add_special_tokens=False), dtype="<i4").tobytes() for m in MOVES]
    port = free_port()
    server = start_server(port, tmp / "server.log")
    cfg = OpenEnvCfg(url=f"http://127.0.0.1:{port}", observation_field="text", reset_columns=["start", "target"])
    rows = []
    try:
        own = Counter()
        own.reset(ROW)
        rows.append(("own time (the class's step, in process)", per_turn_ms(lambda k: own.step(MOVES[k % 4]),
                                                                             a.turns)))
        ep = OpenEnvEpisode(cfg, timeout_s=10)
        ep.reset(ROW)
        rows.append(("OpenEnv session (one WebSocket round trip)", per_turn_ms(lambda k: ep.step(MOVES[k % 4]),
                                                                               a.turns)))
        ep.close()
        for name, runner in (("tool process, class", EnvironmentRunner(
                                  str(ROOT / "examples/env_counter/envs.py:Counter"), tokenizer_dir=str(model),
                                  plain_format="\n{result}\n")),
                             ("tool process, OpenEnv", EnvironmentRunner.of(
                                  EnvironmentCfg(openenv=cfg), timeout_s=10,
                                  tokenizer_dir=str(model), plain_format="\n{result}\n"))):
            calls = EnvironmentCalls(runner, workers=1, timeout_s=10)
            try:
                row = row_json(ROW)
                first = calls.reset_all([row], ["row"])[0]
                history: list = []

                def turn(k: int, calls=calls, row=row, first=first, history=history) -> None:
                    o = calls.observe_all({0: TurnCall("t", len(history), turn_ids[k % 4], row, first,
                                                       tuple(history))})[0]
                    if o.status != "ok":
                        raise SystemExit(f"{name}: {o.status} {o.error}")
                    history.append((turn_ids[k % 4], np.asarray(o.obs_ids, dtype="<i4").tobytes(), o.reward))

                rows.append((f"{name} (EnvironmentCalls: pipe, decode, render)", per_turn_ms(turn, a.turns // 4)))
            finally:
                calls.close()

        # many sessions at once: one event loop, one socket each, turns interleaved across sessions
        t0 = time.perf_counter()
        eps = [OpenEnvEpisode(cfg, timeout_s=60) for _ in range(a.sessions)]
        with ThreadPoolExecutor(64) as pool:
            firsts = list(pool.map(lambda e: e.reset({**ROW, "start": 5}), eps))
            opened_s = time.perf_counter() - t0
            live = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/sessions").read())["open"]
            t1 = time.perf_counter()
            answers = [list(pool.map(lambda e: e.step("up"), eps)) for _ in range(a.session_turns)]
            step_s = time.perf_counter() - t1
            list(pool.map(lambda e: e.close(), eps))
        lost = sum(f != "Counter 5, target 100000: up or down?" for f in firsts) + sum(
            ans[0] != f"Counter {6 + k}, target 100000: up or down?" for k, round_ in enumerate(answers) for ans in round_)
        left = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/sessions").read())["open"]
    finally:
        server.kill()

    own_ms = rows[0][1]
    print(f"per-turn cost on loopback, {a.turns} turns per round, median of 5 rounds (stories260K tokenizer)")
    print(f"{'path':66s} {'ms/turn':>9s} {'beyond own':>11s} {'× own':>9s}")
    for name, ms in rows:
        print(f"{name:66s} {ms:9.3f} {ms - own_ms:11.3f} {ms / own_ms:9.1f}")
    print(f"physical limit: the environment's own time, {own_ms:.3f} ms per turn on one core (0 beyond it); "
          "goal: ≤ 2 ms beyond it")
    print(f"{a.sessions} OpenEnv sessions at once: opened and reset in {opened_s:.2f} s ({live} open on the server), "
          f"{a.session_turns} steps each in {step_s:.2f} s ({a.sessions * a.session_turns / step_s:,.0f} turns/s); "
          f"turns lost {lost}; sessions left open after close {left}")
    return 0 if lost == 0 and left == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
