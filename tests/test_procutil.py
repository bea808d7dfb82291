"""Node-local leftovers of SIGKILLed process trees are reclaimed (rlboost_hpc/procutil.py)."""
from __future__ import annotations

import os
import subprocess
import sys

from rlboost_hpc.procutil import reclaim_leftovers


def test_shared_memory_and_temp_dirs_of_dead_processes_are_reclaimed_and_live_ones_kept(tmp_path):
    """Regression (issue 16): after SIGKILL of a rollout job's whole tree (torch's shared-memory manager included)
    the shared-memory copy of the weights (``/dev/shm/torch_<pid>_*``, 64 MiB in the report) and the SGLang
    engine's temporary model directory stayed on the node. The next attempt (and the run's end) reclaims what
    dead processes of this user left, and nothing of a live one."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (shm / f"torch_{dead}_2306348876_0").write_bytes(b"\0" * (4 << 20))
    (shm / f"torch_{dead}_99_1").write_bytes(b"\0" * 10)
    (tmp / f"rlboost-sglang-model-{dead}-abc").mkdir()
    (tmp / f"rlboost-sglang-model-{dead}-abc" / "model.safetensors").write_bytes(b"\0" * 100)
    live = os.getpid()
    (shm / f"torch_{live}_1_1").write_bytes(b"live")
    (tmp / f"rlboost-sglang-model-{live}-live").mkdir()
    (shm / "sem.mp-other").write_bytes(b"")  # not ours to judge
    got = reclaim_leftovers(shm, tmp)
    assert got == {"files": 2, "dirs": 1, "bytes": (4 << 20) + 10}
    assert sorted(os.listdir(shm)) == ["sem.mp-other", f"torch_{live}_1_1"]
    assert os.listdir(tmp) == [f"rlboost-sglang-model-{live}-live"]
    assert reclaim_leftovers(shm, tmp) == {"files": 0, "dirs": 0, "bytes": 0}
