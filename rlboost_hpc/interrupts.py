"""Ctrl-C that is never lost.

Python turns SIGINT into ``KeyboardInterrupt`` in the main thread at the next bytecode. When that bytecode belongs to
a finalizer (a ``__del__`` such as a ZeroMQ socket's, a ``weakref`` callback) the exception cannot propagate: Python
reports it as "Exception ignored" and the program goes on — a run that was asked to stop trains to its end. Seen once
in CI: Ctrl-C at step 2 of 60, exit 0 after step 60.

:func:`install` keeps Python's behaviour (``KeyboardInterrupt`` at once) and also latches the signal; the run loop
calls :func:`check` at every step boundary, which raises ``KeyboardInterrupt`` once a latched interrupt has not
stopped the run by then. Invariant: after a SIGINT, no new RL step starts.
"""
from __future__ import annotations

import signal
import threading

_latched = threading.Event()


def _on_sigint(_signum: int, _frame) -> None:
    _latched.set()
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT as above (call from the main thread, once a command knows it runs the loop)."""
    _latched.clear()
    signal.signal(signal.SIGINT, _on_sigint)


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGINT arrived since :func:`install` (a no-op without it)."""
    if _latched.is_set():
        raise KeyboardInterrupt


def uninstall() -> None:
    """Python's own SIGINT handling again, nothing latched."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _latched.clear()
