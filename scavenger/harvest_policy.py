"""The site policy of the harvest service: what may be harvested, by whom and how much (a TOML file the cluster's
admin owns, e.g. ``/etc/rlboost-hpc/harvest.toml``; ``sbatch/harvest/harvest.toml`` is a commented example).

Read once at start-up by :func:`load_site_policy` (pydantic, strict: an unknown key is an error naming it); the
service applies it every cycle through :mod:`scavenger.shares`.
"""
from __future__ import annotations

import datetime as dt
import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlboost_hpc.errors import BadInput
from scavenger.config import load_toml_model

__all__ = ["HarvestPolicyError", "SitePolicy", "load_site_policy", "unknown_names"]

_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


class HarvestPolicyError(BadInput, ValueError):
    """The site policy cannot be read or is invalid; the message names the file and the key."""


class Grant(BaseModel):
    """The weight and GPU cap of one account or one run."""

    model_config = ConfigDict(extra="forbid")

    weight: float = Field(1.0, gt=0, description="relative share under contention (weighted max-min)")
    max_gpus: int | None = Field(None, ge=0, description="most GPUs its rollout jobs may hold at once (None: no cap)")


class Blackout(BaseModel):
    """A daily window (the service host's local time) in which nothing is harvested: every share is 0 and the
    runs drain their rollout jobs. ``end`` before ``start`` spans midnight."""

    model_config = ConfigDict(extra="forbid")

    start: str = Field(..., description="HH:MM, local time")
    end: str = Field(..., description="HH:MM, local time (before start: the window ends the next day)")
    days: list[str] = Field(list(_DAYS), description="days the window starts on: mon … sun")

    @field_validator("start", "end")
    @classmethod
    def _hhmm(cls, v: str) -> str:
        if not re.fullmatch(r"([01]\d|2[0-3]):[0-5]\d", v):
            raise ValueError(f"{v!r}: use HH:MM (00:00–23:59)")
        return v

    @field_validator("days")
    @classmethod
    def _days(cls, v: list[str]) -> list[str]:
        bad = [d for d in v if d.lower() not in _DAYS]
        if bad:
            raise ValueError(f"unknown day(s) {bad}: use {', '.join(_DAYS)}")
        return [d.lower() for d in v]

    def covers(self, t: dt.datetime) -> bool:
        """True when local time ``t`` falls in this window."""
        minute = t.hour * 60 + t.minute
        a, b = (int(x[:2]) * 60 + int(x[3:]) for x in (self.start, self.end))
        today, yesterday = _DAYS[t.weekday()], _DAYS[(t.weekday() - 1) % 7]
        if a <= b:
            return today in self.days and a <= minute < b
        return (today in self.days and minute >= a) or (yesterday in self.days and minute < b)


class SitePolicy(BaseModel):
    """What the harvest service may hand out. Defaults fit the local cluster of ``sbatch/local-cluster/up``."""

    model_config = ConfigDict(extra="forbid")

    spool_dir: str = Field("/var/lib/rlboost-harvest", description=(
        "where runs post their demand (demands/, writable by every user, sticky) and the service writes each "
        "run's share (shares/, written by the service only)"))
    partitions: list[str] = Field(["scavenger"], min_length=1, description="partitions whose idle GPUs are harvested")
    qos: list[str] = Field([], description=(
        "QoS rollout jobs may be submitted with ('' for the default QoS); empty: any — a run of another QoS gets 0"))
    exclude_nodes: list[str] = Field([], description="nodes never counted as harvestable")
    exclude_features: list[str] = Field([], description=(
        "nodes with any of these Slurm features are never counted as harvestable (one more sinfo per cycle)"))
    share_rule: Literal["weighted_max_min", "demand_proportional"] = Field("weighted_max_min", description=(
        "how the pool is split: 'weighted_max_min' (every run within one instance of its weighted fair share, "
        "never more than it asks: a new or small run gets its first instance at once) or 'demand_proportional' "
        "(RLix's rule, for comparison: in proportion to each run's demand, weights ignored)"))
    idle_share_free: float = Field(0.0, ge=0, lt=1, description=(
        "share of the harvestable GPUs left free for fast starts of priority jobs (0.1: 10 %)"))
    poll_s: float = Field(5.0, gt=0, description="seconds between cycles (one sinfo + one squeue each)")
    demand_timeout_s: float = Field(120.0, gt=0, description=(
        "a run whose demand has not changed for this many seconds has vanished: share 0, its jobs cancelled"))
    cancel_every_s: float = Field(30.0, gt=0, description="seconds between scancels of a vanished run's live jobs")
    only_listed_accounts: bool = Field(False, description="runs of accounts without an [accounts.X] table get 0")
    default_account: Grant = Field(Grant(), description="weight and cap of an account without its own table")
    accounts: dict[str, Grant] = Field({}, description="per account: weight and max_gpus over all its runs")
    runs: dict[str, Grant] = Field({}, description="per run id: weight (× its account's) and max_gpus")
    blackout: list[Blackout] = Field([], description="daily windows without harvesting")
    reservation_horizon_s: float = Field(3600.0, ge=0, description=(
        "for a run whose rollout jobs have no time limit (UNLIMITED) or do not say it: nodes of an advance "
        "reservation that is active or begins within this many seconds are not offered to it. A run that gives its "
        "jobs' time limit is offered a node only when a job started now would end before the node's next "
        "reservation begins (Slurm would not start it there otherwise)"))
    command_timeout_s: float = Field(15.0, gt=0, description="timeout of each Slurm command, seconds")
    rollout_job_prefix: str = Field("rlboost-rollout-", min_length=1, description=(
        "name prefix of rollout jobs (the scavengers' job_name_prefix): how the report tells them from owners' jobs"))
    report_every_s: float = Field(300.0, ge=0, description=(
        "seconds between the service's accounting reads (sacct) for the owners' delay metrics; 0: none"))
    report_window_s: float = Field(86400.0, gt=0, description="the window those reads cover, seconds back from now")
    spot_price_per_gpu_hour: float = Field(0.0, ge=0, description="internal price of one harvested GPU-hour")
    on_demand_price_per_gpu_hour: float = Field(0.0, ge=0, description=(
        "price of one reserved GPU-hour: the report's saving is GPU-hours × (this − spot_price_per_gpu_hour)"))

    @model_validator(mode="after")
    def _accounts_named(self) -> "SitePolicy":
        for name in (*self.accounts, *self.runs):
            if not name or "," in name or "\n" in name:
                raise ValueError(f"account/run name {name!r}: must be non-empty without commas or newlines")
        return self

    def in_blackout(self, t: dt.datetime) -> bool:
        """True when local time ``t`` is in a blackout window."""
        return any(b.covers(t) for b in self.blackout)

    def account_grant(self, account: str) -> Grant | None:
        """The account's grant; None when ``only_listed_accounts`` and it has no table (it gets nothing)."""
        if account in self.accounts:
            return self.accounts[account]
        return None if self.only_listed_accounts else self.default_account


def unknown_names(policy: SitePolicy, partitions: set[str], qos: set[str] | None,
                  accounts: set[str] | None) -> list[str]:
    """What the policy names that Slurm does not know, one line each naming the key (``harvest.partitions``,
    ``harvest.qos``, ``harvest.accounts.<name>``) and what Slurm knows: ``partitions`` as slurmctld lists them,
    ``qos`` and ``accounts`` as the accounting database does (``None``: no accounting — not checked)."""
    out = [f"harvest.partitions: {p!r} is not a partition Slurm knows (it knows {', '.join(sorted(partitions))})"
           for p in policy.partitions if p not in partitions]
    if qos is not None:
        out += [f"harvest.qos: {q!r} is not a QoS Slurm knows (it knows {', '.join(sorted(qos))})"
                for q in policy.qos if q and q not in qos]
    if accounts is not None:
        out += [f"harvest.accounts.{a}: {a!r} is not an account Slurm knows (it knows {', '.join(sorted(accounts))})"
                for a in policy.accounts if a not in accounts]
    return out


def load_site_policy(path: str | os.PathLike[str] | None, **overrides: Any) -> SitePolicy:
    """The policy of TOML file ``path`` (its ``[harvest]`` table if present, else the top level; None: the
    defaults) with ``overrides`` (None values ignored) on top. Raises :class:`HarvestPolicyError` naming the
    file and every bad key."""
    return load_toml_model(path, "harvest", SitePolicy, HarvestPolicyError, "site policy", overrides)
