"""Child-process helpers shared by everything that launches processes (local cluster workers, SGLang servers).

Invariants:
- A child started with :func:`die_with_parent` as ``preexec_fn`` gets SIGKILL when the THREAD that started it
  exits (Linux ``PR_SET_PDEATHSIG`` semantics), so callers start such children from a thread that lives as long
  as the child should.
- Node-local leftovers of a process tree that was SIGKILLed (shared-memory weight copies in ``/dev/shm``,
  temporary model directories) carry the creating pid in their names; :func:`reclaim_leftovers` removes those
  of this user whose pid is gone — each rollout attempt calls it when it starts, the trainer at run end.
- A signal is never lost to a child that has not installed its handler yet: a launcher starts the child with
  those signals held (:func:`hold_signals` in ``preexec_fn``; blocked signals stay pending across ``exec``), and
  the child unblocks them once its handler is in place, which then receives what came meanwhile.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("rlboost.procutil")

#: Temporary directories of ours that hold a pid: ``<prefix><pid>-<random>``.
TEMP_PREFIXES = ("rlboost-sglang-model-",)
#: Shared-memory directories of ours that hold a pid, in ``/dev/shm`` (a trainer's weight versions shared with its
#: engine processes: ``rlboost_hpc/weights/shared.py``).
SHM_PREFIXES = ("rlboost-weights-",)
_TORCH_SHM = re.compile(r"^torch_(\d+)_")  # torch's file_system sharing strategy: torch_<pid>_<rand>_<n>


def die_with_parent() -> None:
    """``preexec_fn``: ask the kernel to SIGKILL this child when its parent thread dies (Linux; no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def hold_signals(signals: set[int]) -> None:
    """``preexec_fn`` part: block ``signals`` in the child. They stay pending (not delivered, not lost) until the
    child unblocks them with ``signal.pthread_sigmask(signal.SIG_UNBLOCK, ...)`` after installing its handlers
    — so a signal sent in the child's first instants (interpreter start, imports) reaches the handler instead of
    the default action (termination)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def reclaim_leftovers(shm_dir: str | os.PathLike[str] = "/dev/shm", tmp_dir: str | os.PathLike[str] | None = None
                      ) -> dict[str, int]:
    """Remove node-local leftovers of dead processes of this user: ``shm_dir/torch_<pid>_*`` (shared-memory tensor
    copies), ``shm_dir/<SHM_PREFIXES><pid>-*`` and ``tmp_dir/<TEMP_PREFIXES><pid>-*`` directories whose ``pid`` no
    longer exists. Never touches a live process's files or another user's. Returns ``{"files": n, "dirs": m,
    "bytes": b}``; errors are logged."""
    uid = os.getuid()
    out = {"files": 0, "dirs": 0, "bytes": 0}
    shm = Path(shm_dir)
    try:
        entries = list(shm.iterdir()) if shm.is_dir() else []
    except OSError:
        entries = []
    for p in entries:
        m = _TORCH_SHM.match(p.name)
        if not m or _alive(int(m.group(1))):
            continue
        try:
            st = p.lstat()
            if st.st_uid != uid:
                continue
            p.unlink()
            out["files"] += 1
            out["bytes"] += st.st_size
        except OSError as e:
            log.warning("could not reclaim %s: %s", p, e)
    tmp = Path(tmp_dir or tempfile.gettempdir())
    for where, prefix in [(tmp, p) for p in TEMP_PREFIXES] + [(shm, p) for p in SHM_PREFIXES]:
        for d in where.glob(prefix + "*"):
            head = d.name[len(prefix):].split("-", 1)[0]
            if not head.isdigit() or _alive(int(head)):
                continue
            try:
                if d.lstat().st_uid != uid:
                    continue
                shutil.rmtree(d)
                out["dirs"] += 1
            except OSError as e:
                log.warning("could not reclaim %s: %s", d, e)
    if out["files"] or out["dirs"]:
        log.info("reclaimed leftovers of dead processes: %d shared-memory files (%.1f MB), %d temp dirs",
                 out["files"], out["bytes"] / 1e6, out["dirs"])
    return out

