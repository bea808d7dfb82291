"""Child-process helpers shared by everything that launches processes (local cluster workers, SGLang servers).

Invariant: a child started with :func:`die_with_parent` as ``preexec_fn`` gets SIGKILL when the THREAD that
started it exits (Linux ``PR_SET_PDEATHSIG`` semantics), so callers start such children from a thread that
lives as long as the child should.
"""
from __future__ import annotations

import ctypes
import signal
import sys


def die_with_parent() -> None:
    """``preexec_fn``: ask the kernel to SIGKILL this child when its parent thread dies (Linux; no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
