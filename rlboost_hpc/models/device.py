"""Where a model runs: the one resolution of the ``device`` / ``dtype`` settings (``auto|cpu|cuda``,
``auto|float32|bfloat16``) used by the trainer backend, the reserved engine, rollout workers and evaluation.

Invariants: ``auto`` is CUDA when a CUDA device is visible (a Slurm job sees the GPUs of its allocation through
``CUDA_VISIBLE_DEVICES``), else the CPU; the ``auto`` dtype is bf16 on CUDA and fp32 on the CPU. Asking for
``cuda`` where there is none is a :class:`DeviceError` naming the setting, never a silent CPU run.
"""
from __future__ import annotations

import torch
from rlboost_hpc.errors import BadInput

__all__ = ["DeviceError", "resolve_device", "resolve_dtype", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(BadInput, ValueError):
    """A requested device or dtype is not available here; the message names the setting."""


def resolve_device(name: str, setting: str = "device") -> torch.device:
    """``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` → a torch device (see the module docstring).

    Raises:
        DeviceError: CUDA asked for without a visible CUDA device, or an unknown name.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(f"{setting} = {name!r} but no CUDA device is visible (torch {torch.__version__}, "
                              f"CUDA_VISIBLE_DEVICES decides which GPUs a job sees); use 'auto' or 'cpu'")
        return torch.device(name)
    raise DeviceError(f"{setting} = {name!r}: expected auto, cpu or cuda")


def resolve_dtype(name: str, device: torch.device, setting: str = "dtype") -> torch.dtype:
    """``"auto"`` (bf16 on CUDA, fp32 on the CPU) or a dtype name → a torch dtype.

    Raises:
        DeviceError: an unknown name.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise DeviceError(f"{setting} = {name!r}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]
