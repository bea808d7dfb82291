"""Run under ``python -m megatron_bridge.launch --nproc-per-node 2 --tp 2 tests/megatron_idle.py IDLE_S``: the
leader makes a collective call, idles ``IDLE_S`` seconds (a step's rollout) and calls again; prints OK."""
import sys
import time

import torch

from megatron_bridge.backend import MegatronBackend
from megatron_scenarios import make_samples, tiny_hf

torch.set_num_threads(1)
cfg, sd = tiny_hf("llama", vocab=256)
b = MegatronBackend(cfg, sd, lr=1e-4)
batch = make_samples(4, 256, seed=1)
b.accumulate(batch, 4)
time.sleep(float(sys.argv[1]))
b.accumulate(batch, 4)
b.optimizer_step()
print("OK", flush=True)
