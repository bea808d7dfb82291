"""Preemption statistics of a run, from its event log (``RUN_DIR/events.jsonl``), cross-checked with ``sacct -D``.

``rlboost-hpc stats RUN_DIR [--sacct] [--json] [--per-job]`` prints: jobs, attempts, requeues, preemptions,
mean/median lifetime of an attempt, harvested GPU-hours, tokens produced on harvested capacity, tokens
handed off (by rollout jobs leaving: at a warning or a drain), tokens regenerated.

Definitions (invariants of :func:`compute_stats`):

* a job is a job id seen in a lifecycle event (``submitted``/``adopted``/``started``/``requeued``/
  ``finished``/``cancelled`` whose ``source`` is one of ``rlboost_hpc.events.LIFECYCLE_SOURCES``: the scavenger
  for Slurm jobs, the embedded local cluster for its slots; events of the same names written by other
  components are not lifecycle events); an attempt is one lifecycle ``started`` event (job id × restart count);
* requeues = ``requeued`` events (= the sum of restart-count increments Slurm reported); time limits = requeues
  of an attempt whose worker classified its warning as the job's own time limit (``warned`` with
  ``"cause": "time_limit"``); preemptions = the other requeues not caused by our own drain request, plus
  ``finished`` with state PREEMPTED not followed by a requeue of that job (PreemptMode=CANCEL, and every
  trace removal of the local cluster); drains = the scavenger's signal cancellations plus the local cluster's
  ``finished`` with ``"cause": "drain"``;
* an attempt lasts from its Slurm start time (else the ``started`` event's ts) to its end: the ``requeued``
  event of the next restart count, or the ``finished`` event's Slurm end time (else ts). Lifetimes count
  closed attempts only; GPU-hours = Σ attempts duration × GPUs, open attempts counted up to ``now``;
  event-based times are accurate to the daemon's poll interval — ``--sacct`` prints Slurm's own figure;
* tokens: ``tokens`` events are increments summed per attempt unless ``"cumulative": true`` (then the last
  one of the attempt counts); regenerated = Σ ``regenerated`` of tokens events if any has it, else
  ``tokens_regenerated`` of ``RUN_DIR/report.json``, else unknown (``None``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from rlboost_hpc.events import LIFECYCLE_SOURCES, read_events
from scavenger.slurm_records import SacctRecord
from rlboost_hpc.rundir import RunDir, read_jsonl

#: The reconcile log (one JSON object per changed view: ts, target, desired, live, draining, pending, held,
#: running, idle_slots), relative to the run directory: written by ``Scavenger.run_forever``, read by
#: :func:`read_reconcile_log`.
RECONCILE_LOG = "scavenger/reconcile.jsonl"


def read_reconcile_log(run_dir: str | os.PathLike[str]) -> list[dict]:
    """The reconcile log's records in order (``[]`` without one); torn or malformed lines are skipped."""
    return [r for r in read_jsonl(Path(run_dir) / RECONCILE_LOG) if isinstance(r.get("ts"), (int, float))]

LIFECYCLE = frozenset({"submitted", "adopted", "started", "requeued", "finished", "cancelled"})


@dataclass
class Attempt:
    """One run of a job: seconds are epoch; ``end`` is ``None`` while it runs."""

    job_id: str
    attempt: int
    start: float
    end: float | None = None
    gpus: int = 0
    node: str = ""
    ended_by: str = "open"  # "requeued" | "finished" | "open"

    def duration(self, now: float) -> float:
        return max(0.0, (self.end if self.end is not None else now) - self.start)


@dataclass
class JobStats:
    job_id: str
    attempts: int = 0
    requeues: int = 0
    preemptions: int = 0
    time_limits: int = 0
    gpu_hours: float = 0.0
    final_state: str = "LIVE"
    nodes: list[str] = field(default_factory=list)


@dataclass
class RunStats:
    """Numbers of one run (see the module docstring for definitions). Durations in seconds, GPU-hours in
    device-hours; ``None`` means "no data"."""

    jobs: int = 0
    attempts: int = 0
    open_attempts: int = 0
    requeues: int = 0
    preemptions: int = 0
    time_limits: int = 0
    drains: int = 0
    cancelled_by_us: int = 0
    warned: int = 0
    warned_by_cause: dict[str, int] = field(default_factory=dict)
    lifetime_mean_s: float | None = None
    lifetime_median_s: float | None = None
    gpu_hours: float = 0.0
    tokens_produced: int = 0
    tokens_handed_off: int = 0
    tokens_regenerated: int | None = None
    tokens_regenerated_source: str | None = None
    final_states: dict[str, int] = field(default_factory=dict)
    bad_lines: int = 0
    per_job: dict[str, JobStats] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Everything but ``per_job``, JSON-ready."""
        d = asdict(self)
        d.pop("per_job")
        return d


def _jid(ev: dict) -> str | None:
    v = ev.get("job_id")
    return None if v is None else str(v)


def _int(v: Any) -> int:
    """A count from an event field; anything that is not a number counts as 0."""
    if isinstance(v, bool):
        return 0
    if isinstance(v, (int, float)):
        return int(v)
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return 0


def _attempt_of(ev: dict) -> int:
    v = ev.get("attempt", ev.get("restart_cnt", 0))
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


class _Replay:
    """The state :func:`compute_stats` builds while it reads a run's events in time order: each job's attempts (open
    and closed), its counters, and the token counts per (job, attempt)."""

    def __init__(self, st: RunStats, time_limited: set[tuple[str, int]]) -> None:
        self.st, self.time_limited = st, time_limited  # attempts their worker saw reach the job's time limit
        self.open: dict[str, Attempt] = {}
        self.closed: list[Attempt] = []
        self.jobs: dict[str, JobStats] = {}
        self.preempted_finish: dict[str, int] = {}
        self.tokens: dict[tuple[str, int], dict[str, int]] = {}
        self.regen_seen = False

    def job(self, jid: str) -> JobStats:
        return self.jobs.setdefault(jid, JobStats(jid))

    def close(self, jid: str, end: float, how: str) -> None:
        a = self.open.pop(jid, None)
        if a is not None:
            a.end, a.ended_by = max(end, a.start), how
            self.closed.append(a)

    def read(self, ev: dict) -> None:
        kind, jid = ev["event"], _jid(ev)
        if kind == "tokens" and jid is not None:
            self._tokens(ev, jid)
        elif kind == "warned":
            self.st.warned += 1
            cause = str(ev.get("cause") or "preempted")
            self.st.warned_by_cause[cause] = self.st.warned_by_cause.get(cause, 0) + 1
        elif kind in LIFECYCLE and jid is not None and ev.get("source") in LIFECYCLE_SOURCES:
            self._lifecycle(ev, kind, jid, float(ev.get("ts") or 0.0))

    def _tokens(self, ev: dict, jid: str) -> None:
        acc = self.tokens.setdefault((jid, _attempt_of(ev)), {"produced": 0, "handed_off": 0, "regenerated": 0})
        vals = {k: _int(ev.get(k)) for k in ("produced", "handed_off", "regenerated")}
        self.regen_seen |= "regenerated" in ev
        if ev.get("cumulative"):
            acc.update(vals)
        else:
            for k, v in vals.items():
                acc[k] += v

    def _lifecycle(self, ev: dict, kind: str, jid: str, ts: float) -> None:
        js = self.job(jid)
        if kind == "started":
            self.close(jid, ts, "requeued")  # a previous attempt whose requeue we never saw
            start = float(ev.get("start_time") or ts)
            a = Attempt(jid, _attempt_of(ev), start, gpus=_int(ev.get("gpus")), node=str(ev.get("node") or ""))
            self.open[jid] = a
            js.attempts += 1
            if a.node and a.node not in js.nodes:
                js.nodes.append(a.node)
            js.final_state = "RUNNING"
        elif kind == "requeued":
            self.close(jid, ts, "requeued")
            js.requeues += 1
            self.preempted_finish.pop(jid, None)
            if (jid, _attempt_of(ev) - 1) in self.time_limited:  # the attempt that ended reached its time limit
                js.time_limits += 1
            elif ev.get("cause") != "drain":
                js.preemptions += 1
            js.final_state = "PENDING"
        elif kind == "finished":
            self.close(jid, float(ev.get("end_time") or ts), "finished")
            state = str(ev.get("state") or "UNKNOWN")
            js.final_state = state
            if state == "PREEMPTED":
                self.preempted_finish[jid] = self.preempted_finish.get(jid, 0) + 1
            elif ev.get("cause") == "drain":  # the local cluster's cap retired it
                self.st.drains += 1
        elif kind == "cancelled":
            if ev.get("mode") == "signal":
                self.st.drains += 1
            else:
                self.st.cancelled_by_us += 1


def compute_stats(events: Iterable[dict], now: float | None = None, report: dict | None = None,
                  bad_lines: int = 0) -> RunStats:
    """Statistics of a run from its event records (any order; sorted by ``ts`` here, file order kept on
    ties). ``now`` (epoch s, default time.time()) closes open attempts for GPU-hours; ``report`` is the
    run's report.json (for ``tokens_regenerated`` when no event carries it)."""
    now = time.time() if now is None else now
    evs = sorted((e for e in events if isinstance(e, dict)), key=lambda e: float(e.get("ts") or 0.0))
    st = RunStats(bad_lines=bad_lines)
    # attempts whose worker classified its warning as the job's own time limit (rollout/worker.py)
    r = _Replay(st, {(_jid(e), _attempt_of(e)) for e in evs
                     if e["event"] == "warned" and e.get("cause") == "time_limit"})
    for ev in evs:
        r.read(ev)
    jobs = r.jobs
    for jid, n in r.preempted_finish.items():
        r.job(jid).preemptions += n
    attempts = r.closed + list(r.open.values())
    for a in attempts:
        jobs[a.job_id].gpu_hours += a.duration(now) * a.gpus / 3600.0
    lifetimes = [a.duration(now) for a in r.closed]
    st.jobs = len(jobs)
    st.attempts = len(attempts)
    st.open_attempts = len(r.open)
    st.requeues = sum(j.requeues for j in jobs.values())
    st.preemptions = sum(j.preemptions for j in jobs.values())
    st.time_limits = sum(j.time_limits for j in jobs.values())
    st.lifetime_mean_s = statistics.fmean(lifetimes) if lifetimes else None
    st.lifetime_median_s = statistics.median(lifetimes) if lifetimes else None
    st.gpu_hours = sum(j.gpu_hours for j in jobs.values())
    st.tokens_produced = sum(t["produced"] for t in r.tokens.values())
    st.tokens_handed_off = sum(t["handed_off"] for t in r.tokens.values())
    if r.regen_seen:
        st.tokens_regenerated = sum(t["regenerated"] for t in r.tokens.values())
        st.tokens_regenerated_source = "events"
    elif report is not None and isinstance(report.get("tokens_regenerated"), (int, float)):
        st.tokens_regenerated = int(report["tokens_regenerated"])
        st.tokens_regenerated_source = "report.json"
    for j in jobs.values():
        st.final_states[j.final_state] = st.final_states.get(j.final_state, 0) + 1
    st.per_job = jobs
    return st


def load_run_stats(run_dir: str | Path, now: float | None = None) -> RunStats:
    """:func:`compute_stats` of ``RUN_DIR/events.jsonl`` (+ ``RUN_DIR/report.json`` if present)."""
    run_dir = Path(run_dir)
    counters: dict[str, int] = {}
    events = read_events(run_dir, counters)
    report = None
    try:
        report = json.loads(RunDir(run_dir).report.read_text())
    except (OSError, json.JSONDecodeError):
        pass
    return compute_stats(events, now=now, report=report if isinstance(report, dict) else None,
                         bad_lines=counters.get("bad_lines", 0))


# ----------------------------------------------------------------------------------------------------
@dataclass
class SacctCheck:
    """Result of :func:`cross_check_sacct`: ``agree`` and a list of human-readable ``differences``."""

    agree: bool
    differences: list[str]
    sacct_jobs: int
    sacct_attempts: int
    sacct_requeues: int
    sacct_gpu_hours: float


def sacct_requeues(rows: Sequence[SacctRecord]) -> int:
    """Requeues of ONE job from its ``sacct -D`` job-level rows: rows before the last (ordered by start,
    not-started last) whose state is REQUEUED or PREEMPTED; a REQUEUED last row counts as well."""
    ordered = sorted(rows, key=lambda r: (r.start is None, r.start or 0.0))
    n = sum(1 for r in ordered[:-1] if r.state in ("REQUEUED", "PREEMPTED"))
    if ordered and ordered[-1].state == "REQUEUED":
        n += 1
    return n


def cross_check_sacct(stats: RunStats, records: Sequence[SacctRecord],
                      extra_records: Sequence[SacctRecord] = ()) -> SacctCheck:
    """Compare the event log's jobs and per-job requeue counts with accounting.

    ``records``: job-level rows of the jobs the event log names (``sacct -D --jobs=…``); ``extra_records``:
    rows found by job name (jobs of this run the log may have missed). Step rows are ignored."""
    by_job: dict[str, list[SacctRecord]] = {}
    for r in records:
        if r.step is None:
            by_job.setdefault(r.job_id, []).append(r)
    diffs: list[str] = []
    for jid, js in sorted(stats.per_job.items(), key=lambda kv: (len(kv[0]), kv[0])):
        rows = by_job.get(jid)
        if not rows:
            diffs.append(f"job {jid}: in the event log, not in sacct")
            continue
        n = sacct_requeues(rows)
        if n != js.requeues:
            diffs.append(f"job {jid}: {js.requeues} requeue(s) in the event log, {n} in sacct "
                         f"({', '.join(r.state for r in rows)})")
    for jid in sorted(set(by_job) - set(stats.per_job)):
        diffs.append(f"job {jid}: in sacct, not in the event log")
    extra = sorted({r.job_id for r in extra_records if r.step is None} - set(stats.per_job) - set(by_job))
    for jid in extra:
        diffs.append(f"job {jid}: a job of this run in sacct (by name), not in the event log")
    all_rows = [r for rows in by_job.values() for r in rows]
    return SacctCheck(
        agree=not diffs, differences=diffs, sacct_jobs=len(by_job), sacct_attempts=len(all_rows),
        sacct_requeues=sum(sacct_requeues(rows) for rows in by_job.values()),
        sacct_gpu_hours=sum(r.elapsed_s * r.gpus for r in all_rows) / 3600.0)


def _job_names_and_start(run_dir: Path) -> tuple[list[str], str | None]:
    names: set[str] = set()
    first: float | None = None
    for ev in read_events(run_dir):
        if ev.get("event") in ("submitted", "adopted") and ev.get("name"):
            names.add(str(ev["name"]))
        ts = ev.get("ts")
        if isinstance(ts, (int, float)):
            first = ts if first is None else min(first, ts)
    start = None
    if first is not None:
        start = _dt.datetime.fromtimestamp(first - 60).strftime("%Y-%m-%dT%H:%M:%S")
    return sorted(names), start


# ----------------------------------------------------------------------------------------------------
def _fmt_s(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.1f} s" if v < 120 else f"{v / 60:.1f} min"


def render_table(stats: RunStats, check: SacctCheck | None = None, per_job: bool = False,
                 title: str = "rollout jobs on harvested capacity") -> Any:
    """A rich renderable of the numbers (and of the sacct check when given)."""
    from rich.console import Group
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("jobs", str(stats.jobs)),
        ("attempts (started)", f"{stats.attempts} ({stats.open_attempts} running)"),
        ("preemptions", str(stats.preemptions)),
        ("time limits reached", str(stats.time_limits)),
        ("requeues (all causes)", str(stats.requeues)),
        ("drained / cancelled by scavenger", f"{stats.drains} / {stats.cancelled_by_us}"),
        ("warnings received", f"{stats.warned}" + (" (" + ", ".join(
            f"{k.replace('_', ' ')} {v}" for k, v in sorted(stats.warned_by_cause.items())) + ")"
            if stats.warned_by_cause else "")),
        ("attempt lifetime mean", _fmt_s(stats.lifetime_mean_s)),
        ("attempt lifetime median", _fmt_s(stats.lifetime_median_s)),
        ("harvested GPU-hours", f"{stats.gpu_hours:.3f}"),
        ("tokens produced (harvested)", f"{stats.tokens_produced:,}"),
        ("tokens handed off by rollout jobs leaving", f"{stats.tokens_handed_off:,}"),
        ("tokens regenerated", "n/a" if stats.tokens_regenerated is None
         else f"{stats.tokens_regenerated:,} ({stats.tokens_regenerated_source})"),
        ("final states", ", ".join(f"{k} {v}" for k, v in sorted(stats.final_states.items())) or "-"),
    ]
    if stats.bad_lines:
        rows.append(("unreadable event lines", str(stats.bad_lines)))
    if check is not None:
        rows += [
            ("sacct: jobs / attempts / requeues",
             f"{check.sacct_jobs} / {check.sacct_attempts} / {check.sacct_requeues}"),
            ("sacct: GPU-hours", f"{check.sacct_gpu_hours:.3f}"),
            ("sacct agrees", "yes" if check.agree else f"NO ({len(check.differences)} difference(s))"),
        ]
    for k, v in rows:
        t.add_row(k, v)
    parts: list[Any] = [t]
    if per_job and stats.per_job:
        pj = Table(title="per job")
        for c in ("job", "attempts", "requeues", "preemptions", "GPU-h", "final", "nodes"):
            pj.add_column(c)
        for jid, j in sorted(stats.per_job.items(), key=lambda kv: (len(kv[0]), kv[0])):
            pj.add_row(jid, str(j.attempts), str(j.requeues), str(j.preemptions), f"{j.gpu_hours:.3f}",
                       j.final_state, ",".join(j.nodes))
        parts.append(pj)
    if check is not None and check.differences:
        from rich.text import Text

        parts.append(Text("\n".join(["differences between the event log and sacct:"] +
                                    [f"  - {d}" for d in check.differences])))
    return Group(*parts)


def stats_main(argv: Sequence[str] | None = None, slurm: Any = None) -> int:
    """``rlboost-hpc stats RUN_DIR [--sacct] [--json] [--per-job]``. Exit codes: 0 ok (with ``--sacct``: the
    event log and accounting agree); 1 they disagree, or sacct failed; 2 bad usage (no such run directory).
    ``slurm`` overrides the Slurm client (tests)."""
    from rlboost_hpc.clihelp import DefaultsHelpFormatter

    p = argparse.ArgumentParser(prog="rlboost-hpc stats", description=__doc__.splitlines()[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (events.jsonl, target.json, capacity.json)")
    p.add_argument("--sacct", action="store_true", help="cross-check job and requeue counts with sacct -D")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    p.add_argument("--per-job", action="store_true", help="also print one row per job")
    p.add_argument("--timeout-s", type=float, default=30.0, help="sacct timeout, seconds")
    p.add_argument("--plot", metavar="PNG", help="write the N_prem target, live rollout jobs and capacity over time")
    args = p.parse_args(list(argv) if argv is not None else None)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"rlboost-hpc stats: no such run directory: {run_dir}", file=sys.stderr)
        return 2
    rd = RunDir(run_dir)
    if not any(p.is_file() for p in (rd.events, rd.metrics, rd.report, rd.target, run_dir / RECONCILE_LOG)):
        print(f"rlboost-hpc stats: {run_dir} holds no run (no {rd.events.name}, {rd.metrics.name}, {rd.report.name} "
              f"or {rd.target.name}): a mistyped path, or a run that has not started yet", file=sys.stderr)
        return 2
    st = load_run_stats(run_dir)
    check: SacctCheck | None = None
    rc = 0
    err: str | None = None
    if args.sacct:
        from scavenger.slurm import SlurmClient, SlurmCommandError

        client = slurm if slurm is not None else SlurmClient(timeout_s=args.timeout_s)
        try:
            ids = sorted(st.per_job, key=lambda j: (len(j), j))
            recs = client.sacct_records(job_ids=ids) if ids else []
            names, start = _job_names_and_start(run_dir)
            extra = client.sacct_records(names=names, starttime=start) if names else []
            check = cross_check_sacct(st, recs, extra)
            rc = 0 if check.agree else 1
        except SlurmCommandError as e:
            err = str(e)
            rc = 1
    if args.json:
        out: dict[str, Any] = st.summary()
        if args.per_job:
            out["per_job"] = {k: asdict(v) for k, v in st.per_job.items()}
        if args.sacct:
            out["sacct"] = asdict(check) if check is not None else {"error": err}
        print(json.dumps(out, indent=2))
    else:
        from rlboost_hpc.clihelp import console

        console().print(render_table(st, check, per_job=args.per_job, title=f"rlboost-hpc stats {run_dir}"))
        if check is not None and check.agree:
            print(f"sacct agrees: {check.sacct_jobs} jobs, {check.sacct_attempts} attempts, "
                  f"{check.sacct_requeues} requeues")
    if args.plot:
        series = capacity_series(run_dir)
        if not series["target"]:
            print(f"rlboost-hpc stats: {run_dir} has no per-step N_prem target (metrics.jsonl) to plot",
                  file=sys.stderr)
            return 2
        cmp = simulated_n_prem(run_dir, series)
        if cmp.get("error"):
            print(f"simulator overlay skipped: {cmp['error']}", file=sys.stderr)
        else:
            series["simulated"] = cmp["series"]
            print(f"N_prem live vs simulated (same window and config, {cmp['steps']} steps): mean |difference| "
                  f"{cmp['mean_abs_diff']:.3f} per step, mean difference {cmp['mean_diff']:+.3f}, equal in "
                  f"{100 * cmp['equal_fraction']:.0f}% of steps")
        plot_capacity(series, args.plot, title=str(run_dir))
        print(f"plot: {args.plot}")
    if err:
        print(f"rlboost-hpc stats: sacct cross-check failed: {err}", file=sys.stderr)
    return rc


def capacity_series(run_dir: str | Path) -> dict[str, list[tuple[float, float]]]:
    """Time series (seconds since the run's first record, value) for the capacity plot:

    * ``target``: the N_prem target the trainer set after each step (``metrics.jsonl`` ``n_prem_target``);
    * ``live``: rollout jobs live and not leaving — the scavenger's reconcile log under Slurm, the local cluster's
      live workers (``cluster_live``) per step otherwise;
    * ``capacity``: instances the run could hold (live + idle slots from the reconcile log, else the trainer's
      ``n_available``)."""

    from rlboost_hpc.rundir import read_jsonl

    run_dir = Path(run_dir)
    steps = [m for m in read_jsonl(RunDir(run_dir).metrics) if isinstance(m.get("ts"), (int, float))]
    views = read_reconcile_log(run_dir)
    t0 = min([m["ts"] for m in steps[:1]] + [v["ts"] for v in views[:1]], default=0.0)
    out: dict[str, list[tuple[float, float]]] = {"target": [], "live": [], "capacity": []}
    for m in steps:
        if m.get("n_prem_target") is not None:
            out["target"].append((m["ts"] - t0, m["n_prem_target"]))
    if views:
        for v in views:
            out["live"].append((v["ts"] - t0, v["live"] - v.get("draining", 0)))
            if v.get("idle_slots") is not None:
                out["capacity"].append((v["ts"] - t0, v["live"] - v.get("draining", 0) + v["idle_slots"]))
    else:
        for m in steps:
            if m.get("cluster_live") is not None:
                out["live"].append((m["ts"] - t0, m["cluster_live"]))
            if m.get("n_available") is not None:
                out["capacity"].append((m["ts"] - t0, m["n_available"]))
    return out


def simulated_n_prem(run_dir: str | Path, series: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """The simulator's N_prem for the same trace window and config (``rlboost_hpc/sim/calibrate.py``), step by
    step beside the live target: ``series`` (live step end time, simulated cap after that step),
    ``mean_abs_diff``/``mean_diff`` (live − simulated, instances per step), ``equal_fraction``; or ``error``."""
    from rlboost_hpc.sim.calibrate import CalibrationError, simulate_run

    try:
        sim = simulate_run(run_dir, capacity=series.get("capacity"))
    except CalibrationError as e:
        return {"error": str(e)}
    live = series["target"]
    pairs = [(t, lv, s["cap_next"]) for (t, lv), s in zip(live, sim["steps"]) if s["cap_next"] is not None]
    if not pairs:
        return {"error": "no step to compare"}
    diffs = [lv - sv for _, lv, sv in pairs]
    return {"series": [(t, sv) for t, _, sv in pairs], "steps": len(pairs),
            "mean_abs_diff": sum(abs(d) for d in diffs) / len(diffs), "mean_diff": sum(diffs) / len(diffs),
            "equal_fraction": sum(1 for d in diffs if d == 0) / len(diffs), "profile": sim["profile"]}


def plot_capacity(series: dict[str, list[tuple[float, float]]], path: str | Path, title: str = "") -> None:
    """Step plot of :func:`capacity_series` to a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    for key, label, style in (("capacity", "capacity (live + idle slots)", dict(color="0.7", lw=3)),
                              ("live", "live rollout jobs", dict(color="tab:blue")),
                              ("target", "N_prem target (controller)", dict(color="tab:red", ls="--")),
                              ("simulated", "N_prem of the simulator (same window, calibrated)",
                               dict(color="tab:green", ls=":", lw=2))):
        pts = series.get(key) or []
        if pts:
            ax.step([t for t, _ in pts], [v for _, v in pts], where="post", label=label, **style)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("rollout instances")
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"N_prem and capacity — {title}" if title else "N_prem and capacity")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(stats_main())
