"""Every RNG state of one rank, saved and restored together (checkpoints resume the exact random stream).

Covers Python's ``random``, NumPy's global generator, torch's CPU generator, CUDA's (when present) and
Megatron-core's model-parallel RNG tracker (dropout and initialisation per TP rank).
"""
from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every RNG this rank uses: Python, NumPy, torch CPU, CUDA (if present) and Megatron's tracker."""
    from megatron.core import tensor_parallel

    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
          "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (same keys; ``cuda`` only applied when CUDA is present)."""
    from megatron.core import tensor_parallel

    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(st["tracker"])
