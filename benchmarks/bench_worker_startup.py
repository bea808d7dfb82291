"""Time from a rollout worker's process start to its first streamed token, split into phases.

Starts the real manager process and weight server (stories260K, bf16), submits work, then spawns real
``python -m rlboost_hpc.rollout.worker`` processes one at a time and reads the phases each worker logs
(process start → agent start [interpreter + imports] → Welcome [registration] → weights loaded [pull over
N streams + verify + load] → first token [assignment + prefill + decode]). Also prints the trainer-side view:
Popen → the manager has the worker's first token.

Usage: python benchmarks/bench_worker_startup.py [--repeats 3]
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

from rlboost_hpc.manager.service import spawn_manager
from rlboost_hpc.manager.settings import ManagerSettings
from rlboost_hpc.models.hf_dir import load_model_dir
from rlboost_hpc.models.llama2c import ensure_converted
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.trainer.client import ManagerClient
from rlboost_hpc.weights.server import WeightServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    policy = load_model_dir(ensure_converted(Path(tempfile.mkdtemp())))
    config, sd = policy.arch, policy.state_dict
    server = WeightServer().start()
    mproc, endpoint, _ = spawn_manager(ManagerSettings(pending_limit=32, heartbeat_s=0.25, heartbeat_timeout_s=2.0))
    client = ManagerClient(endpoint)
    client.call(M.TrainerHello(weights_endpoint=server.endpoint, model_config=policy.hf_config,
                               model_arch=config.to_json()))
    man = server.publish(0, sd, dtype=torch.bfloat16)
    client.call(M.SetVersion(version=0))
    rows = []
    for rep in range(args.repeats):
        spec = M.GroupSpec(gid=f"r{rep}", prompt_ids=[1, 403, 407], n=8, max_new_tokens=64, temperature=1.0,
                           top_p=1.0, seed=rep, stop_ids=[])
        client.call(M.SubmitStep(step=rep, version=0, groups=[spec]))
        before = client.stats().tokens_received
        t0 = time.time()
        p = subprocess.Popen([sys.executable, "-m", "rlboost_hpc.rollout.worker", "--manager", endpoint,
                              "--job-id", "bench", "--attempt", str(rep)], stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, RLBOOST_LOG_LEVEL="INFO", RLBOOST_SPAWNED_AT=repr(t0)))
        while client.stats().tokens_received == before:
            time.sleep(0.005)
        t_first = time.time() - t0
        while not isinstance(client.next_event(60), M.GroupDone):
            pass
        p.terminate()
        _, err = p.communicate(timeout=30)
        phases = {}
        for line in err.splitlines():
            if "startup phases" in line:
                phases = json.loads(json.loads(line)["msg"].split("startup phases ", 1)[1])
        rows.append((phases, t_first))
    client.call(M.Shutdown(reason="bench done"))
    mproc.join(10)
    server.close()
    keys = list(rows[0][0])
    print(f"weights: {man.total_bytes / 1e6:.2f} MB bf16 (stories260K), 4 streams, loopback")
    print("phase".ljust(44) + "".join(f"run{i}".rjust(10) for i in range(len(rows))) + "mean".rjust(10))
    for k in keys:
        vals = [r[0].get(k, float("nan")) for r in rows]
        print(k.ljust(44) + "".join(f"{v:10.3f}" for v in vals) + f"{sum(vals) / len(vals):10.3f}")
    vals = [r[1] for r in rows]
    print("Popen -> manager has first token (trainer view)".ljust(44) + "".join(f"{v:10.3f}" for v in vals)
          + f"{sum(vals) / len(vals):10.3f}")


if __name__ == "__main__":
    main()
