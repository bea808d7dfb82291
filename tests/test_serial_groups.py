"""The suite's serial group holds in two xdist workers (tests/_serial_groups.py): a small session of its own, run as
the suite runs (``-n 2 --dist loadgroup``), whose slurm- and sglang-marked tests must all run in one worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SESSION = '''
import json, os, time
import pytest

def note(kind, i):
    with open({log!r}, "a") as f:
        f.write(json.dumps([kind, i, os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")

@pytest.mark.slurm
@pytest.mark.parametrize("i", range(4))
def test_slurm(i):
    time.sleep(0.2); note("serial", i)

@pytest.mark.sglang
@pytest.mark.parametrize("i", range(2))
def test_sglang(i):
    time.sleep(0.2); note("serial", 10 + i)

@pytest.mark.parametrize("i", range(8))
def test_other(i):
    time.sleep(0.2); note("other", i)
'''


def test_the_slurm_and_sglang_tests_run_in_one_worker_one_after_another(tmp_path):
    log = tmp_path / "ran.jsonl"
    (tmp_path / "test_s.py").write_text(SESSION.format(log=str(log)))
    (tmp_path / "conftest.py").write_text("from _serial_groups import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  slurm: x\n  sglang: x\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                        "no:cacheprovider", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(TESTS)}, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ran = [json.loads(x) for x in log.read_text().splitlines()]
    serial = {w for kind, _, w in ran if kind == "serial"}
    assert len([r for r in ran if r[0] == "serial"]) == 6 and len(serial) == 1, ran
    assert {w for _, _, w in ran} == {"gw0", "gw1"}, ran  # (the others ran beside them)
