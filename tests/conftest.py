"""Shared pytest fixtures (others may append; keep each fixture cheap or session-scoped)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The project root (the directory holding pyproject.toml)."""
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def stories260k_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K converted once per session into an HF dir (config.json, model.safetensors, tok512.bin)."""
    from rlboost_hpc.models.llama2c import ensure_converted

    return ensure_converted(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session", autouse=True)
def _stop_local_slurm_we_started():
    """Stop the local Slurm cluster at the end of the session if a test of this session started it."""
    yield
    from rlboost_hpc.cluster.slurm_local import started_by_this_process, stop_local_slurm

    if started_by_this_process():
        stop_local_slurm()
