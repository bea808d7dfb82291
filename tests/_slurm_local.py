"""The project's private local Slurm cluster (``sbatch/local-cluster/up``), seen from Python.

Tests and benchmarks that need real Slurm call :func:`ensure_local_slurm`, which brings the cluster up when
``sinfo`` does not answer (installing Debian's Slurm 22.05, munge and MariaDB on first use; root only) and
returns the client environment to pass to every Slurm command::

    env = {**os.environ, **ensure_local_slurm()}
    subprocess.run(["sbatch", "-p", "scavenger", ...], env=env, timeout=30)

Invariants: the cluster lives entirely under ``$RLBOOST_SLURM_DIR`` (default ``/tmp/rlboost-slurm``), whose
``env.sh`` is the single source of the client settings (``SLURM_CONF`` and the ``RLBOOST_SLURM_*`` facts);
every Slurm command run from here has a timeout (clients hang ~9 s when a daemon is down).
"""
from __future__ import annotations

import os
import time
import shlex
import shutil
import subprocess
from pathlib import Path

from rlboost_hpc.paths import PROJECT_ROOT
from scavenger.slurm_records import USABLE_NODE_STATES  # one vocabulary of node states (the scavenger's)

DEFAULT_DIR = "/tmp/rlboost-slurm"
LOCAL_CLUSTER_DIR = PROJECT_ROOT / "sbatch" / "local-cluster"

_started_here = False


class LocalSlurmError(RuntimeError):
    """The local cluster could not be brought up or reached; the message carries the script's output."""


def state_dir() -> Path:
    """The cluster's state directory: ``$RLBOOST_SLURM_DIR`` or ``/tmp/rlboost-slurm``."""
    return Path(os.environ.get("RLBOOST_SLURM_DIR") or DEFAULT_DIR)


def local_slurm_env(directory: str | os.PathLike | None = None) -> dict[str, str]:
    """The variables ``$DIR/env.sh`` exports (``SLURM_CONF``, ``RLBOOST_SLURM_DIR``, ...).

    Raises FileNotFoundError when the cluster was never brought up in that directory.
    """
    path = Path(directory or state_dir()) / "env.sh"
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, _, value = words[1].partition("=")
            env[key] = value
    if "SLURM_CONF" not in env:
        raise LocalSlurmError(f"{path} exports no SLURM_CONF")
    return env


def _client_env(env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **env}


def _usable_nodes(env: dict[str, str], timeout_s: float) -> int | None:
    """Number of nodes in a usable state per ``sinfo``; None when sinfo does not answer."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=_client_env(env), capture_output=True,
                             text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    nodes = {ln.split()[0] for ln in out.stdout.splitlines()
             if len(ln.split()) == 2 and ln.split()[1].upper() in USABLE_NODE_STATES}
    return len(nodes)


def slurm_available(timeout_s: float = 10.0) -> bool:
    """True when the local cluster answers ``sinfo`` and all its nodes are usable (no side effects)."""
    if shutil.which("sinfo") is None:
        return False
    try:
        env = local_slurm_env()
    except (OSError, LocalSlurmError):
        return False
    # A dead controller makes sinfo hang ~9 s: look at its pid file first.
    try:
        pid = int((Path(env.get("RLBOOST_SLURM_DIR", state_dir())) / "run" / "slurmctld.pid").read_text().strip())
        if not Path(f"/proc/{pid}").exists():
            return False
    except (OSError, ValueError):
        return False
    usable = _usable_nodes(env, timeout_s)
    return usable is not None and usable >= int(env.get("RLBOOST_SLURM_NODES", "1"))


def ensure_local_slurm(timeout_s: float = 420) -> dict[str, str]:
    """Bring the local cluster up unless it already answers; return its client variables (see module doc).

    ``up`` is idempotent: it starts only the daemons that are not running. Raises LocalSlurmError with the
    tail of its output when it fails or takes longer than ``timeout_s``.
    """
    global _started_here
    if slurm_available():
        return local_slurm_env()
    up = LOCAL_CLUSTER_DIR / "up"
    if not up.exists():
        raise LocalSlurmError(f"{up} is missing (the local cluster script ships with the source checkout)")
    # Right after the daemons of an earlier session were killed, a restart can fail for a while (seen: slurmctld
    # exiting during start-up for ~2 minutes); `up` is idempotent, so retry it until the deadline.
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(10.0, deadline - time.monotonic())
        try:
            out = subprocess.run([str(up)], capture_output=True, text=True, timeout=left,
                                 env={**os.environ, "RLBOOST_SLURM_DIR": str(state_dir())})
        except subprocess.TimeoutExpired as e:
            raise LocalSlurmError(f"{up} took longer than {timeout_s:.0f} s; output:\n"
                                  f"{(e.stderr or b'')[-3000:]!r}") from e
        if out.returncode == 0:
            break
        if time.monotonic() + 10 > deadline:
            raise LocalSlurmError(f"{up} failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
        time.sleep(5.0)
    _started_here = True
    return local_slurm_env()


def started_by_this_process() -> bool:
    """Whether :func:`ensure_local_slurm` ran ``up`` in this process (a session may then call stop)."""
    return _started_here


def stop_local_slurm(purge: bool = False, timeout_s: float = 120) -> None:
    """Run ``down`` (``--purge`` also deletes the state directory): no daemon of the cluster is left."""
    args = [str(LOCAL_CLUSTER_DIR / "down")] + (["--purge"] if purge else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s,
                         env={**os.environ, "RLBOOST_SLURM_DIR": str(state_dir())})
    if out.returncode != 0:
        raise LocalSlurmError(f"down failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")


def wait_until_idle(client, timeout_s: float = 40.0) -> None:
    """Wait until every node of the scavenger partition is IDLE with no GPU in use (the jobs of an earlier test
    gone); AssertionError after ``timeout_s``. ``client``: a :class:`scavenger.slurm.SlurmClient`."""
    from _util import wait_for
    from scavenger.slurm import SlurmCommandError

    def idle() -> bool:
        try:
            return all(n.state == "IDLE" and n.gres_used_gpus == 0 for n in client.sinfo_nodes("scavenger"))
        except SlurmCommandError:
            return False

    wait_for(idle, timeout_s, "an idle cluster (jobs of another test still running?)", interval=0.5)
