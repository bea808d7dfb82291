"""Readers of single fields of Slurm's output, each accepting every shape the supported releases print.

This module owns the knowledge of how Slurm spells one value: a number, a time, a state with its flags, a gres or
TRES string, a hostlist, a duration, a job's id, GPUs or exit code, a node's partitions or CPUs. JSON output
(``--json``) is the primary source; its shape differs between releases, so every field is read by its own small
function that accepts each known shape:

* 21.08 / 22.05 / 23.02 (data_parser ≤ v0.0.39): plain numbers and strings; ``job_state`` and node ``state``
  are strings (``"RUNNING"``, ``"mixed"``) with node flags in ``state_flags``; ``exit_code`` is a raw wait status
  (an int).
* 23.11 / 24.05 (data_parser ≥ v0.0.40): many numbers are ``{"set": bool, "infinite": bool, "number": n}``;
  states are lists (``["PENDING", "REQUEUED"]``, ``["IDLE", "DRAIN"]``); ``exit_code`` is an object.

Invariants:

* A reader never raises on a missing or oddly shaped optional field: it returns ``None``/``0``/``""``.
* Job ids are strings (``"123"``; array/het ids such as ``"123_4"`` survive unchanged).
"""
from __future__ import annotations

import datetime as _dt
import re
from typing import Any, Mapping


def _number(v: Any) -> float | int | None:
    """A Slurm number: plain int/float, or 24.05's ``{"set","infinite","number"}`` (unset/infinite → None)."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, dict):
        if v.get("infinite") or v.get("set") is False:
            return None
        return _number(v.get("number"))
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return None
    return None


def int_or_zero(v: Any) -> int:
    """A Slurm number (any shape :func:`_number` reads) as an int, truncated; 0 when unset, infinite or unreadable."""
    n = _number(v)
    return int(n) if n is not None else 0


def epoch_of(v: Any) -> float | None:
    """A timestamp (int or set/number object) in epoch seconds; 0 and unset mean "not happened" → ``None``."""
    n = _number(v)
    return float(n) if n else None


def text_of(v: Any) -> str:
    """A field as text: ``None`` → ``""``, a list joined by commas, a ``{"name": ...}`` object by its name."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return ",".join(text_of(x) for x in v)
    if isinstance(v, dict) and "name" in v:
        return text_of(v["name"])
    return str(v)


def states_of(v: Any) -> tuple[str, tuple[str, ...]]:
    """(base state, flags) from ``"RUNNING"``, ``"mixed+drain"``, ``"idle*"``, ``["IDLE", "DRAIN"]``."""
    if isinstance(v, list):
        parts = [str(x).upper() for x in v if str(x)]
    else:
        s = str(v or "").strip()
        flags: list[str] = []
        # sinfo's state suffixes: '*' not responding, '~' powered off, '#' powering up, '%' powering down,
        # '!' pending power down, '$' maintenance, '@' reboot pending, '^' reboot issued, '-' planned.
        suffixes = {"*": "NOT_RESPONDING", "~": "POWERED_DOWN", "#": "POWERING_UP", "%": "POWERING_DOWN",
                    "!": "POWER_DOWN", "$": "MAINTENANCE", "@": "REBOOT_REQUESTED", "^": "REBOOT_ISSUED",
                    "-": "PLANNED"}
        while s and s[-1] in suffixes:
            flags.append(suffixes[s[-1]])
            s = s[:-1]
        parts = [p.upper() for p in s.split("+") if p] + flags
    if not parts:
        return "UNKNOWN", ()
    base, flags_ = parts[0], parts[1:]
    # Long-form node states that fold a flag into the name.
    alias = {"DRAINED": ("IDLE", "DRAIN"), "DRAINING": ("ALLOCATED", "DRAIN"), "ALLOC": ("ALLOCATED", None),
             "MIX": ("MIXED", None), "COMP": ("COMPLETING", None), "DRAIN": ("IDLE", "DRAIN"),
             "DRNG": ("ALLOCATED", "DRAIN"), "MAINT": ("IDLE", "MAINTENANCE")}
    if base in alias:
        base, extra = alias[base]
        if extra:
            flags_.insert(0, extra)
    return base, tuple(flags_)


def _split_outside_parens(s: str, sep: str = ",") -> list[str]:
    out, depth, cur = [], 0, []
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [x.strip() for x in out if x.strip()]


_SUFFIX = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def gres_gpu_count(gres: Any) -> int:
    """Whole GPUs in a gres string: ``"gpu:2"``, ``"gpu:a100:4(S:0-1)"``, ``"gpu:(null):0(IDX:N/A)"``,
    ``"gpu:1080ti:1(IDX:0),gpu:980gtx:1(IDX:1)"``; a list of such strings (``gres_detail``) is summed.
    Other gres (``tmpsize:7T``, ``mps:100``) are ignored. Empty/``(null)``/``N/A`` → 0."""
    if isinstance(gres, list):
        return sum(gres_gpu_count(x) for x in gres)
    s = text_of(gres).strip()
    if not s or s in ("(null)", "N/A"):
        return 0
    total = 0
    for item in _split_outside_parens(s):
        item = re.sub(r"\((?:IDX|S)[^)]*\)\s*$", "", item).strip()
        if item.startswith("gres/") or item.startswith("gres:"):
            item = item[5:]
        parts = item.split(":")
        if parts[0] != "gpu":
            continue
        if len(parts) == 1:
            total += 1
            continue
        m = re.fullmatch(r"(\d+)([KMGT]?)", parts[-1])
        if m:
            total += int(m.group(1)) * _SUFFIX.get(m.group(2), 1)
        elif len(parts) == 2:  # "gpu:a100" — a type without count means one device
            total += 1
    return total


def parse_tres(s: Any) -> dict[str, str]:
    """``"cpu=2,mem=4G,node=1,gres/gpu=1"`` → ``{"cpu": "2", "mem": "4G", "node": "1", "gres/gpu": "1"}``."""
    out: dict[str, str] = {}
    for item in text_of(s).split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _tres_gpus(tres: Any) -> int | None:
    """GPUs in a TRES string (``gres/gpu=N``); ``None`` when the string names no GPUs."""
    d = parse_tres(tres)
    if "gres/gpu" in d:
        return int_or_zero(d["gres/gpu"])
    typed = [v for k, v in d.items() if k.startswith("gres/gpu:")]
    if typed:
        return sum(int_or_zero(v) for v in typed)
    return None


def _tres_per_x_gpus(v: Any) -> int:
    """``tres_per_node``/``tres_per_job``: ``"gres:gpu:2"`` (22.05), ``"gres/gpu:2"`` (23.02+),
    ``"gres/gpu=2"``."""
    s = text_of(v)
    if not s:
        return 0
    total = 0
    for item in _split_outside_parens(s):
        item = item.replace("gres/gpu=", "gres/gpu:")
        if item.startswith(("gres:", "gres/")):
            item = item[5:]
        total += gres_gpu_count(item)
    return total


def job_id_of(j: Mapping[str, Any]) -> str:
    """The job id as a string; array tasks as ``<array_job_id>_<task>`` and a pending array's meta record as
    ``<array_job_id>_[<range>]`` (what ``scancel``/``squeue`` accept)."""
    jid = _number(j.get("job_id"))
    base = str(int(jid)) if jid is not None else text_of(j.get("job_id"))
    array_id = _number(j.get("array_job_id"))
    if array_id:
        task = _number(j.get("array_task_id"))
        if task is not None and task < 4_000_000_000:  # NO_VAL means "not a task"
            return f"{int(array_id)}_{int(task)}"
        rng = text_of(j.get("array_task_string"))
        if rng:
            return f"{int(array_id)}_[{rng}]"
    return base


def job_state_of(j: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """(base state, flags) of a job: ``"RUNNING"`` (≤23.02) or ``["PENDING", "REQUEUED"]`` (≥23.11)."""
    return states_of(j.get("job_state", j.get("state")))


def job_reason_of(j: Mapping[str, Any]) -> str:
    """Why the job is pending/was stopped (``"Priority"``, ``"BeginTime"``…); Slurm's ``"None"`` → ``""``."""
    r = text_of(j.get("state_reason"))
    return "" if r == "None" else r


def job_gpus_of(j: Mapping[str, Any]) -> int:
    """Total GPUs of a job: allocated TRES if known, else requested (per node × nodes, or per job),
    else ``gres_detail``."""
    for key in ("tres_alloc_str", "tres_req_str"):
        n = _tres_gpus(j.get(key))
        if n:
            return n
    per_node = _tres_per_x_gpus(j.get("tres_per_node"))
    if per_node:
        return per_node * max(1, int_or_zero(j.get("node_count")))
    per_job = _tres_per_x_gpus(j.get("tres_per_job"))
    if per_job:
        return per_job
    return gres_gpu_count(j.get("gres_detail") or [])


def job_tres_of(j: Mapping[str, Any]) -> str:
    """The job's TRES string: allocated if non-empty, else requested."""
    return text_of(j.get("tres_alloc_str")) or text_of(j.get("tres_req_str"))


def exit_code_of(j: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(return code, signal) of a finished job. ≤23.02: a raw wait status int; 23.x: a set/number
    object holding that status; 24.05: ``{"status": [...], "return_code": {...}, "signal": {...}}``."""
    v = j.get("exit_code")
    if isinstance(v, dict) and ("return_code" in v or "signal" in v or "status" in v):
        rc = _number(v.get("return_code"))
        sig_v = v.get("signal")
        sig = _number(sig_v.get("id")) if isinstance(sig_v, dict) else _number(sig_v)
        return (int(rc) if rc is not None else None, int(sig) if sig else None)
    raw = _number(v)
    if raw is None:
        return None, None
    raw = int(raw)
    if raw & 0x7F:
        return None, raw & 0x7F
    return (raw >> 8) & 0xFF, None


def node_name_of(n: Mapping[str, Any]) -> str:
    return text_of(n.get("name") or n.get("hostname"))


def node_state_of(n: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """(base, flags) from ``"mixed"`` + ``state_flags`` (≤23.02) or ``["IDLE", "DRAIN"]`` (≥23.02)."""
    base, flags = states_of(n.get("state"))
    extra = tuple(str(f).upper() for f in (n.get("state_flags") or []) if str(f))
    return base, tuple(dict.fromkeys(flags + extra))


def node_partitions_of(n: Mapping[str, Any]) -> tuple[str, ...]:
    p = n.get("partitions")
    if isinstance(p, str):
        p = [x for x in p.split(",") if x]
    return tuple(text_of(x) for x in (p or []))


def node_gpus_of(n: Mapping[str, Any]) -> tuple[int, int]:
    """(total, used) GPUs of a node from ``gres``/``gres_used``."""
    return gres_gpu_count(n.get("gres")), gres_gpu_count(n.get("gres_used"))


def node_cpus_of(n: Mapping[str, Any]) -> tuple[int, int]:
    """(total, allocated) logical CPUs of a node."""
    return int_or_zero(n.get("cpus")), int_or_zero(n.get("alloc_cpus"))


def expand_hostlist(expr: str) -> set[str]:
    """Node names of a Slurm hostlist such as ``n[1-4,7],gpu01``; an unbracketed name stands for itself."""
    names: set[str] = set()
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", expr):
        if plain:
            names.add(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if hi and lo.isdigit() and hi.isdigit():
                names.update(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
            else:
                names.add(prefix + part)
    return names


def iso_time_of(s: str) -> float | None:
    """An ISO time as sacct and scontrol print it (``2026-12-05T12:30:00``, local time) in epoch seconds; ``""``,
    ``Unknown``, ``None``, ``N/A`` and unparsable text → ``None``."""
    s = s.strip()
    if not s or s in ("Unknown", "None", "N/A"):
        return None
    try:
        return _dt.datetime.fromisoformat(s).timestamp()
    except ValueError:
        return None


def parse_elapsed(s: str) -> float:
    """Slurm durations ``[D-]HH:MM:SS``, ``MM:SS``, ``MM:SS.mmm`` → seconds (0.0 when unparsable)."""
    s = s.strip()
    days = 0
    if "-" in s:
        d, s = s.split("-", 1)
        days = int_or_zero(d)
    parts = s.split(":")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        return 0.0
    secs = 0.0
    for n in nums:
        secs = secs * 60 + n
    return days * 86400 + secs
