"""Slurm's command outputs parsed into typed records: ``sinfo`` (JSON and the text fallback), ``squeue --json``,
``sacct -D -P``, ``sbatch --parsable`` and the nodes' features.

This module owns the shape of whole documents and text tables; each field in them is read by
:mod:`scavenger.slurm_fields`, which accepts every release's shape, and the results are the records of
:mod:`scavenger.slurm_records`. JSON output (``--json``) is the primary source; its documents differ between
releases: ``sinfo --json`` returns ``{"nodes": [...]}`` up to 23.02 (data_parser ≤ v0.0.39) and ``{"sinfo": [...]}``
records (one per partition × node group) from 23.11 (data_parser ≥ v0.0.40).

Invariants:

* Parsers never raise on a missing or oddly shaped optional field: they return ``None``/``0``/``""``; a document
  without its top-level list raises ValueError (the client turns it into a ``SlurmCommandError``).
* Text rows that do not parse are skipped.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from scavenger.slurm_fields import (
    epoch_of,
    exit_code_of,
    gres_gpu_count,
    int_or_zero,
    iso_time_of,
    job_gpus_of,
    job_id_of,
    job_reason_of,
    job_state_of,
    job_tres_of,
    node_cpus_of,
    node_gpus_of,
    node_name_of,
    node_partitions_of,
    node_state_of,
    parse_elapsed,
    parse_tres,
    states_of,
    text_of,
)
from scavenger.slurm_records import JobInfo, NodeInfo, SacctRecord


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
            n_total = int_or_zero(cpus.get("total")) if isinstance(cpus, dict) else int_or_zero(cpus)
            n_alloc = int_or_zero(cpus.get("allocated")) if isinstance(cpus, dict) else 0
            k = max(1, len(names))
            for name in names:
                add(NodeInfo(name, base, (pname,) if pname else (), n_total // k, tot, used, n_alloc // k,
                             flags))
    else:
        raise ValueError("sinfo JSON has neither 'nodes' nor 'sinfo'")
    return list(merged.values())


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
            restart_cnt=int_or_zero(j.get("restart_cnt")), nodes=text_of(j.get("nodes")),
            submit_time=epoch_of(j.get("submit_time")), start_time=epoch_of(j.get("start_time")),
            end_time=epoch_of(j.get("end_time")), gpus=job_gpus_of(j), tres=job_tres_of(j),
            exit_code=rc, exit_signal=sig, state_flags=flags,
            requeue=bool(req) if isinstance(req, bool) else None, user=text_of(j.get("user_name")),
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
        ni = NodeInfo(name, base, (part.rstrip("*"),) if part else (), int_or_zero(cpus),
                      gres_gpu_count(gres), gres_gpu_count(gres_used), alloc, flags)
        old = merged.get(name)
        if old is not None:
            ni = NodeInfo(old.name, old.state, tuple(dict.fromkeys(old.partitions + ni.partitions)), old.cpus,
                          old.gres_total_gpus, old.gres_used_gpus, old.alloc_cpus, old.state_flags)
        merged[name] = ni
    return list(merged.values())


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
                               start=iso_time_of(start), end=iso_time_of(end), nodelist=nodelist,
                               elapsed_s=parse_elapsed(elapsed), alloc_tres=parse_tres(tres),
                               partition=partition, account=account, eligible=iso_time_of(eligible)))
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
