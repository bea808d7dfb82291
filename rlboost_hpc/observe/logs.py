"""Structured logging: one JSON object per line on stderr, tagged with the process role and run id."""
from __future__ import annotations

import json
import logging
import os
import sys
import time


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


def setup_logging(role: str, level: str | None = None, run_id: str | None = None) -> None:
    """Route the root logger to stderr as JSON lines (level from ``RLBOOST_LOG_LEVEL``, default INFO).

    ``run_id``: the run the lines belong to (default ``$RLBOOST_RUN_ID``, set by the Slurm launcher; a process
    that learns it later calls :func:`set_run_id`)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter(role, run_id if run_id is not None else os.environ.get("RLBOOST_RUN_ID", "")))
    root.addHandler(h)
    root.setLevel(level or os.environ.get("RLBOOST_LOG_LEVEL", "INFO"))


def set_run_id(run_id: str) -> None:
    """Tag every later line of this process's JSON log handlers with ``run_id``."""
    for h in logging.getLogger().handlers:
        if isinstance(h.formatter, JsonFormatter):
            h.formatter.run_id = run_id
