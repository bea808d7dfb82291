"""What Slurm reports, as typed records: jobs, nodes and accounting rows, parsed from the CLI's JSON and text.

JSON output (``--json``) is the primary source; its shape differs between releases, so every
field is read by its own small function that accepts each known shape:

* 21.08 / 22.05 / 23.02 (data_parser ≤ v0.0.39): plain numbers and strings; ``job_state`` and node ``state``
  are strings (``"RUNNING"``, ``"mixed"``) with node flags in ``state_flags``; ``sinfo --json`` returns
  ``{"nodes": [...]}``; ``exit_code`` is a raw wait status (an int).
* 23.11 / 24.05 (data_parser ≥ v0.0.40): many numbers are ``{"set": bool, "infinite": bool, "number": n}``;
  states are lists (``["PENDING", "REQUEUED"]``, ``["IDLE", "DRAIN"]``); ``sinfo --json`` returns
  ``{"sinfo": [...]}`` records (one per partition × node group); ``exit_code`` is an object.

Invariants:

* Parsers never raise on a missing or oddly shaped optional field: they return ``None``/``0``/``""``; a document
  without its top-level list raises ValueError (the client turns it into a ``SlurmCommandError``).
* Job ids are strings (``"123"``; array/het ids such as ``"123_4"`` survive unchanged).
"""
from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Iterable, Mapping

#: Base job states after which the job (this attempt and the job itself) is over.
TERMINAL_JOB_STATES = frozenset({
    "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
    "OUT_OF_MEMORY", "REVOKED",
})
#: Job states (base or flag) that hold an allocation: the job runs, is suspended, or is finishing/starting.
RUNNING_JOB_STATES = frozenset({
    "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESIZING",
    "POWER_UP_NODE", "UPDATE_DB",
})
#: Job states that wait for resources and start by themselves.
PENDING_JOB_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_FED", "SPECIAL_EXIT"})
#: Job states (or pending reasons) that wait and will not start until someone releases them.
HELD_JOB_STATES = frozenset({"REQUEUE_HOLD", "RESV_DEL_HOLD"})
HELD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin"})
#: Flags that can end a job's life without being one of TERMINAL_JOB_STATES' names.
TERMINAL_JOB_FLAGS = frozenset({"LAUNCH_FAILED", "RECONFIG_FAIL"})


class JobClass(StrEnum):
    """What a job state means for capacity (:func:`classify_job`)."""

    PENDING = "pending"  # waits for resources; starts by itself
    HELD = "held"  # waits, but starts only when released (held by a user/admin, REQUEUE_HOLD, RESV_DEL_HOLD)
    RUNNING = "running"  # holds an allocation
    TERMINAL = "terminal"  # over
    UNKNOWN = "unknown"  # a state this code does not know: counted as occupying capacity (never ignored)


def classify_job(state: str, flags: Iterable[str] = (), reason: str = "") -> JobClass:
    """The class of a job from its base state, flags and pending reason, for every state Slurm 21.08–25.x
    prints: base states (``PENDING``, ``RUNNING``, ``SUSPENDED``, ``COMPLETED``, ``CANCELLED``, ``FAILED``,
    ``TIMEOUT``, ``NODE_FAIL``, ``PREEMPTED``, ``BOOT_FAIL``, ``DEADLINE``, ``OUT_OF_MEMORY``) and the flag names
    that ≤ 23.02 print in place of the base state (``COMPLETING``, ``CONFIGURING``, ``REQUEUED``, ``REQUEUE_FED``,
    ``REQUEUE_HOLD``, ``RESV_DEL_HOLD``, ``SPECIAL_EXIT``, ``STOPPED``, ``SIGNALING``, ``STAGE_OUT``,
    ``RESIZING``, ``REVOKED``, ``LAUNCH_FAILED``, ``POWER_UP_NODE``, ``UPDATE_DB``, ``RECONFIG_FAIL``).
    Order: terminal, then held, running, pending; anything else is UNKNOWN."""
    names = {state, *flags}
    if state in TERMINAL_JOB_STATES or names & TERMINAL_JOB_FLAGS:
        return JobClass.TERMINAL
    if names & HELD_JOB_STATES or (reason in HELD_REASONS and state not in RUNNING_JOB_STATES):
        return JobClass.HELD
    if state in RUNNING_JOB_STATES:
        return JobClass.RUNNING
    if state in PENDING_JOB_STATES:
        return JobClass.PENDING
    return JobClass.UNKNOWN


#: Node base states that can run new work (flags are checked separately).
def signal_number(name: str) -> int:
    """The number of a signal given as Slurm and ``scancel --signal`` take it: a name with or without ``SIG``, any
    case (``"USR2"``, ``"sigterm"``), or a number (``"12"``).

    Raises:
        ValueError: not a signal of this platform.
    """
    import signal as _signal

    s = str(name).strip().upper().removeprefix("SIG")
    try:
        return int(_signal.Signals(int(s)) if s.isdigit() else _signal.Signals["SIG" + s])
    except (KeyError, ValueError):
        raise ValueError(f"not a signal: {name!r}") from None


USABLE_NODE_STATES = frozenset({"IDLE", "MIXED", "ALLOCATED", "COMPLETING"})
#: Node flags that make a node unusable for new work.
UNUSABLE_NODE_FLAGS = frozenset({
    "DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL", "FAILING", "MAINTENANCE", "MAINT", "NOT_RESPONDING",
    "POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN", "POWERING_UP", "REBOOT_REQUESTED", "REBOOT_ISSUED",
    "INVALID", "INVALID_REG", "FUTURE", "RESERVED", "UNKNOWN", "PLANNED", "BLOCKED", "INVAL",
})


@dataclass(frozen=True)
class NodeInfo:
    """One node as sinfo reports it. ``state`` is the upper-case base state (``IDLE``, ``MIXED``, …);
    ``state_flags`` the upper-case flags (``DRAIN``, ``NOT_RESPONDING``, …); GPU counts are whole devices
    from the node's gres (``gres_used_gpus`` ≤ ``gres_total_gpus`` is not enforced: Slurm's word is kept).
    ``cpus``/``alloc_cpus`` are logical CPUs."""

    name: str
    state: str
    partitions: tuple[str, ...]
    cpus: int
    gres_total_gpus: int
    gres_used_gpus: int
    alloc_cpus: int = 0
    state_flags: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        """True when the node can start new work: base state usable and no draining/down/... flag."""
        return self.state in USABLE_NODE_STATES and not (set(self.state_flags) & UNUSABLE_NODE_FLAGS)

    @property
    def free_gpus(self) -> int:
        """GPUs not allocated (0 on an unusable node), in devices."""
        return max(0, self.gres_total_gpus - self.gres_used_gpus) if self.usable else 0

    @property
    def free_cpus(self) -> int:
        """Logical CPUs not allocated (0 on an unusable node)."""
        return max(0, self.cpus - self.alloc_cpus) if self.usable else 0


@dataclass(frozen=True)
class JobInfo:
    """One job as squeue reports it. Times are Unix epoch seconds (``None`` when unset/0);
    ``state`` is the upper-case base state, ``state_flags`` the extra states 24.05 lists
    (``REQUEUED``, ``COMPLETING``…); ``restart_cnt`` is Slurm's requeue counter (= ``SLURM_RESTART_COUNT``
    of the current attempt); ``gpus`` the job's total GPUs (allocated if known, else requested);
    ``exit_code``/``exit_signal`` come from the raw wait status (``None`` when unknown)."""

    job_id: str
    name: str
    comment: str
    state: str
    state_reason: str
    partition: str
    restart_cnt: int
    nodes: str
    submit_time: float | None
    start_time: float | None
    end_time: float | None = None
    gpus: int = 0
    tres: str = ""
    exit_code: int | None = None
    exit_signal: int | None = None
    state_flags: tuple[str, ...] = ()
    requeue: bool | None = None

    @property
    def job_class(self) -> JobClass:
        """:func:`classify_job` of this job's state, flags and reason."""
        return classify_job(self.state, self.state_flags, self.state_reason)

    @property
    def live(self) -> bool:
        """True while the job runs or waits to, held or in a state we do not know (it may hold capacity)."""
        return self.job_class is not JobClass.TERMINAL

    @property
    def terminal(self) -> bool:
        """True once the job is over (completed, failed, cancelled, timeout, preempted-without-requeue, …)."""
        return self.job_class is JobClass.TERMINAL


@dataclass(frozen=True)
class SacctRecord:
    """One ``sacct -D -P`` row. ``step`` is ``None`` for the job's own row (one per attempt with ``-D``:
    requeued attempts have ``state == "REQUEUED"``), else ``"batch"``, ``"extern"``, ``"0"`` …
    ``state`` drops sacct's suffix (``"CANCELLED by 0"`` → ``"CANCELLED"``); times are epoch seconds
    (``None`` for Unknown/None); ``elapsed_s`` seconds; ``alloc_tres`` the parsed ``AllocTRES`` map."""

    job_id: str
    step: str | None
    name: str
    state: str
    start: float | None
    end: float | None
    nodelist: str
    elapsed_s: float
    alloc_tres: dict[str, str] = field(default_factory=dict)
    partition: str = ""
    account: str = ""
    eligible: float | None = None  # when the job could first start (epoch s): its wait is start − eligible

    @property
    def gpus(self) -> int:
        """GPUs of this allocation (``gres/gpu=N`` in AllocTRES), 0 when none."""
        return _int_or_zero(self.alloc_tres.get("gres/gpu"))


# ----------------------------------------------------------------------------------------------------
# Field parsers: one per field, each accepting every known shape.

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


def _int_or_zero(v: Any) -> int:
    n = _number(v)
    return int(n) if n is not None else 0


def _epoch(v: Any) -> float | None:
    """A timestamp (int or set/number object); 0 and unset mean "not happened" → ``None``."""
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
        return _int_or_zero(d["gres/gpu"])
    typed = [v for k, v in d.items() if k.startswith("gres/gpu:")]
    if typed:
        return sum(_int_or_zero(v) for v in typed)
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
        return per_node * max(1, _int_or_zero(j.get("node_count")))
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
    return _int_or_zero(n.get("cpus")), _int_or_zero(n.get("alloc_cpus"))


def parse_sinfo_json(doc: Mapping[str, Any]) -> list[NodeInfo]:
    """Nodes from a ``sinfo --json`` document of any known shape, merged by node name (partitions unioned).

    ``{"nodes": [...]}`` (≤23.02): one object per node. ``{"sinfo": [...]}`` (≥23.11): one record per
    partition × node group; ``nodes.nodes`` lists the group's nodes, ``gres.total``/``gres.used`` and
    ``cpus.*`` are per node when the group has one node (``sinfo -N``), which the client asks for.
    Raises :class:`ValueError` when neither list is present."""
    merged: dict[str, NodeInfo] = {}

    def add(ni: NodeInfo) -> None:
        old = merged.get(ni.name)
        if old is None:
            merged[ni.name] = ni
        else:
            parts = tuple(dict.fromkeys(old.partitions + ni.partitions))
            merged[ni.name] = NodeInfo(old.name, old.state, parts, old.cpus, old.gres_total_gpus,
                                       old.gres_used_gpus, old.alloc_cpus, old.state_flags)

    if isinstance(doc.get("nodes"), list):
        for n in doc["nodes"]:
            if not isinstance(n, dict):
                continue
            base, flags = node_state_of(n)
            tot, used = node_gpus_of(n)
            cpus, alloc = node_cpus_of(n)
            add(NodeInfo(node_name_of(n), base, node_partitions_of(n), cpus, tot, used, alloc, flags))
    elif isinstance(doc.get("sinfo"), list):
        for rec in doc["sinfo"]:
            if not isinstance(rec, dict):
                continue
            nodes = rec.get("nodes") or {}
            names = nodes.get("nodes") if isinstance(nodes, dict) else None
            names = [str(x) for x in (names or [])]
            part = rec.get("partition") or {}
            pname = text_of(part.get("name") if isinstance(part, dict) else part)
            node = rec.get("node") or {}
            base, flags = states_of(node.get("state") if isinstance(node, dict) else node)
            gres = rec.get("gres") or {}
            tot = gres_gpu_count(gres.get("total") if isinstance(gres, dict) else gres)
            used = gres_gpu_count(gres.get("used") if isinstance(gres, dict) else "")
            cpus = rec.get("cpus") or {}
            n_total = _int_or_zero(cpus.get("total")) if isinstance(cpus, dict) else _int_or_zero(cpus)
            n_alloc = _int_or_zero(cpus.get("allocated")) if isinstance(cpus, dict) else 0
            k = max(1, len(names))
            for name in names:
                add(NodeInfo(name, base, (pname,) if pname else (), n_total // k, tot, used, n_alloc // k,
                             flags))
    else:
        raise ValueError("sinfo JSON has neither 'nodes' nor 'sinfo'")
    return list(merged.values())


def select_jobs(jobs: list[JobInfo], name_prefix: str | None = None, comment_tag: str | None = None,
                all_states: bool = False) -> list[JobInfo]:
    """The jobs whose name starts with ``name_prefix`` and whose comment equals ``comment_tag`` (each filter only
    when given), finished ones only with ``all_states`` — the filters of ``squeue_jobs``, applied on our side
    because some releases ignore them in JSON mode."""
    if name_prefix is not None:
        jobs = [j for j in jobs if j.name.startswith(name_prefix)]
    if comment_tag is not None:
        jobs = [j for j in jobs if j.comment == comment_tag]
    return jobs if all_states else [j for j in jobs if not j.terminal]


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


@dataclass(frozen=True)
class Reservation:
    """One advance reservation (``scontrol show reservation -o``): its name, start and end (epoch s) and the node
    names it holds."""

    name: str
    start: float | None
    end: float | None
    nodes: frozenset[str]


def parse_reservations(text: str) -> list[Reservation]:
    """Rows of ``scontrol show reservation -o`` (one ``Key=Value`` line per reservation; "No reservations in the
    system" → ``[]``). Lines without a ``ReservationName`` are skipped."""
    out = []
    for line in text.splitlines():
        f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "ReservationName" not in f:
            continue
        nodes = f.get("Nodes", "")
        out.append(Reservation(f["ReservationName"], _sacct_time(f.get("StartTime", "")),
                               _sacct_time(f.get("EndTime", "")),
                               frozenset(expand_hostlist(nodes)) if nodes and nodes != "(null)" else frozenset()))
    return out


def parse_node_features(text: str) -> dict[str, frozenset[str]]:
    """Node → its features from ``sinfo -N -h -o %N|%f`` (``name|f1,f2`` per node × partition; ``(null)``: none)."""
    out: dict[str, frozenset[str]] = {}
    for line in text.splitlines():
        name, sep, feats = line.strip().partition("|")
        if not sep or not name:
            continue
        got = frozenset(f for f in feats.split(",") if f and f != "(null)")
        out[name] = out.get(name, frozenset()) | got
    return out


def parse_squeue_json(doc: Mapping[str, Any]) -> list[JobInfo]:
    """Jobs from a ``squeue --json`` document (any known shape). Raises :class:`ValueError` without ``jobs``."""
    jobs = doc.get("jobs")
    if not isinstance(jobs, list):
        raise ValueError("squeue JSON has no 'jobs' list")
    out: list[JobInfo] = []
    for j in jobs:
        if not isinstance(j, dict):
            continue
        base, flags = job_state_of(j)
        rc, sig = exit_code_of(j)
        req = j.get("requeue")
        out.append(JobInfo(
            job_id=job_id_of(j), name=text_of(j.get("name")), comment=text_of(j.get("comment")),
            state=base, state_reason=job_reason_of(j), partition=text_of(j.get("partition")),
            restart_cnt=_int_or_zero(j.get("restart_cnt")), nodes=text_of(j.get("nodes")),
            submit_time=_epoch(j.get("submit_time")), start_time=_epoch(j.get("start_time")),
            end_time=_epoch(j.get("end_time")), gpus=job_gpus_of(j), tres=job_tres_of(j),
            exit_code=rc, exit_signal=sig, state_flags=flags,
            requeue=bool(req) if isinstance(req, bool) else None,
        ))
    return out


#: ``sinfo -N -h -O`` fields for the text fallback, each padded to a wide width and ended by ``|``.
SINFO_TEXT_FIELDS = ("NodeList", "Partition", "StateLong", "CPUs", "CPUsState", "Gres", "GresUsed")


def sinfo_text_format() -> str:
    """The ``--Format`` argument of the text fallback (``NodeList:256|,Partition:256|,…``)."""
    return ",".join(f"{f}:512|" for f in SINFO_TEXT_FIELDS)


def parse_sinfo_text(text: str) -> list[NodeInfo]:
    """Nodes from ``sinfo -N -h -O <sinfo_text_format()>``: one line per node × partition, fields separated
    by ``|`` (padding stripped), merged by node name. The partition's default marker ``*`` is dropped.
    ``CPUsState`` is ``alloc/idle/other/total``. Malformed lines are skipped."""
    merged: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        cols = [c.strip() for c in line.split("|")]
        if len(cols) < len(SINFO_TEXT_FIELDS):
            continue
        name, part, state, cpus, cstate, gres, gres_used = cols[: len(SINFO_TEXT_FIELDS)]
        if not name:
            continue
        base, flags = states_of(state)
        alloc = 0
        m = re.fullmatch(r"(\d+)/(\d+)/(\d+)/(\d+)", cstate)
        if m:
            alloc = int(m.group(1))
        ni = NodeInfo(name, base, (part.rstrip("*"),) if part else (), _int_or_zero(cpus),
                      gres_gpu_count(gres), gres_gpu_count(gres_used), alloc, flags)
        old = merged.get(name)
        if old is not None:
            ni = NodeInfo(old.name, old.state, tuple(dict.fromkeys(old.partitions + ni.partitions)), old.cpus,
                          old.gres_total_gpus, old.gres_used_gpus, old.alloc_cpus, old.state_flags)
        merged[name] = ni
    return list(merged.values())


def _sacct_time(s: str) -> float | None:
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
        days = _int_or_zero(d)
    parts = s.split(":")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        return 0.0
    secs = 0.0
    for n in nums:
        secs = secs * 60 + n
    return days * 86400 + secs


#: The sacct fields we ask for, in order (rows with only the first eight, as older recordings have, still parse).
SACCT_FIELDS = ("JobID", "JobName", "State", "Start", "End", "NodeList", "Elapsed", "AllocTRES", "Partition",
                "Account", "Eligible")


def parse_sacct(text: str, include_steps: bool = False) -> list[SacctRecord]:
    """Rows of ``sacct -D -P -n --format=<SACCT_FIELDS>`` (``|``-separated). With ``-D`` each attempt of a
    requeued job is its own job-level row; step rows (``123.batch``) are dropped unless ``include_steps``.
    Malformed lines are skipped."""
    out: list[SacctRecord] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cols = line.split("|")
        if len(cols) < 8:
            continue
        jid, name, state, start, end, nodelist, elapsed, tres = cols[:8]
        partition, account, eligible = (cols[8:11] + ["", "", ""])[:3]
        job, _, step = jid.partition(".")
        if step and not include_steps:
            continue
        out.append(SacctRecord(job_id=job, step=step or None, name=name, state=state.split(" ")[0].upper(),
                               start=_sacct_time(start), end=_sacct_time(end), nodelist=nodelist,
                               elapsed_s=parse_elapsed(elapsed), alloc_tres=parse_tres(tres),
                               partition=partition, account=account, eligible=_sacct_time(eligible)))
    return out


def parse_sbatch_parsable(stdout: str) -> str:
    """The job id from ``sbatch --parsable`` output (``"123"`` or ``"123;cluster"``). Raises ValueError."""
    for line in stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        jid = line.split(";", 1)[0].strip()
        if re.fullmatch(r"\d+(?:_\d+)?", jid):
            return jid
    raise ValueError(f"no job id in sbatch output {stdout!r}")
