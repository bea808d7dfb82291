"""Test aid: a rollout worker process whose engine is slow on purpose (``TorchEngine`` with sleeps).

``python tests/slow_worker.py ENDPOINT WEIGHTS_ENDPOINT JOB --build-s 6 --first-step-s 10 --load-s 30``: building
the engine sleeps ``--build-s``, its first ``step()`` ``--first-step-s``, every later ``load_weights``
``--load-s`` (an SGLang server loading gigabytes, a first token after a compile). Exits with the agent's code.
"""
from __future__ import annotations

import argparse
import sys
import time

from rlboost_hpc.models.arch import arch_from_hf
from rlboost_hpc.rollout.agent import RolloutAgent
from rlboost_hpc.rollout.remote_weights import RemoteWeights
from rlboost_hpc.rollout.engines.torch_engine import TorchEngine


class SlowEngine(TorchEngine):
    first_step_s = 0.0
    load_s = 0.0

    def step(self):
        if self.first_step_s:
            time.sleep(self.first_step_s)
            self.first_step_s = 0.0
        return super().step()

    def load_weights(self, state_dict, version):
        time.sleep(self.load_s)
        super().load_weights(state_dict, version)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("endpoint")
    p.add_argument("weights")
    p.add_argument("job")
    p.add_argument("--build-s", type=float, default=0.0)
    p.add_argument("--first-step-s", type=float, default=0.0)
    p.add_argument("--load-s", type=float, default=0.0)
    a = p.parse_args()

    def factory(model_config, sd, arch=None):
        time.sleep(a.build_s)
        eng = SlowEngine(arch or arch_from_hf(model_config), sd, max_batch=8)
        eng.first_step_s, eng.load_s = a.first_step_s, a.load_s
        return eng

    agent = RolloutAgent(a.endpoint, a.job, 0, engine_factory=factory, manager_timeout_s=10.0,
                         weights=RemoteWeights(2, 4, 30.0))
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
