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
    from _slurm_local import started_by_this_process, stop_local_slurm

    if started_by_this_process():
        stop_local_slurm()


# Set in os.environ by pytest itself (per test phase) and by torch on first use (its default inductor cache
# directory, once per process): not state a test leaks.
_SET_BY_LIBRARIES = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})


@pytest.fixture(autouse=True)
def _no_state_leaks_between_tests():
    """Fail a test that leaves the process environment or working directory changed, and restore both.

    A test needing an environment variable sets it with ``monkeypatch`` (undone before this check runs). Product
    code never configures anything through ``os.environ`` of the calling process (an in-process ``run()`` that
    did so once leaked its run id into every later test's subprocesses).
    """
    import os

    def snapshot() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k not in _SET_BY_LIBRARIES}

    env, cwd = snapshot(), os.getcwd()
    yield
    now_env, now_cwd = snapshot(), os.getcwd()
    changed = sorted(k for k in set(env) | set(now_env) if env.get(k) != now_env.get(k))
    for k in changed:
        if k in env:
            os.environ[k] = env[k]
        else:
            os.environ.pop(k, None)
    if now_cwd != cwd:
        os.chdir(cwd)
    assert not changed, f"the test left environment variables changed: {changed}"
    assert now_cwd == cwd, f"the test left the working directory changed: {now_cwd} (was {cwd})"


@pytest.fixture(autouse=True)
def _no_slurm_jobs_left_behind(request):
    """After a ``slurm`` test the local cluster's queue is empty: a test that leaves jobs behind fails (they are
    cancelled first, so the next test starts from an empty queue)."""
    yield
    if request.node.get_closest_marker("slurm") is None:
        return
    import os
    import subprocess
    import time

    from _slurm_local import local_slurm_env, slurm_available

    if not slurm_available():
        return
    env = {**os.environ, **local_slurm_env()}

    def left() -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T %j"], env=env, capture_output=True, text=True,
                             timeout=30)
        return [ln for ln in out.stdout.splitlines() if ln.strip() and " COMPLETING " not in f" {ln} "]

    jobs = left()
    if jobs:
        subprocess.run(["scancel", *[ln.split()[0] for ln in jobs]], env=env, capture_output=True, timeout=30)
        deadline = time.monotonic() + 30
        while left() and time.monotonic() < deadline:
            time.sleep(0.5)
    assert not jobs, f"the test left Slurm jobs behind (now cancelled): {jobs}"



from _serial_groups import pytest_collection_modifyitems  # noqa: E402,F401 - the hook, registered here
