"""Structured logging: one JSON object per line on stderr, tagged with the process role and run id."""
from __future__ import annotations

import json
import logging
import os
import sys
import time


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role
        self.run_id = os.environ.get("RLBOOST_RUN_ID", "")

    def format(self, record: logging.LogRecord) -> str:
        d = {"ts": round(time.time(), 3), "level": record.levelname, "role": self.role, "run": self.run_id,
             "pid": os.getpid(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d)


def setup_logging(role: str, level: str | None = None) -> None:
    """Route the root logger to stderr as JSON lines (level from ``RLBOOST_LOG_LEVEL``, default INFO)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter(role))
    root.addHandler(h)
    root.setLevel(level or os.environ.get("RLBOOST_LOG_LEVEL", "INFO"))
