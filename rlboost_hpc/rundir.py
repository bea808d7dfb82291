"""The run directory: the one place where a trainer job and its rollout jobs meet on a shared filesystem.

Layout (owner in parentheses):
- ``endpoints.json`` (trainer): ``{"manager": "tcp://host:port", "weights": "tcp://host:port", "run_id": str,
  "written_at": unix s}`` — where rollout jobs register and pull weights.
- ``target.json`` (trainer; read by the scavenger): ``{"n_prem": int, "active": bool, "step": int}`` — how
  many preemptible rollout jobs the run wants now; ``active: false`` ends the run's harvesting.
- ``events.jsonl`` (scavenger and rollout jobs, append-only): job life-cycle events for statistics.
- ``report.json``, ``metrics.jsonl``, ``run.png`` (trainer): results.

Invariant: JSON files are replaced atomically (write to a temporary file in the same directory, fsync, rename),
so a reader never sees a half-written file.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path


class RunDirError(RuntimeError):
    """The run directory does not (yet) hold what a job needs; the message says which file and why."""


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (same-directory temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_endpoints(run_dir: Path, manager: str, weights: str, run_id: str, curve: bool = False,
                    metrics: str = "", engine: dict | None = None) -> None:
    """``curve``: the servers require the run's CURVE keys (``keys/keys.json``, protocol/auth.py);
    ``metrics``: the manager's Prometheus URL; ``engine``: the rollout engine spec workers build
    (``rollout/engines/factory.py``; absent: torch)."""
    write_json_atomic(Path(run_dir) / "endpoints.json", {"manager": manager, "weights": weights, "run_id": run_id,
                                                          "curve": curve, "metrics": metrics,
                                                          "engine": engine or {"kind": "torch"},
                                                          "written_at": time.time()})


def read_endpoints(run_dir: Path, wait_s: float = 0.0, poll_s: float = 0.5) -> dict:
    """Read ``endpoints.json``, waiting up to ``wait_s`` seconds for the trainer to write it.

    Raises:
        RunDirError: not there after ``wait_s``, or unreadable/missing keys.
    """
    path = Path(run_dir) / "endpoints.json"
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise RunDirError(f"{path} does not exist after {wait_s:.0f} s: is the trainer job running and is "
                              f"{run_dir} on a filesystem both jobs share?")
        time.sleep(poll_s)
    try:
        data = json.loads(path.read_text())
        _ = data["manager"], data["weights"]
    except (ValueError, KeyError, TypeError) as e:
        raise RunDirError(f"{path} is malformed ({e}); expected keys manager, weights") from None
    return data


def write_target(run_dir: Path, n_prem: int, active: bool, step: int) -> None:
    write_json_atomic(Path(run_dir) / "target.json", {"n_prem": int(n_prem), "active": bool(active), "step": step})


def advertised(endpoint: str, host: str) -> str:
    """Replace a wildcard bind address in ``tcp://0.0.0.0:port`` by ``host`` (what peers should dial)."""
    proto, rest = endpoint.split("://", 1)
    bound_host, port = rest.rsplit(":", 1)
    if bound_host in ("0.0.0.0", "*", "[::]", "::"):
        bound_host = host
    return f"{proto}://{bound_host}:{port}"
