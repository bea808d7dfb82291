"""The rollout manager's journal: an append-only JSON-lines file in the run directory (``manager-journal.jsonl``).

What the manager needs to survive a crash of the trainer job (or a Slurm requeue of it):
- its **epoch** (incarnation number): a restarted manager takes ``1 + the last epoch`` and tells every instance
  in ``Welcome``/``Alive``; weight versions are (epoch, version), so a rollout job that outlived the crash never
  trusts weights of an old incarnation because a version number matches (rollout/agent_weights.py);
- every **weight version** it made current (``SetVersion``), so a resuming trainer can check that its checkpoint
  is not ahead of what the manager saw (a checkpoint from another run, or a journal from another run).

The step in flight — responses at token level, turns, instances — is in the manager's work log
(``manager/worklog.py``), which a restarted manager continues from. Invariants of this file: every record is one line, flushed and fsynced before the manager acts on it;
a torn last line (crash mid-write) is cut on open; any other unparseable line is a :class:`JournalError`.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from rlboost_hpc.errors import BadInput



class JournalError(BadInput, RuntimeError):
    """The journal is corrupt (an unparseable record before the last line) or unreadable."""


def read(path: str | os.PathLike) -> list[dict]:
    """All complete records (a torn last line is ignored). Missing file: ``[]``.

    Raises:
        JournalError: an unparseable record that is not the last line.
    """
    p = Path(path)
    if not p.exists():
        return []
    lines = p.read_bytes().split(b"\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "event" not in rec:
                raise ValueError("not a journal record")
        except ValueError as e:
            if i == len(lines) - 1:  # torn tail: the crash hit mid-write
                break
            raise JournalError(f"{p}: line {i + 1} is corrupt ({e}); the run cannot resume safely — restore the "
                               "file or start a new run in a new --out") from None
        out.append(rec)
    return out


class Journal:
    """Open (creating) the journal at ``path``, cut a torn tail, and start a new epoch."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        records = read(self.path)
        if self.path.exists():
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):  # cut the torn last line so appends stay parseable
                with open(self.path, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
        self.epoch = 1 + max((int(r.get("epoch", 0)) for r in records), default=0)
        self._f = open(self.path, "a", encoding="utf-8")
        self.append({"event": "start", "epoch": self.epoch, "pid": os.getpid()})

    def append(self, record: dict) -> None:
        """Write one record durably (flush + fsync) before returning."""
        self._f.write(json.dumps({**record, "epoch": self.epoch, "t": time.time()}) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def last_version(records: list[dict]) -> int:
    """The newest weight version any epoch made current (-1 if none)."""
    return max((int(r["version"]) for r in records if r.get("event") == "version"), default=-1)
