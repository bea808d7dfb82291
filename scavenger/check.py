"""``rlboost-hpc harvest check``: can this Slurm cluster's idle GPUs be harvested for rollout, partition by partition?

Reads what slurmctld says (``scontrol show config``, ``scontrol show partition -o``) and judges each partition as a
home for preemptible rollout jobs (:func:`check_cluster`, pure):

- **cluster**: ``PreemptType`` must not be ``preempt/none`` (nothing could reclaim GPUs from rollout jobs);
  ``SlurmctldParameters=preempt_send_user_signal`` lets a preempted job's ``--signal`` reach it when the grace time
  starts — without it (measured on Slurm 22.05) the job hears nothing until the grace time is over and then has only
  ``KillWait`` to hand its tokens off; accounting (``AccountingStorageType``) is what ``rlboost-hpc stats`` checks
  its figures against.
- **partition** (``preempt/partition_prio``): its ``PreemptMode`` (the cluster's when it sets none) must be
  ``REQUEUE`` (a preempted job comes back) or ``CANCEL`` (it does not; the scavenger submits anew) — ``SUSPEND``
  would leave a rollout engine holding its GPU memory, ``OFF`` jobs no one can reclaim; a partition of a higher
  ``PriorityTier`` must share its nodes (else nothing preempts the rollout jobs and they hold GPUs the owners wait
  for); ``GraceTime`` > 0 (the hand-off's time: at 0 a preempted job's unfinished tokens are regenerated
  elsewhere); it must be ``UP`` and have GPUs (``gres/gpu`` in its TRES) unless rollout runs on CPUs.
- ``preempt/qos``: preemption follows QoS, which this check does not read; it says so and which ``sacctmgr``
  fields to look at.

Exit codes: 0 — the partition asked for (``--partition``), or at least one partition, can be harvested (warnings
say what would make it better); 2 — it cannot, with what to change; 1 — Slurm did not answer.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Literal

from scavenger.slurm_fields import expand_hostlist

Level = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Finding:
    """One judgement: ``level`` (``fail`` makes the partition unusable), what was seen, and what to change."""

    level: Level
    seen: str
    change: str = ""


@dataclass
class PartitionCheck:
    """A partition as a home for rollout jobs: ``harvestable`` unless a finding fails; ``preempted_by``: the
    partitions of a higher PriorityTier sharing its nodes; ``gpus``: its ``gres/gpu`` total."""

    partition: str
    preempt_mode: str
    grace_s: int
    gpus: int
    preempted_by: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def harvestable(self) -> bool:
        return not any(f.level == "fail" for f in self.findings)


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config``'s ``Key = Value`` lines as a dict (other lines are skipped)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_partitions(text: str) -> list[dict[str, str]]:
    """``scontrol show partition -o``: one dict of ``Key=Value`` fields per line."""
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in text.splitlines() if line.strip()]


def _seconds(value: str) -> int:
    """``10``, ``10 sec``, ``00:00:10`` or ``1-00:00:00`` as seconds (0 when unreadable)."""
    value = value.split()[0] if value.split() else ""
    if value.isdigit():
        return int(value)
    days, _, hms = value.rpartition("-")
    parts = hms.split(":")
    if not all(p.isdigit() for p in parts) or not parts:
        return 0
    secs = 0
    for p in parts:
        secs = secs * 60 + int(p)
    return secs + (int(days) * 86400 if days.isdigit() else 0)


def _gpus(tres: str) -> int:
    m = re.search(r"gres/gpu=(\d+)", tres)
    return int(m.group(1)) if m else 0


def cluster_findings(config: dict[str, str]) -> list[Finding]:
    """The cluster-wide judgements (module docstring)."""
    out = []
    ptype = config.get("PreemptType", "preempt/none")
    if ptype == "preempt/none":
        out.append(Finding("fail", "PreemptType=preempt/none: no job can preempt another",
                           "set PreemptType=preempt/partition_prio (or preempt/qos) in slurm.conf, so the owners' "
                           "jobs can reclaim GPUs from rollout jobs"))
    else:
        out.append(Finding("ok", f"PreemptType={ptype}"))
    if "preempt_send_user_signal" in config.get("SlurmctldParameters", ""):
        out.append(Finding("ok", "SlurmctldParameters=preempt_send_user_signal: a preempted job gets its --signal "
                                 "when the grace time starts"))
    else:
        kill_wait = _seconds(config.get("KillWait", "30"))
        out.append(Finding("warn", "no SlurmctldParameters=preempt_send_user_signal: a preempted rollout job hears "
                                   f"nothing until its grace time is over, then hands its tokens off within "
                                   f"KillWait = {kill_wait} s", "add preempt_send_user_signal to SlurmctldParameters"))
    storage = config.get("AccountingStorageType", "accounting_storage/none")
    if storage == "accounting_storage/none":
        out.append(Finding("warn", "no accounting (AccountingStorageType=accounting_storage/none): rlboost-hpc stats "
                                   "cannot check its figures against sacct", "set up slurmdbd"))
    else:
        out.append(Finding("ok", f"AccountingStorageType={storage}: sacct has every attempt"))
    return out


def _partition(p: dict[str, str], partitions: list[dict[str, str]], default_mode: str,
               by_qos: bool) -> PartitionCheck:
    name = p.get("PartitionName", "?")
    mode = p.get("PreemptMode") or default_mode
    grace = _seconds(p.get("GraceTime", "0"))
    chk = PartitionCheck(name, mode, grace, _gpus(p.get("TRES", "")))
    f = chk.findings
    if p.get("State", "UP") != "UP":
        f.append(Finding("fail", f"State={p.get('State')}", f"scontrol update PartitionName={name} State=UP"))
    modes = set(mode.upper().split(","))
    nodes, tier = expand_hostlist(p.get("Nodes", "")), int(p.get("PriorityTier", "1") or 1)
    preempts = sorted(q.get("PartitionName", "?") for q in partitions
                      if int(q.get("PriorityTier", "1") or 1) < tier and nodes & expand_hostlist(q.get("Nodes", "")))
    if "OFF" in modes and preempts and not by_qos:  # the owners' partition: never advise making it preemptible
        f.append(Finding("fail", f"PreemptMode=OFF, PriorityTier={tier}: the owners' partition — its jobs preempt "
                                 f"those of {', '.join(preempts)} and are never preempted themselves",
                         f"not a harvest target: harvest {', '.join(preempts)} (rollout jobs go there)"))
        return chk  # (its grace time and GPUs are the owners' business)
    if "OFF" in modes:
        f.append(Finding("fail", "PreemptMode=OFF: jobs here are never preempted, so rollout jobs would hold GPUs "
                                 "the owners wait for", f"PreemptMode=REQUEUE on PartitionName={name}"))
    elif "SUSPEND" in modes:
        f.append(Finding("fail", "PreemptMode=SUSPEND: a suspended rollout engine keeps its GPU memory and cannot "
                                 "hand its tokens off", f"PreemptMode=REQUEUE on PartitionName={name}"))
    elif "CANCEL" in modes:
        f.append(Finding("warn", "PreemptMode=CANCEL: a preempted rollout job is cancelled; the scavenger submits a "
                                 "new one (a new job id; tokens handed off as usual)",
                         f"PreemptMode=REQUEUE on PartitionName={name} keeps one job across preemptions"))
    elif "REQUEUE" in modes:
        f.append(Finding("ok", "PreemptMode=REQUEUE: a preempted rollout job comes back"))
    else:
        f.append(Finding("fail", f"PreemptMode={mode}: not one this project knows", "PreemptMode=REQUEUE"))
    if not by_qos:
        chk.preempted_by = sorted(q.get("PartitionName", "?") for q in partitions
                                  if int(q.get("PriorityTier", "1") or 1) > tier
                                  and nodes & expand_hostlist(q.get("Nodes", "")))
        if chk.preempted_by:
            f.append(Finding("ok", f"preempted by partition(s) {', '.join(chk.preempted_by)} (higher PriorityTier, "
                                   "shared nodes)"))
        elif "OFF" not in modes:
            f.append(Finding("fail", "no partition of a higher PriorityTier shares its nodes: nothing would preempt "
                                     "rollout jobs here",
                             f"put the owners' partition on these nodes with a PriorityTier above {tier}"))
    if grace <= 0:
        f.append(Finding("warn", "GraceTime=0: a preempted job is killed at once and its unfinished tokens are "
                                 "regenerated elsewhere", f"GraceTime=10 (s) or more on PartitionName={name}"))
    else:
        f.append(Finding("ok", f"GraceTime={grace} s for the hand-off"))
    if chk.gpus == 0:
        f.append(Finding("warn", "no gres/gpu in its TRES: only CPU rollout jobs (--gpus-per-job 0) can run here",
                         "define the GPUs as GRES (gres.conf, GresTypes=gpu)"))
    return chk


def check_cluster(config: dict[str, str], partitions: list[dict[str, str]]) -> tuple[list[Finding],
                                                                                    list[PartitionCheck]]:
    """Judge the cluster and every partition (module docstring). A cluster-wide failure fails every partition."""
    cluster = cluster_findings(config)
    by_qos = config.get("PreemptType", "") == "preempt/qos"
    if by_qos:
        cluster.append(Finding("warn", "PreemptType=preempt/qos: preemption follows QoS, which this check does not "
                                       "read", "sacctmgr show qos format=name,preempt,preemptmode,gracetime: the "
                                               "rollout jobs' QoS needs PreemptMode=requeue and a GraceTime, and "
                                               "the owners' QoS must list it under Preempt"))
    checks = [_partition(p, partitions, config.get("PreemptMode", "OFF"), by_qos) for p in partitions]
    fatal = [f for f in cluster if f.level == "fail"]
    for c in checks:
        c.findings[:0] = fatal
    return cluster, checks


def _report(cluster: list[Finding], checks: list[PartitionCheck]) -> str:
    mark = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}
    lines = ["cluster:"] + [f"  {mark[f.level]} {f.seen}" + (f"\n         → {f.change}" if f.change else "")
                            for f in cluster]
    for c in checks:
        lines.append(f"partition {c.partition}: {'harvestable' if c.harvestable else 'NOT harvestable'} "
                     f"({c.gpus} GPUs)")
        lines += [f"  {mark[f.level]} {f.seen}" + (f"\n         → {f.change}" if f.change and f.level != "ok" else "")
                  for f in c.findings if f not in cluster]
    return "\n".join(lines)


def check_main(partition: str | None = None, as_json: bool = False) -> int:
    """``rlboost-hpc harvest check [--partition P] [--json]``: print the findings; returns the exit code (module
    docstring)."""
    from scavenger.slurm import SlurmClient, SlurmCommandError

    client = SlurmClient(timeout_s=15)
    try:
        config = parse_config(client.run(["scontrol", "show", "config"]))
        partitions = parse_partitions(client.run(["scontrol", "show", "partition", "-o"]))
    except SlurmCommandError as e:
        print(f"rlboost-hpc harvest check: {e}", file=sys.stderr)
        return 1
    cluster, checks = check_cluster(config, partitions)
    if partition:
        checks = [c for c in checks if c.partition == partition]
        if not checks:
            print(f"rlboost-hpc harvest check: --partition {partition}: no such partition "
                  f"(have: {', '.join(p.get('PartitionName', '?') for p in partitions)})", file=sys.stderr)
            return 2
    if as_json:
        print(json.dumps({"cluster": [asdict(f) for f in cluster],
                          "partitions": [{**asdict(c), "harvestable": c.harvestable} for c in checks]}, indent=1))
    else:
        print(_report(cluster, checks))
    return 0 if any(c.harvestable for c in checks) else 2
