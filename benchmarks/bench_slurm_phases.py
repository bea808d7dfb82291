"""Node idle → first streamed token of a Slurm rollout job, split into phases, and preemption signal → the
job's last in-flight token at the manager, on the local Slurm cluster (sbatch/local-cluster), side by side with
what the simulator assumes (sim/profiles.py: ``boot_s``, ``switch_to_rollout_s``; the grace time).

One run (repeated ``--repeats`` times on an idle cluster):

1. a manager, a weight server (stories260K, bf16) and a trainer client run here; the run directory holds
   ``endpoints.json`` with the worker spec, as a trainer job writes it;
2. ``sbatch sbatch/rollout.sbatch`` (1 GPU) at t_submit; phases: submit → the worker process starts (Slurm
   scheduling + batch shell: the rest of the total), interpreter + imports, registration (→ Welcome), weight
   pull + verify + load, first token produced (the worker's own startup phases); total = submit → the
   manager has the instance's first token;
3. while the job generates long responses, a high-priority exclusive job lands on its node: Slurm sends USR2
   (the warning, ``--signal=B:USR2@10``); measured: the worker's ``warned_at`` → the manager has its
   Deregister (every produced token was flushed before it), and → the worker holds the manager's Farewell (it may
   exit), against the partition's grace time.

Usage: python benchmarks/bench_slurm_phases.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the local Slurm cluster's helper
from _slurm_local import ensure_local_slurm  # noqa: E402
from rlboost_hpc.events import read_events
from rlboost_hpc.manager.service import spawn_manager
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.models.hf_dir import load_model_dir
from rlboost_hpc.models.llama2c import ensure_converted
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.rollout.spec import WorkerSpec
from rlboost_hpc.rundir import RunDir
from rlboost_hpc.sim.profiles import profile
from rlboost_hpc.trainer.client import ManagerClient
from rlboost_hpc.weights.server import WeightServer

REPO = Path(__file__).resolve().parent.parent


def sh(args: list[str], env: dict) -> str:
    return subprocess.run(args, capture_output=True, text=True, env=env, check=True, timeout=60).stdout


def job_record(env: dict, job: str) -> dict:
    for j in json.loads(sh(["squeue", "--json"], env))["jobs"]:
        if str(j["job_id"]) == job:
            return j
    return {}


def number(v) -> float:
    return float(v.get("number", 0) if isinstance(v, dict) else (v or 0))


def wait(pred, timeout: float, what: str, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise SystemExit(f"bench_slurm_phases: timed out waiting for {what}")


def one_run(rep: int, env: dict, run_dir: Path, client: ManagerClient) -> dict:
    spec = M.GroupSpec(gid=f"r{rep}", prompt_ids=[1, 403, 407], n=32, max_new_tokens=400, temperature=1.0,
                       top_p=1.0, seed=rep, stop_ids=[])
    client.call(M.SubmitStep(step=rep, version=0, groups=[spec]))
    t_submit = time.time()
    job = sh(["sbatch", "--parsable", "-p", "scavenger", "--gres", "gpu:1", "--output",
              str(run_dir / f"rollout-{rep}-%j.out"),
              f"--export=ALL,RLBOOST_RUN_DIR={run_dir},RLBOOST_PYTHON={sys.executable},RLBOOST_LOG_LEVEL=INFO",
              str(REPO / "sbatch/rollout.sbatch")], env).strip().split(";")[0]
    key = f"{job}#0"

    def inst():
        return client.stats().instances.get(key)

    first = wait(lambda: (i := inst()) is not None and i.tokens_received > 0 and time.time(), 120, "the first token")
    rec = job_record(env, job)
    slurm_wait = number(rec.get("start_time")) - number(rec.get("submit_time"))  # Slurm's clock, 1 s resolution
    node = rec.get("nodes") or ""
    # the preemption: an exclusive high-priority job on the rollout job's node
    wait(lambda: (i := inst()) is not None and i.inflight > 0, 30, "in-flight work")
    time.sleep(1.0)
    hp = sh(["sbatch", "--parsable", "-p", "train", "--nodelist", node, "--exclusive", "--gres", "gpu:2",
             "--wrap", "sleep 3"], env).strip()
    t_gone = wait(lambda: key not in client.stats().instances and time.time(), 60,
                  "the preempted instance to deregister")
    warned = wait(lambda: next((e for e in read_events(run_dir) if e["event"] == "warned" and e["job_id"] == job),
                               None), 30, "the warned event")
    out = (run_dir / f"rollout-{rep}-{job}.out").read_text(errors="replace")  # logged after the first token
    phases, t_farewell = {}, float("nan")
    for line in out.splitlines():
        if "startup phases" in line:
            phases = json.loads(json.loads(line)["msg"].split("startup phases ", 1)[1])
        if "confirmed the drain" in line:  # the worker holds the manager's Farewell: it may exit
            t_farewell = json.loads(line)["ts"]
    subprocess.run(["scancel", job, hp], env=env, capture_output=True)
    while client.next_event(0.5) is not None:  # the step's groups (finished by later instances or dropped)
        pass
    return {
        "submit -> worker process starts (Slurm + shell)": first - t_submit - sum(phases.values()),
        "  Slurm's own start - submit (1 s resolution)": slurm_wait,
        "interpreter + imports (-> agent start)": phases.get("process_start->agent_start_s", float("nan")),
        "registration (-> Welcome)": phases.get("agent_start->welcome_s", float("nan")),
        "weight pull + verify + load (-> weights loaded)": phases.get("welcome->weights_loaded_s", float("nan")),
        "first token (-> produced)": phases.get("weights_loaded->first_token_s", float("nan")),
        "node idle -> first token at the manager": first - t_submit,
        "warning -> last in-flight token at the manager": t_gone - warned["warned_at"],
        "warning -> drain confirmed at the worker (Farewell)": t_farewell - warned["warned_at"],
        "(warned cause)": warned.get("cause"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    env = dict(os.environ, **ensure_local_slurm())
    grace = float(env.get("RLBOOST_SLURM_GRACE", "10"))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    policy = load_model_dir(ensure_converted(run_dir / "model"))
    server = WeightServer().start()
    # (with the run's work log: a Farewell waits for the commit that holds the Deregister, as in a run)
    mproc, endpoint, _ = spawn_manager(ManagerSettings(pending_limit=64, heartbeat_s=0.25, heartbeat_timeout_s=4.0),
                                       run_id="bench-slurm", work_log=str(run_dir / "manager-work.log"))
    client = ManagerClient(endpoint)
    client.call(M.TrainerHello(weights_endpoint=server.endpoint, model_config=policy.hf_config,
                               model_arch=policy.arch.to_json()))
    man = server.publish(0, policy.state_dict, dtype=torch.bfloat16)
    client.call(M.SetVersion(version=0))
    RunDir(run_dir).write_endpoints(endpoint, server.endpoint, run_id="bench-slurm", worker=WorkerSpec().to_json())
    rows = []
    try:
        for rep in range(args.repeats):
            rows.append(one_run(rep, env, run_dir, client))
            time.sleep(4)  # the high-priority job ends; the node is idle again
    finally:
        client.call(M.Shutdown(reason="bench done"))
        mproc.join(10)
        server.close()
    p8 = profile("8b")
    assumed = {"node idle -> first token at the manager": f"sim boot_s {p8.boot_s:.0f} s (8B, container + engine)",
               "weight pull + verify + load (-> weights loaded)": "sim: model bytes / (0.8 x NIC)",
               "warning -> last in-flight token at the manager": f"grace {grace:.0f} s",
               "warning -> drain confirmed at the worker (Farewell)": f"grace {grace:.0f} s"}
    print(f"weights: {man.total_bytes / 1e6:.2f} MB bf16 (stories260K); local Slurm 22.05, {args.repeats} runs")
    print("phase".ljust(50) + "".join(f"run{i}".rjust(9) for i in range(len(rows))) + "mean".rjust(9)
          + "   compared with")
    for k in rows[0]:
        vals = [r[k] for r in rows]
        if isinstance(vals[0], str) or vals[0] is None:
            print(k.ljust(50) + "".join(f"{str(v):>10}" for v in vals))
            continue
        mean = sum(vals) / len(vals)
        print(k.ljust(50) + "".join(f"{v:9.3f}" for v in vals) + f"{mean:9.3f}   {assumed.get(k, '')}")
    mean_warn = sum(r["warning -> last in-flight token at the manager"] for r in rows) / len(rows)
    print(f"ratio warning->last token / grace: {mean_warn / grace:.4f}")


if __name__ == "__main__":
    main()
