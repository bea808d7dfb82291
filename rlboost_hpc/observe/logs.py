"""Structured logging: one JSON object per line (stderr and/or a file), tagged with the process role and run id."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: ``ts`` (unix s), ``level``, ``role``, ``run``, ``pid``, ``logger``,
    ``msg`` (and ``exc`` with a traceback)."""

    def __init__(self, role: str, run_id: str = "") -> None:
        super().__init__()
        self.role = role
        self.run_id = run_id

    def format(self, record: logging.LogRecord) -> str:
        d = {"ts": round(time.time(), 3), "level": record.levelname, "role": self.role, "run": self.run_id,
             "pid": os.getpid(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d)


@dataclass(frozen=True)
class LogSink:
    """Where a process's JSON log lines go: stderr (``console``) and/or ``log_dir/<role>.jsonl`` (appended),
    at ``level``. A process hands its sink to the services it spawns (:func:`current_sink`), so that on a terminal
    where a progress bar owns the screen no service writes JSON lines over it."""

    level: str = "INFO"
    log_dir: str | None = None
    console: bool = True


_sink = LogSink()


def current_sink() -> LogSink:
    """The sink of the last :func:`setup_logging` of this process (default: INFO to stderr)."""
    return _sink


def setup_logging(role: str, level: str | None = None, run_id: str | None = None, *,
                  log_dir: str | os.PathLike | None = None, console: bool = True) -> None:
    """Route the root logger to JSON lines: on stderr (``console``) and/or appended to ``log_dir/<role>.jsonl``
    (the directory is created). Level: ``level``, else ``RLBOOST_LOG_LEVEL``, else INFO. Python warnings
    (``warnings.warn``, e.g. a library's ``UserWarning``) are logged as WARNING lines of logger ``py.warnings``.

    ``run_id``: the run the lines belong to ("" when the process serves none, e.g. the scavenger; a process
    that learns it later calls :func:`set_run_id`)."""
    global _sink
    level = (level or os.environ.get("RLBOOST_LOG_LEVEL", "INFO")).upper()
    _sink = LogSink(level=level, log_dir=None if log_dir is None else str(log_dir), console=console)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        if isinstance(h, logging.FileHandler):  # ours, from an earlier call
            h.close()
    fmt = JsonFormatter(role, run_id or "")
    handlers: list[logging.Handler] = []
    if console:
        handlers.append(logging.StreamHandler(sys.stderr))
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(log_dir) / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', role)}.jsonl",
                                            mode="a", encoding="utf-8"))
    for h in handlers or [logging.NullHandler()]:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(True)  # a library's warnings.warn becomes a JSON line too, never plain text among them


@contextlib.contextmanager
def logging_setup(role: str, level: str | None = None, run_id: str | None = None, *,
                  log_dir: str | os.PathLike | None = None, console: bool = True) -> Iterator[None]:
    """:func:`setup_logging` for the duration of the block; the previous handlers, level and sink come back after
    (for commands that are also called in process, e.g. by tests)."""
    global _sink
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, _sink)
    setup_logging(role, level, run_id, log_dir=log_dir, console=console)
    try:
        yield
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
        _sink = saved[2]


def setup_logging_from(sink: LogSink, role: str, run_id: str | None = None) -> None:
    """:func:`setup_logging` with a sink handed over by the parent process."""
    setup_logging(role, sink.level, run_id, log_dir=sink.log_dir, console=sink.console)


def set_run_id(run_id: str) -> None:
    """Tag every later line of this process's JSON log handlers with ``run_id``."""
    for h in logging.getLogger().handlers:
        if isinstance(h.formatter, JsonFormatter):
            h.formatter.run_id = run_id
