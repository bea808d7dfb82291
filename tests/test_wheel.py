"""The package as a cluster installs it: a wheel in a fresh virtual environment, outside any checkout (issue 28),
with no shared data directory (issue 48: the demo's model and spot trace ship inside the wheel).

``pip wheel`` of a copy of the source tree; the wheel installed with ``--no-deps`` into a new virtual environment
in a temporary directory, whose dependencies come from the test's own environment through a ``.pth`` line (the
path of its site-packages: a ``.pth`` file there — the checkout's editable install — is not processed, so the
project can only come from the wheel). From a working directory outside the checkout: ``rlboost-hpc run`` of
README's config for 2 steps, ``rlboost-hpc chaos --help``, and the scavenger's ``--once`` against the local Slurm
cluster with its sbatch script found in the installed ``share/rlboost-hpc``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from _slurm_local import ensure_local_slurm

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.slurm]

REPO = Path(__file__).resolve().parent.parent
NOT_SOURCE = (".git", ".venv", "build", "dist", "runs", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis",
              ".whl", ".site", ".gpu", "gpu-out")


def sh(args, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=kw.pop("timeout", 600), **kw)
    assert p.returncode == 0, f"{args} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The ``bin/`` of a fresh virtual environment with the project installed from its wheel."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", root / "dist", src], timeout=900)
    [wheel] = (root / "dist").glob("rlboost_hpc-*.whl")
    venv = root / "venv"
    sh([sys.executable, "-m", "venv", venv])
    sh([venv / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel])
    site = Path(sh([venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    (site / "_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv / "bin"


def test_the_installed_wheel_runs_the_main_job_chaos_and_the_scavenger_outside_the_checkout(installed, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # issue 48: no shared data at all — the demo's model and spot trace come from the wheel itself
    env.update(RLBOOST_DATA=str(tmp_path / "no-shared-data"), PATH=f"{installed}:{env.get('PATH', '')}")
    work = tmp_path / "work"
    work.mkdir()
    where = sh([installed / "python", "-c", "import rlboost_hpc, scavenger; print(rlboost_hpc.__file__)"],
               cwd=work, env=env).stdout
    assert where.startswith(str(installed.parent)), where  # the wheel's copy, not the checkout
    share = installed.parent / "share/rlboost-hpc"
    assert (share / "configs/local.toml").is_file() and os.access(share / "sbatch/launch", os.X_OK)

    # README's command, typed where there is no configs/ directory: the shipped config
    p = sh([installed / "rlboost-hpc", "run", "--config", "configs/local.toml", "--out", "runs/demo", "--no-progress",
            "--set", "trainer.steps=2", "--set", "trainer.export_model=false",
            "--set", f"model.cache_dir='{tmp_path / 'models'}'"], cwd=work, env=env)
    rep = json.loads((work / "runs/demo/report.json").read_text())
    assert rep["steps"] == 2 and rep["responses_lost"] == 0 and rep["responses_duplicated"] == 0, p.stderr[-3000:]
    assert "run summary" in p.stdout

    p = sh([installed / "rlboost-hpc", "chaos", "--help"], cwd=work, env=env)
    assert "--trainer-kills" in p.stdout
    dash = sh([installed / "python", "-c", "import importlib.resources as r; print(r.files('rlboost_hpc.observe')"
               ".joinpath('grafana/rlboost-manager.json').read_text()[:1])"], cwd=work, env=env).stdout
    assert dash.strip() == "{"
    shipped_data = sh([installed / "python", "-c", "from rlboost_hpc.paths import data_file; "
                       "print(data_file('stories260K/stories260K.bin'))"], cwd=work, env=env).stdout.strip()
    assert shipped_data.startswith(str(installed.parent)), shipped_data  # the wheel's own copy of stories260K
    assert (Path(shipped_data).parent / "LICENSE.llama2.c.MIT").is_file()

    env.update(ensure_local_slurm())
    run_dir = work / "runs/demo"
    p = sh([installed / "rlboost-hpc", "scavenger", run_dir, "--once", "--partition", "scavenger"], cwd=work,
           env=env)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["ok"] is True and res["error"] is None and res["free_slots"] > 0, p.stdout  # it listed the partition
    assert res["desired"] == 0 and res["submitted"] == [], p.stdout  # no target from a local run: nothing wanted
    p = subprocess.run([installed / "rlboost-hpc", "scavenger", run_dir, "--once", "--script", "sbatch/nope.sbatch"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=60)
    assert p.returncode == 2 and "sbatch/nope.sbatch" in p.stderr and "Traceback" not in p.stderr, p.stderr

    # `rlboost-hpc launch` as README gives it, typed where there is no configs/ directory (issue 45: the config
    # resolved to /local.toml): the shipped config, the trainer job named after the run; its scavenger ends with it
    p = sh([installed / "rlboost-hpc", "launch", "runs/launched", "configs/local.toml", "--detach", "--",
            "--partition", "scavenger", "--max-jobs", "1", "--poll-s", "1"], cwd=work, env=env, timeout=180)
    job = (work / "runs/launched/train.jobid").read_text().strip()
    try:
        assert f"config {share / 'configs/local.toml'};" in p.stdout, p.stdout
        names = sh(["squeue", "--json", "-t", "all"], env=env).stdout
        assert any(str(j["job_id"]) == job and j["name"] == "rlboost-train-launched"
                   for j in json.loads(names)["jobs"]), names[:2000]
    finally:
        sh(["scancel", job], env=env)
    pid = int((work / "runs/launched/scavenger.pid").read_text())
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # it watches the trainer job
        time.sleep(0.5)
    assert not Path(f"/proc/{pid}").exists(), (work / "runs/launched/logs/scavenger.log").read_text()[-2000:]
