"""A Slurm command-line client: ``sinfo``, ``squeue``, ``sbatch``, ``scancel``, ``scontrol requeue``, ``sacct``
(records: :mod:`scavenger.slurm_records` and :mod:`scavenger.slurm_reservations`; parsers:
:mod:`scavenger.slurm_parsing`).

Why the CLI: pyslurm only builds against one exact Slurm release (25.11 refuses 22.05), while the CLI is on
every cluster (:mod:`scavenger.pyslurm_api` uses pyslurm where it matches).

Invariants:

* Every command runs with a timeout (default :data:`DEFAULT_TIMEOUT_S`; a client hangs ≈ 9 s when slurmctld
  is down). A timeout kills the command's whole process group, so a hung grandchild can't block us either.
* Every failure — missing binary, timeout, non-zero exit, unparsable output — raises
  :class:`SlurmCommandError` with the command, return code, stderr, whether it timed out, and a hint of what
  to check. Nothing here retries: retry policy belongs to the caller (the daemon backs off).
* A document that is not JSON, or lacks its top-level list, is a :class:`SlurmCommandError`.
"""
from __future__ import annotations

import json
import os
import re
import signal as _signal
import subprocess
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from scavenger.slurm_fields import text_of
from scavenger.slurm_parsing import (
    SACCT_FIELDS,
    parse_node_features,
    parse_sacct,
    parse_sbatch_parsable,
    parse_sinfo_json,
    parse_sinfo_text,
    parse_squeue_json,
    sinfo_text_format,
)
from scavenger.slurm_records import JobInfo, NodeInfo, SacctRecord, select_jobs
from scavenger.slurm_reservations import Reservation, parse_reservations

DEFAULT_TIMEOUT_S = 15.0


class SlurmCommandError(RuntimeError):
    """A Slurm command failed, timed out, was missing, or printed output we cannot parse.

    Attributes: ``cmd`` (argv list), ``returncode`` (``None`` if it never exited normally), ``stderr``
    (text, possibly empty), ``timed_out`` (bool), ``hint`` (what to check, may be empty).
    ``str(err)`` is one line meant for logs: the command, what happened, the last stderr line and the hint.
    """

    def __init__(self, cmd: Sequence[str], returncode: int | None, stderr: str, timed_out: bool,
                 hint: str = "", detail: str = "") -> None:
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stderr = stderr or ""
        self.timed_out = timed_out
        self.hint = hint or _hint_for(self.cmd, self.stderr, timed_out, returncode)
        self.detail = detail
        super().__init__(self._message())

    def _message(self) -> str:
        shown = " ".join(self.cmd[:6]) + (" …" if len(self.cmd) > 6 else "")
        if self.timed_out:
            what = "timed out"
        elif self.returncode is None:
            what = "could not run"
        elif self.detail:
            what = self.detail
        else:
            what = f"exited {self.returncode}"
        last = next((ln.strip() for ln in reversed(self.stderr.splitlines()) if ln.strip()), "")
        msg = f"`{shown}` {what}"
        if last:
            msg += f": {last[:300]}"
        if self.hint:
            msg += f" — {self.hint}"
        return msg


def _hint_for(cmd: Sequence[str], stderr: str, timed_out: bool, returncode: int | None) -> str:
    s = stderr.lower()
    conf = os.environ.get("SLURM_CONF", "<default>")
    if timed_out or "unable to contact slurm controller" in s or "connection refused" in s \
            or "socket timed out" in s:
        return (f"slurmctld is down or unreachable (check `scontrol ping`; SLURM_CONF={conf}); "
                "the caller retries on its next poll")
    if returncode is None:
        return ("Slurm client not on PATH: install slurm-client or `source /tmp/rlboost-slurm/env.sh` "
                "(local cluster: sbatch/local-cluster/up)")
    if "invalid partition" in s:
        return "the partition does not exist or is not allowed for this user (check --partition, `sinfo -s`)"
    if "invalid generic resource" in s or "invalid gres" in s:
        return "no node of the partition has that gres (check --gpus-per-job and gres.conf)"
    if "invalid account" in s:
        return "check --account (`sacctmgr show assoc user=$USER`)"
    if "invalid qos" in s:
        return "check --qos (`sacctmgr show qos`)"
    if "accounting storage is disabled" in s or "slurmdbd" in s and "connect" in s:
        return "sacct needs accounting (slurmdbd); the local cluster starts it with sbatch/local-cluster/up"
    if "invalid job id" in s:
        return "the job is unknown to slurmctld (finished longer ago than MinJobAge, or never existed)"
    if "json" in s or "serializer" in s or "data_parser" in s or "unrecognized option" in s:
        return "this Slurm cannot print JSON; the client falls back to text output"
    return ""


def _load_json(text: str, cmd: Sequence[str]) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise SlurmCommandError(cmd, 0, text[-300:], False,
                                hint="output is not JSON (an old Slurm, or a missing JSON plugin)",
                                detail=f"printed unparsable JSON ({e.msg} at {e.pos})") from None
    if not isinstance(doc, dict):
        raise SlurmCommandError(cmd, 0, "", False, detail="printed JSON that is not an object")
    errs = doc.get("errors") or []
    if errs and not any(k in doc for k in ("nodes", "jobs", "sinfo")):
        msg = "; ".join(text_of(e.get("description") or e.get("error") or e) if isinstance(e, dict) else str(e)
                        for e in errs)
        raise SlurmCommandError(cmd, 0, msg, False, detail="reported errors")
    return doc



# ----------------------------------------------------------------------------------------------------

class SlurmClient:
    """Runs Slurm CLI commands with a timeout and parses their output.

    ``timeout_s``: per-command wall-clock limit in seconds. ``env``: extra environment for every command
    (e.g. ``SLURM_CONF``), on top of ``os.environ``. ``bin_dir``: directory holding the Slurm binaries
    (default: ``PATH``). ``json``: ``"auto"`` (try ``--json``, switch to text for the rest of this client's
    life if the JSON call fails in a way that says JSON is unavailable), ``"always"`` or ``"never"``.
    Every method raises :class:`SlurmCommandError` on any failure.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None,
                 bin_dir: str | os.PathLike[str] | None = None, json: str = "auto") -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if json not in ("auto", "always", "never"):
            raise ValueError("json must be 'auto', 'always' or 'never'")
        self.timeout_s = float(timeout_s)
        self.env = dict(env or {})
        self.bin_dir = Path(bin_dir) if bin_dir else None
        self.json_mode = json
        self._json_ok: bool | None = None if json == "auto" else (json == "always")

    # -- plumbing --------------------------------------------------------------------------------
    def run(self, argv: Sequence[str], timeout_s: float | None = None,
            extra_env: Mapping[str, str] | None = None) -> str:
        """Run ``argv`` (its first element resolved in ``bin_dir`` if set) and return stdout.

        Raises :class:`SlurmCommandError` on a missing binary, a timeout (the process group is killed),
        or a non-zero exit."""
        argv = list(argv)
        if self.bin_dir is not None:
            argv[0] = str(self.bin_dir / argv[0])
        env = {**os.environ, **self.env, **(extra_env or {})}
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, text=True, start_new_session=True)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            raise SlurmCommandError(argv, None, str(e), False) from None
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            try:
                out, err = proc.communicate(timeout=2.0)
            except subprocess.TimeoutExpired:
                out, err = "", ""
            raise SlurmCommandError(argv, proc.returncode, (err or "") +
                                    f"\n(no answer within {limit:g} s)", True) from None
        if proc.returncode != 0:
            raise SlurmCommandError(argv, proc.returncode, err or out, False)
        return out

    def _json_cmd(self, argv: list[str]) -> dict[str, Any] | None:
        """Run ``argv + ['--json']``; ``None`` when JSON is unavailable (auto mode switches to text)."""
        if self._json_ok is False:
            return None
        try:
            return _load_json(self.run(argv + ["--json"]), argv + ["--json"])
        except SlurmCommandError as e:
            if self.json_mode == "auto" and not e.timed_out and e.returncode is not None and \
                    _json_unavailable(e):
                self._json_ok = False
                return None
            raise

    # -- queries ---------------------------------------------------------------------------------
    def sinfo_nodes(self, partition: str | None = None) -> list[NodeInfo]:
        """All nodes (or those of ``partition``) with state, partitions, CPUs and GPU gres counts."""
        argv = ["sinfo", "-N"] + ([f"--partition={partition}"] if partition else [])
        doc = self._json_cmd(list(argv))
        if doc is not None:
            try:
                nodes = parse_sinfo_json(doc)
            except ValueError as e:
                raise SlurmCommandError(argv + ["--json"], 0, "", False, detail=str(e)) from None
        else:
            nodes = parse_sinfo_text(self.run(argv + ["-h", "-O", sinfo_text_format()]))
        if partition:  # 21.08/22.05 ignore filters in JSON mode
            nodes = [n for n in nodes if partition in n.partitions]
        return nodes

    def node_features(self) -> dict[str, frozenset[str]]:
        """Every node's features (``sinfo -N -h -o %N|%f``). Raises SlurmCommandError."""
        return parse_node_features(self.run(["sinfo", "-N", "-h", "-o", "%N|%f"]))

    def partition_names(self) -> set[str]:
        """Every partition slurmctld knows (``scontrol show partition -o``). Raises SlurmCommandError."""
        return {m for ln in self.run(["scontrol", "show", "partition", "-o"]).splitlines()
                for m in re.findall(r"^PartitionName=(\S+)", ln.strip())}

    def accounting_names(self, entity: str) -> set[str] | None:
        """The names of every ``entity`` (``"qos"`` or ``"account"``) the accounting database knows
        (``sacctmgr -n -P show ENTITY format=name``); ``None`` when there is no accounting to ask."""
        field = "Account" if entity == "account" else "Name"
        try:
            out = self.run(["sacctmgr", "-n", "-P", "show", entity, f"format={field}"])
        except SlurmCommandError:
            return None
        return {ln.strip() for ln in out.splitlines() if ln.strip()}

    def reservations(self) -> list[Reservation]:
        """Every advance reservation slurmctld knows (``scontrol show reservation -o``). Raises SlurmCommandError."""
        return parse_reservations(self.run(["scontrol", "show", "reservation", "-o"]))

    def squeue_jobs(self, name_prefix: str | None = None, comment_tag: str | None = None,
                    all_states: bool = False, only_mine: bool = True) -> list[JobInfo]:
        """Jobs matching ``name_prefix`` (job name starts with it) and/or ``comment_tag`` (comment equals
        it); both filters apply when both are given. ``all_states`` adds finished jobs still known to
        slurmctld (``-t all``; kept for ``MinJobAge`` seconds). ``only_mine`` passes ``--me``. Filters are
        applied here too, since some releases ignore them in JSON mode."""
        argv = ["squeue"] + (["--me"] if only_mine else []) + (["-t", "all"] if all_states else [])
        doc = self._json_cmd(list(argv))
        if doc is None:
            raise SlurmCommandError(argv + ["--json"], 0, "", False,
                                    hint="this Slurm cannot print squeue JSON (needs ≥ 21.08 with the "
                                         "JSON serializer plugin)", detail="JSON unavailable")
        try:
            jobs = parse_squeue_json(doc)
        except ValueError as e:
            raise SlurmCommandError(argv + ["--json"], 0, "", False, detail=str(e)) from None
        return select_jobs(jobs, name_prefix, comment_tag, all_states)

    # -- actions ---------------------------------------------------------------------------------
    def sbatch(self, script_path: str | os.PathLike[str], args: Sequence[str] = (),
               env: Mapping[str, str] | None = None) -> str:
        """Submit ``script_path`` with extra sbatch ``args``; ``env`` is added to sbatch's environment
        (exported to the job only as ``--export`` says). Returns the job id. Raises SlurmCommandError
        (also when the script does not exist or sbatch prints no job id)."""
        script = Path(script_path)
        argv = ["sbatch", "--parsable", *args, str(script)]
        if not script.is_file():
            raise SlurmCommandError(argv, None, f"{script}: no such file", False,
                                    hint="the rollout sbatch script is missing (pass --script)")
        out = self.run(argv, extra_env=env)
        try:
            return parse_sbatch_parsable(out)
        except ValueError as e:
            raise SlurmCommandError(argv, 0, out, False, detail=str(e)) from None

    def scancel(self, job_ids: Iterable[str], signal: str | None = None, batch: bool = False) -> None:
        """Cancel ``job_ids`` (plain ``scancel``: SIGTERM then SIGKILL after KillWait), or with ``signal``
        only send that signal (``--signal=USR2``; ``batch`` adds ``--batch`` so the batch shell gets it —
        without it only job steps do). No-op for an empty list."""
        ids = [str(j) for j in job_ids]
        if not ids:
            return
        argv = ["scancel"]
        if signal:
            argv.append(f"--signal={signal}")
        if batch:
            argv.append("--batch")
        self.run(argv + ids)

    def requeue(self, job_id: str) -> None:
        """``scontrol requeue <job_id>``: the job goes back to PENDING with ``restart_cnt`` + 1."""
        self.run(["scontrol", "requeue", str(job_id)])

    def sacct_records(self, job_ids: Sequence[str] = (), names: Sequence[str] = (),
                      starttime: str | None = None, include_steps: bool = False, *,
                      all_users: bool = False, endtime: str | None = None) -> list[SacctRecord]:
        """Accounting rows (``sacct -D -P -n``), one per attempt. Select by ``job_ids`` and/or job
        ``names`` (then ``starttime``, e.g. ``"2024-05-01T00:00:00"``, widens sacct's default window of
        "since midnight"), or — ``all_users`` — every user's jobs between ``starttime`` and ``endtime`` (now when
        None). Needs slurmdbd; raises SlurmCommandError without it."""
        argv = ["sacct", "-D", "-P", "-n", "--format=" + ",".join(SACCT_FIELDS)]
        if all_users:
            argv.append("--allusers")
        if endtime:
            argv.append(f"--endtime={endtime}")
        if job_ids:
            argv.append("--jobs=" + ",".join(str(j) for j in job_ids))
        if names:
            argv.append("--name=" + ",".join(names))
        if starttime:
            argv.append(f"--starttime={starttime}")
        if not job_ids and not names and not (all_users and starttime):
            raise ValueError("sacct_records needs job_ids, names, or all_users with a starttime")
        return parse_sacct(self.run(argv), include_steps=include_steps)


def _json_unavailable(e: SlurmCommandError) -> bool:
    s = e.stderr.lower()
    return any(k in s for k in ("unrecognized option", "invalid option", "json", "serializer",
                                "data_parser", "not supported")) or e.detail.startswith("printed unparsable")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, _signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
