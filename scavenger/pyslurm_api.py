"""The scavenger's Slurm interface through pyslurm's Python API — optional; the CLI client is the default.

Which one a daemon uses (:func:`slurm_api`, config key ``slurm_api``):

* ``"cli"`` — :class:`scavenger.slurm.SlurmClient` (``sinfo``/``squeue --json``, ``sbatch``, ``scancel``): every
  Slurm release from 21.08 on, nothing to build.
* ``"pyslurm"`` — :class:`PyslurmClient`; refused (:class:`PyslurmUnavailable`) unless ``import pyslurm`` works
  and its release matches the cluster's.
* ``"auto"`` (default) — pyslurm when both hold, else the CLI; the choice and its reason are logged.

Releases: a pyslurm ``X.Y.*`` wheel is built against Slurm ``X.Y`` only (its version's first two numbers), so
"matches" means pyslurm's ``X.Y`` equals the ``X.Y`` of ``sinfo --version``. The object model read here
(``pyslurm.Nodes.load()`` / ``pyslurm.Jobs.load()`` collections, ``Job.send_signal``/``cancel``) is pyslurm's API
since its 23.2 series; older pyslurm (the ``pyslurm.node().get()`` dict API) is treated as unavailable.

What goes through pyslurm: the polled queries (nodes and jobs, every reconciliation — in-process RPCs instead of
two forked commands and their JSON) and signals/cancellations. Submissions stay on ``sbatch`` (inherited): the
daemon's job options are sbatch options (``ScavengerConfig.sbatch_args``), and sbatch applies the site's
cli_filter plugins and the script's ``#SBATCH`` lines exactly as for users' own jobs; ``sacct`` and ``scontrol
requeue`` are inherited too. Errors keep the CLI client's contract: every failure is a
:class:`~scavenger.slurm.SlurmCommandError`. pyslurm's RPCs use libslurm's own ``MessageTimeout`` instead of
``timeout_s``.
"""
from __future__ import annotations

import importlib
import logging
import os
import re
from typing import Any, Iterable, Mapping

from scavenger.slurm import SlurmClient, SlurmCommandError
from scavenger.slurm_fields import states_of
from scavenger.slurm_records import JobInfo, NodeInfo, select_jobs, signal_number

log = logging.getLogger(__name__)

__all__ = ["PyslurmClient", "PyslurmUnavailable", "release_of", "slurm_api"]

#: ``slurm_api`` settings.
API_CHOICES = ("auto", "cli", "pyslurm")


class PyslurmUnavailable(RuntimeError):
    """``slurm_api = "pyslurm"`` was asked for, but pyslurm does not import, lacks the Nodes/Jobs API, or was
    built for another Slurm release (message says which)."""


def release_of(version: str) -> str | None:
    """``"25.11.2"`` / ``"slurm 22.05.8"`` / ``"slurm-wlm 23.02.7"`` → ``"25.11"`` / ``"22.05"`` / ``"23.02"``;
    None when no ``X.Y`` is found."""
    m = re.search(r"(\d+)\.(\d+)", version or "")
    return f"{int(m.group(1)):02d}.{int(m.group(2)):02d}" if m else None


def _gpus(gres: Any) -> int:
    """Whole GPUs in a pyslurm gres dict: ``{"gpu": 2}``, ``{"gpu:a100": 4}``, ``{"gpu": {"count": 1, ...}}``;
    other gres (``shard``, ``mps``) are not GPUs."""
    if not isinstance(gres, Mapping):
        return 0
    n = 0
    for k, v in gres.items():
        if str(k).split(":", 1)[0] != "gpu":
            continue
        if isinstance(v, Mapping):
            v = v.get("count", 0)
        try:
            n += int(v)
        except (TypeError, ValueError):
            continue
    return n


def _tres_gpus(tres: Any) -> int:
    """``gres/gpu`` of a pyslurm TRES dict (``{"cpu": "2", "gres/gpu": "1"}``); 0 when absent."""
    if not isinstance(tres, Mapping):
        return 0
    try:
        return int(tres.get("gres/gpu") or 0)
    except (TypeError, ValueError):
        return 0


def _epoch(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if x > 0 else None


def node_info(n: Any) -> NodeInfo:
    """A :class:`~scavenger.slurm_records.NodeInfo` from a ``pyslurm.Node`` (``state`` like ``"IDLE+DRAIN"``)."""
    base, flags = states_of(getattr(n, "state", None))
    return NodeInfo(
        name=str(n.name), state=base, partitions=tuple(getattr(n, "partitions", None) or ()),
        cpus=int(getattr(n, "total_cpus", 0) or 0), gres_total_gpus=_gpus(getattr(n, "configured_gres", None)),
        gres_used_gpus=_gpus(getattr(n, "allocated_gres", None)),
        alloc_cpus=int(getattr(n, "allocated_cpus", 0) or 0), state_flags=flags)


def job_info(j: Any) -> JobInfo:
    """A :class:`~scavenger.slurm_records.JobInfo` from a ``pyslurm.Job``."""
    base, flags = states_of(getattr(j, "state", None))
    reason = str(getattr(j, "state_reason", "") or "")
    alloc, req = getattr(j, "allocated_tres", None), getattr(j, "requested_tres", None)
    tres = alloc or req or {}
    requeue = getattr(j, "is_requeueable", None)
    return JobInfo(
        job_id=str(j.id), name=str(getattr(j, "name", "") or ""), comment=str(getattr(j, "comment", "") or ""),
        state=base, state_reason="" if reason == "None" else reason,
        partition=str(getattr(j, "partition", "") or ""), restart_cnt=int(getattr(j, "requeue_count", 0) or 0),
        nodes=str(getattr(j, "allocated_nodes", "") or ""), submit_time=_epoch(getattr(j, "submit_time", None)),
        start_time=_epoch(getattr(j, "start_time", None)), end_time=_epoch(getattr(j, "end_time", None)),
        gpus=_tres_gpus(alloc) or _tres_gpus(req),
        tres=",".join(f"{k}={v}" for k, v in tres.items()) if isinstance(tres, Mapping) else "",
        exit_code=getattr(j, "exit_code", None), exit_signal=getattr(j, "exit_code_signal", None),
        state_flags=flags, requeue=requeue if isinstance(requeue, bool) else None,
        user=str(getattr(j, "user_name", "") or ""))


class PyslurmClient(SlurmClient):
    """:class:`~scavenger.slurm.SlurmClient` whose node/job queries and signals go through ``module`` (the
    imported ``pyslurm``, or a stand-in with the same API); submissions, ``sacct`` and requeues use the CLI.

    Args: ``module``: the pyslurm module; the rest as :class:`~scavenger.slurm.SlurmClient`.
    Raises (every method): :class:`~scavenger.slurm.SlurmCommandError` on any failure, as the CLI client.
    """

    def __init__(self, module: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.pyslurm = module

    def _call(self, what: str, fn, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # pyslurm.RPCError and whatever libslurm raises: one error type for callers
            raise SlurmCommandError(["pyslurm", what], None, str(e), False,
                                    hint="slurmctld unreachable or the request was refused (pyslurm)") from None

    def sinfo_nodes(self, partition: str | None = None) -> list[NodeInfo]:
        """All nodes (or those of ``partition``), as :meth:`SlurmClient.sinfo_nodes`."""
        nodes = [node_info(n) for n in self._call("Nodes.load", self.pyslurm.Nodes.load).values()]
        return [n for n in nodes if partition in n.partitions] if partition else nodes

    def squeue_jobs(self, name_prefix: str | None = None, comment_tag: str | None = None,
                    all_states: bool = False, only_mine: bool = True) -> list[JobInfo]:
        """Jobs matching the filters, as :meth:`SlurmClient.squeue_jobs` (``only_mine``: this process's uid)."""
        raw = list(self._call("Jobs.load", self.pyslurm.Jobs.load).values())
        if only_mine:
            uid = os.getuid()
            raw = [j for j in raw if getattr(j, "user_id", uid) == uid]
        return select_jobs([job_info(j) for j in raw], name_prefix, comment_tag, all_states)

    def scancel(self, job_ids: Iterable[str], signal: str | None = None, batch: bool = False) -> None:
        """As :meth:`SlurmClient.scancel`: cancel, or only send ``signal`` (``"USR2"``) to the job's steps — with
        ``batch``, to the batch shell only. Array/het ids (``"123_4"``) go through the CLI."""
        ids = [str(j) for j in job_ids]
        plain = [j for j in ids if j.isdigit()]
        other = [j for j in ids if not j.isdigit()]
        if other:
            super().scancel(other, signal=signal, batch=batch)
        sig = None if signal is None else signal_number(signal)
        for jid in plain:
            job = self._call("Job", self.pyslurm.Job, int(jid))
            if sig is None:
                self._call(f"Job({jid}).cancel", job.cancel)
            else:
                self._call(f"Job({jid}).send_signal", job.send_signal, sig, steps="batch" if batch else "children")


def _import_pyslurm() -> Any:
    return importlib.import_module("pyslurm")


def slurm_api(choice: str = "auto", *, timeout_s: float = 15.0, env: Mapping[str, str] | None = None,
              module: Any = None) -> SlurmClient:
    """The Slurm client for ``choice`` (see the module docstring). ``module``: a pyslurm(-like) module to use
    instead of importing ``pyslurm`` (tests pass a stand-in).

    Raises:
        ValueError: ``choice`` is not one of :data:`API_CHOICES`.
        PyslurmUnavailable: ``choice == "pyslurm"`` and pyslurm cannot be used (why in the message).
    """
    if choice not in API_CHOICES:
        raise ValueError(f"slurm_api must be one of {API_CHOICES}, got {choice!r}")
    cli = SlurmClient(timeout_s=timeout_s, env=env)
    if choice == "cli":
        return cli
    why = None
    if module is None:
        try:
            module = _import_pyslurm()
        except Exception as e:  # ImportError, or a wheel whose libslurm is missing (OSError)
            why = f"import pyslurm failed ({type(e).__name__}: {e})"
    if why is None and not (hasattr(module, "Nodes") and hasattr(module, "Jobs") and hasattr(module, "Job")):
        why = f"pyslurm {getattr(module, '__version__', '?')} has no Nodes/Jobs API (needs pyslurm ≥ 23.2)"
    if why is None:
        mine = release_of(str(getattr(module, "__version__", "")))
        try:
            cluster = release_of(cli.run(["sinfo", "--version"]))
        except SlurmCommandError as e:
            cluster, why = None, f"sinfo --version failed: {e}"
        if why is None and (mine is None or mine != cluster):
            why = f"pyslurm {getattr(module, '__version__', '?')} is built for Slurm {mine}, the cluster runs {cluster}"
    if why is not None:
        if choice == "pyslurm":
            raise PyslurmUnavailable(f"slurm_api = 'pyslurm' cannot be used: {why}")
        log.info("Slurm interface: CLI (%s)", why)
        return cli
    log.info("Slurm interface: pyslurm %s (Slurm %s)", module.__version__, cluster)
    return PyslurmClient(module, timeout_s=timeout_s, env=env)
