"""A STAND-IN for pyslurm — not pyslurm. pyslurm cannot be built against the Slurm 22.05 installable here (a
pyslurm ``X.Y`` wheel needs Slurm ``X.Y``), so :class:`PyslurmStandIn` offers the subset of pyslurm's object API
that :class:`scavenger.pyslurm_api.PyslurmClient` reads — ``Nodes.load()``, ``Jobs.load()``, ``Job(id)`` with
``cancel()`` / ``send_signal(sig, steps=...)``, ``RPCError``, ``__version__`` — with pyslurm 25.11's attribute
names and value shapes (its ``node.pyx``/``job.pyx``: node ``state`` as ``"IDLE+DRAIN"``, gres as dicts —
``{"gpu": 2}``, or ``{"gpu": {"count": 1, "indexes": "0"}}`` when indexes are known —, TRES as ``{"gres/gpu": "1"}``
string maps, raw exit status split into code and signal), answered from the real local cluster through its CLI
JSON. It checks the adapter against a real Slurm; it cannot check pyslurm itself.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Any, Mapping


class RPCError(Exception):
    """As ``pyslurm.RPCError``: a request to slurmctld failed."""


def to_gres_dict(gres: str | None) -> dict[str, Any]:
    """pyslurm's GRES string parsing: ``"gpu:2"`` → ``{"gpu": 2}``, ``"gpu:a100:4"`` → ``{"gpu:a100": 4}``,
    ``"gpu:1(IDX:0)"`` → ``{"gpu": {"count": 1, "indexes": "0"}}``."""
    out: dict[str, Any] = {}
    if not gres or gres == "(null)":
        return out
    for item in re.split(r",(?=[^,]+?:)", gres):
        item = item.replace("gres:", "")
        idx = None
        m = re.search(r"\(IDX:([^)]*)\)", item)
        if m:
            idx, item = m.group(1), item[: m.start()]
        item = re.sub(r"\(.*\)", "", item)
        parts = item.split(":")
        name, typ, cnt = parts[0], None, "1"
        if len(parts) == 2:
            cnt = parts[1] if parts[1].isdigit() else "1"
            typ = None if parts[1].isdigit() else parts[1]
        elif len(parts) >= 3:
            typ, cnt = parts[1], parts[2]
        key = f"{name}:{typ}" if typ else name
        out[key] = int(cnt) if idx is None else {"count": int(cnt), "indexes": idx}
    return out


def to_dict(s: str | None) -> dict[str, str]:
    """pyslurm's ``key=value,...`` parsing (values stay strings)."""
    return dict(kv.split("=", 1) for kv in (s or "").split(",") if "=" in kv)


class PyslurmStandIn:
    """Module-like object standing in for ``pyslurm`` over the cluster reached with ``env`` (``SLURM_CONF``).

    ``version``: the ``__version__`` to claim (the real local release by default, so ``slurm_api("auto")``
    picks it; another release tests the mismatch path). ``calls`` records every CLI command run.
    """

    def __init__(self, env: Mapping[str, str], version: str = "22.05.0") -> None:
        self.__version__ = version
        self.RPCError = RPCError
        self.calls: list[list[str]] = []
        standin = self

        def run(argv: list[str]) -> str:
            standin.calls.append(argv)
            p = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
            if p.returncode:
                raise RPCError(f"{argv[0]}: {p.stderr.strip() or p.stdout.strip()}")
            return p.stdout

        class Node:
            def __init__(self, d: Mapping[str, Any]) -> None:
                self.name = d["name"]
                flags = [str(f).upper() for f in d.get("state_flags") or []]
                self.state = "+".join([str(d.get("state", "")).upper()] + flags)
                self.partitions = list(d.get("partitions") or [])
                self.total_cpus = int(d.get("cpus") or 0)
                self.allocated_cpus = int(d.get("alloc_cpus") or 0)
                self.configured_gres = to_gres_dict(d.get("gres"))
                self.allocated_gres = to_gres_dict(d.get("gres_used"))

        class Nodes:
            @staticmethod
            def load() -> dict[str, Node]:
                doc = json.loads(run(["sinfo", "-N", "--json"]))
                out: dict[str, Node] = {}
                for d in doc["nodes"]:
                    out.setdefault(d["name"], Node(d))
                return out

        class Job:
            def __init__(self, job_id: int, d: Mapping[str, Any] | None = None) -> None:
                self.id = int(job_id)
                if d is None:
                    return
                self.name = d.get("name", "")
                self.comment = d.get("comment", "")
                self.state = str(d.get("job_state", ""))
                self.state_reason = d.get("state_reason", "None")
                self.partition = d.get("partition", "")
                self.requeue_count = int(d.get("restart_cnt") or 0)
                self.allocated_nodes = d.get("nodes", "")
                self.submit_time, self.start_time, self.end_time = (
                    int(d.get(k) or 0) for k in ("submit_time", "start_time", "end_time"))
                self.user_id = int(d.get("user_id", -1))
                self.user_name = d.get("user_name", "")
                self.allocated_tres = to_dict(d.get("tres_alloc_str"))
                self.requested_tres = to_dict(d.get("tres_req_str"))
                status = d.get("exit_code")
                status = int(status) if isinstance(status, int) else 0
                self.exit_code, self.exit_code_signal = status >> 8, status & 0x7F
                self.is_requeueable = bool(d.get("requeue"))

            def cancel(self) -> None:
                run(["scancel", str(self.id)])

            def send_signal(self, signal: int | str, steps: str = "children", hurry: bool = False) -> None:
                if steps not in ("children", "batch", "all"):
                    raise ValueError(f"steps must be all, batch or children, got {steps!r}")
                flag = {"batch": ["--batch"], "all": ["--full"], "children": []}[steps]
                run(["scancel", f"--signal={signal}", *flag, str(self.id)])

        class Jobs:
            @staticmethod
            def load() -> dict[int, Job]:
                doc = json.loads(run(["squeue", "-t", "all", "--json"]))
                return {int(d["job_id"]): Job(int(d["job_id"]), d) for d in doc["jobs"]}

        self.Node, self.Nodes, self.Job, self.Jobs = Node, Nodes, Job, Jobs
