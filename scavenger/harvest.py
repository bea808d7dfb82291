"""One harvest service per cluster: several runs share the idle GPUs under the admin's site policy.

Each run's scavenger (``rlboost-hpc scavenger RUN_DIR --harvest-dir SPOOL``) posts its demand — the controller's
N_prem (within the scavenger's ``max_jobs``), its instance size and account — and reads back its share. The service
(``rlboost-hpc harvest serve --policy FILE``, run by the admin under a service account) does, every ``poll_s``:

1. read every run's demand (``SPOOL/demands/<run id>.json``, :class:`DemandFile`); a demand whose ``seq`` has not
   changed for ``demand_timeout_s`` seconds of the service's clock is a vanished run (the scavenger rewrites it every
   reconciliation);
2. list Slurm once for all runs: one ``sinfo``, one ``squeue -t all`` over every user's jobs and the advance
   reservations, whatever the number of runs (a node of a reservation that is active, or begins before a job of a
   run's time limit started now would end, is not offered to that run; a run that gives no time limit uses
   ``reservation_horizon_s``);
3. compute the pool (:func:`scavenger.shares.harvestable_gpus`) and the shares (weighted max-min,
   :func:`scavenger.shares.weighted_shares`) within the policy;
4. write each run's share with its own jobs as listed (``SPOOL/shares/<run id>.json``, :class:`ShareFile`), so
   the run's scavenger needs no listing of its own; cancel the live jobs of vanished runs (``scancel``, again every
   ``cancel_every_s`` while they live) and forget a vanished run once none of its jobs is live.

Ownership: a demand speaks for the Unix user owning its file (the sticky ``demands/`` directory lets no one replace
another's file). A run's jobs are those under its tag *and* of that user: another user's jobs under the tag are never
listed to it, counted in its share or cancelled for it, and a demand whose tag only another user's jobs carry is
refused (share 0, with the reason) — no user can have the service cancel another's jobs.

What a run asks for is what it could use (the N_prem law before any clamp to capacity, within its ``--max-jobs``);
the share caps what it keeps. Asking for its capped target instead would close the loop on itself: a run whose
share starts at 0 would ask for 0 and never get more.

Invariants: the service never submits, never reads a run's keys and touches only the jobs of runs that vanished;
rollout jobs are submitted by each run's own scavenger as the run's owner. A run cannot raise its share: the
share is computed here from the policy, and ``shares/`` is written by the service only (the run's scavenger caps
its target at the share it reads). A restarted service rebuilds everything from the spool and one listing: it
holds no state a restart could lose and submits nothing it could duplicate. A run acts on a listing only when the
listing was taken after the service read the demand the run posted after its last action (``seq`` echoed back):
its own submissions are never missing from the listing it acts on.
"""
from __future__ import annotations

import datetime as dt
import logging
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import msgspec

from rlboost_hpc.errors import BadInput
from rlboost_hpc.rundir import write_json_atomic
from scavenger.harvest_policy import SitePolicy
from scavenger.shares import RunDemand, harvestable_gpus, proportional_shares, weighted_shares
from scavenger.slurm_records import JobInfo, NodeInfo, job_number

log = logging.getLogger("scavenger.harvest")

__all__ = ["DemandFile", "ShareFile", "HarvestSpool", "HarvestService", "HarvestLink", "CycleResult", "SpoolBusy"]

#: Prefix of every rollout job's ``--comment`` (:meth:`scavenger.config.ScavengerConfig.resolved_tag`).
TAG_PREFIX = "rlboost:"
#: An unchanged cycle is still logged this often (seconds); a changed one always.
SAY_EVERY_S = 300.0


class DemandFile(msgspec.Struct, frozen=True):
    """A run's demand, written by its scavenger every cycle. ``instances``: rollout instances the run could use (the
    N_prem law before any clamp to capacity, within its ``--max-jobs``; 0 when the run is over);
    ``gpus_per_instance``/``cpus_per_instance``: GPUs and CPUs each; ``tag``: the ``--comment`` of its jobs; ``account``, ``partition``, ``qos``:
    what its jobs are submitted with ("" = Slurm's default); ``time_limit_s``: its jobs' ``--time`` in seconds
    (``None``: unlimited or not said); ``trainer_job``: the Slurm job id of its trainer ("" = not given), whose state
    the share echoes; ``seq``: bumped after each action the scavenger took (echoed in the share); ``ts``: the
    scavenger's wall clock (information only). The Unix user it speaks for is the file's owner, never its content."""

    run_id: str
    tag: str
    instances: int
    gpus_per_instance: int = 1
    account: str = ""
    partition: str = ""
    qos: str = ""
    active: bool = True
    seq: int = 0
    ts: float = 0.0
    time_limit_s: float | None = None
    trainer_job: str = ""
    cpus_per_instance: int = 1


class PostedDemand(msgspec.Struct, frozen=True):
    """A demand as the service read it: the file's content and ``owner``, the Unix user owning the file (the user
    whose jobs the demand may speak for)."""

    demand: DemandFile
    owner: str


class ShareFile(msgspec.Struct, frozen=True):
    """A run's share, written by the service every cycle. ``instances``: rollout instances the run may keep live;
    ``jobs``: the run's jobs as this cycle listed them (every state); ``seq``: the demand ``seq`` the service had
    read before it listed; ``cycle``/``service_start``: which service cycle wrote it; ``pool_gpus``/``idle_gpus``:
    the cycle's pool and idle GPUs (the pool as this run may use it: its reservation horizon applied); ``reason``:
    why the share is 0 when it is (``""`` otherwise); ``trainer_job``/``trainer``: the trainer job the demand named
    and that job as listed (``None`` when Slurm does not list it, or it is not the demand owner's; ``trainer_job``
    ``""``: not looked for)."""

    run_id: str
    instances: int
    seq: int
    cycle: int
    service_start: float
    jobs: list[JobInfo] = []
    pool_gpus: int = 0
    idle_gpus: int = 0
    reason: str = ""
    ts: float = 0.0
    trainer_job: str = ""
    trainer: JobInfo | None = None


class RunIdTaken(OSError):
    """The run's demand file in the spool belongs to another Unix user: that user holds the run id."""


def _user_name(uid: int) -> str:
    """The Unix user name of ``uid`` (its number as text when the system does not know it)."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class NotASpool(BadInput, ValueError):
    """A ``--harvest-dir`` that no harvest service created (a typo, or a directory made by hand)."""


class SpoolMarker(msgspec.Struct, frozen=True):
    """``SPOOL/service.json``, written by the service when it creates the spool and after every cycle: ``kind``
    (always :data:`SPOOL_KIND`), the Unix ``user`` and ``uid`` it runs as, its ``host`` and ``pid``, the ``created``
    epoch seconds and ``cycle_ts``, the epoch seconds of its last cycle (0: none yet). A run joins only a directory
    that holds it."""

    kind: str
    user: str
    uid: int
    host: str
    created: float
    pid: int = 0
    cycle_ts: float = 0.0


class SpoolBusy(BadInput, RuntimeError):
    """Another harvest service already serves this spool (two would split the GPUs and cancel jobs twice)."""


SPOOL_KIND = "rlboost-harvest-spool"


class HarvestSpool:
    """The one owner of the spool directory's layout: ``service.json`` (:class:`SpoolMarker`: the service made
    it), ``demands/<run id>.json`` (posted by runs; the directory is sticky and world-writable on a real cluster, so
    a run can replace only its own file, and the file's owner is the Unix user the demand speaks for) and
    ``shares/<run id>.json`` (the service's, world-readable)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.marker = self.root / "service.json"
        self.demands = self.root / "demands"
        self.shares = self.root / "shares"
        self._lock: int | None = None  # the service's lock on SPOOL/service.lock while it serves

    def create(self) -> "HarvestSpool":
        """Make both directories (demands/ mode 1777 — writable by every run, sticky; shares/ 0755) and the
        marker (rewritten at every start: who serves it now). Returns self. Raises OSError."""
        self.demands.mkdir(parents=True, exist_ok=True)
        self.shares.mkdir(parents=True, exist_ok=True)
        try:
            os.chmod(self.demands, 0o1777)
            os.chmod(self.shares, 0o755)
        except PermissionError:  # not ours to change (the admin set it up): keep what is there
            pass
        uid = os.getuid()
        self._marker = SpoolMarker(kind=SPOOL_KIND, user=_user_name(uid), uid=uid, host=socket.gethostname(),
                                   created=time.time(), pid=os.getpid())
        self.beat(0.0)
        return self

    def claim(self) -> "HarvestSpool":
        """Take the spool for this process (an exclusive ``flock`` on ``SPOOL/service.lock``, held until the process
        exits). Returns self. Raises :class:`SpoolBusy` naming the holder when another service holds it, OSError when
        the lock file cannot be made."""
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "service.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SpoolBusy(f"{self.root}: another harvest service (pid {holder}) serves this spool; stop it first "
                            "(two services would split the GPUs and cancel jobs twice)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode())
        self._lock = fd
        return self

    def beat(self, cycle_ts: float) -> None:
        """Rewrite the marker with the time of the service's last cycle (epoch s). Raises OSError."""
        self._marker = msgspec.structs.replace(self._marker, cycle_ts=cycle_ts)
        write_json_atomic(self.marker, msgspec.to_builtins(self._marker))
        os.chmod(self.marker, 0o644)

    def require(self) -> SpoolMarker:
        """The spool's marker. Raises :class:`NotASpool` (exit 2, naming the directory) when ``root`` is not a
        spool a harvest service created: no ``service.json`` of the right kind, or no ``demands/``."""
        hint = ("pass the spool_dir of the cluster's harvest service (`rlboost-hpc harvest serve` creates it; "
                "ask your admin), or leave --harvest-dir out to harvest alone")
        try:
            m = msgspec.json.decode(self.marker.read_bytes(), type=SpoolMarker)
        except FileNotFoundError:
            raise NotASpool(f"--harvest-dir {self.root}: not a harvest service's spool (no {self.marker.name}); "
                            f"{hint}") from None
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            raise NotASpool(f"--harvest-dir {self.root}: unreadable {self.marker} ({e}); {hint}") from None
        if m.kind != SPOOL_KIND or not self.demands.is_dir():
            raise NotASpool(f"--harvest-dir {self.root}: {self.marker} is not a harvest spool's marker "
                            f"(kind {m.kind!r}) or demands/ is missing; {hint}")
        return m

    def post_demand(self, d: DemandFile) -> None:
        """Replace the run's demand atomically. Raises :class:`RunIdTaken` when another Unix user owns the run's
        demand file (the sticky directory would refuse the replacement anyway), OSError otherwise (e.g. the spool
        does not exist)."""
        path = self.demands / f"{d.run_id}.json"
        try:
            uid = path.stat().st_uid
        except FileNotFoundError:
            uid = os.getuid()
        if uid != os.getuid():
            raise RunIdTaken(f"run id {d.run_id!r} is held by user {_user_name(uid)} in {self.demands} (their demand "
                             f"file): give this run another id (RLBOOST_RUN_ID or --run-id)")
        write_json_atomic(path, msgspec.to_builtins(d))

    def withdraw(self, run_id: str) -> None:
        """Remove the run's demand (it left); missing is fine."""
        (self.demands / f"{run_id}.json").unlink(missing_ok=True)

    def read_demands(self) -> dict[str, PostedDemand]:
        """Every well-formed demand by run id, with the Unix user owning its file; a malformed one (or one whose run
        id or tag is not its file name's: tags are ``rlboost:<run id>@…``) is logged and skipped — one run's bad file
        never stops the others."""
        out: dict[str, PostedDemand] = {}
        for p in sorted(self.demands.glob("*.json")):
            try:
                raw, owner = p.read_bytes(), p.stat().st_uid
                d = msgspec.json.decode(raw, type=DemandFile)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("harvest: skipping demand %s: %s", p, e)
                continue
            if d.run_id != p.stem or not d.tag.startswith(f"{TAG_PREFIX}{d.run_id}@"):
                # a demand speaks for its own run's jobs only: its file name (one owner in the sticky directory),
                # its run id and its tag agree, so no run can have the service list or cancel another's jobs
                log.warning("harvest: skipping demand %s: run_id %r and tag %r do not match its name", p, d.run_id,
                            d.tag)
                continue
            out[d.run_id] = PostedDemand(d, _user_name(owner))
        return out

    def write_share(self, s: ShareFile) -> None:
        """Replace the run's share atomically. Raises OSError."""
        write_json_atomic(self.shares / f"{s.run_id}.json", msgspec.to_builtins(s))

    def read_share(self, run_id: str) -> ShareFile | None:
        """The run's share; None when there is none yet or it cannot be read."""
        try:
            return msgspec.json.decode((self.shares / f"{run_id}.json").read_bytes(), type=ShareFile)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("harvest: cannot read the share of %s: %s", run_id, e)
            return None

    def forget(self, run_id: str) -> None:
        """Remove both files of a run the service no longer serves."""
        self.withdraw(run_id)
        (self.shares / f"{run_id}.json").unlink(missing_ok=True)


class CycleResult(msgspec.Struct):
    """One service cycle: shares by run id, the pool, and what was done. ``slurm_listings``: Slurm queries made
    (3 per cycle: sinfo, squeue, the reservations; a 4th, the nodes' features, with ``exclude_features``);
    ``demands``: instances each run asked for; ``pool_gpus``/``idle_gpus``/``held_gpus``: the pool as the run with
    the shortest job time limit may use it; ``reserved_nodes``: nodes kept from at least one run for an advance
    reservation (active, or beginning before a job of that run's time limit would end); ``excluded_nodes``: by name
    or feature; ``unknown_partitions``: harvested partitions without a node in Slurm's listing."""

    cycle: int
    shares: dict[str, int]
    demands: dict[str, int] = {}
    pool_gpus: int = 0
    idle_gpus: int = 0
    held_gpus: int = 0
    blackout: bool = False
    vanished: list[str] = []
    cancelled: list[str] = []
    reserved_nodes: list[str] = []
    excluded_nodes: list[str] = []
    slurm_listings: int = 0
    unknown_partitions: list[str] = []
    ok: bool = True
    error: str = ""


class HarvestService:
    """The cluster's one harvest service (see the module docstring). ``slurm``: a
    :class:`scavenger.daemon.SlurmAPI` (``only_mine=False`` listings: the service account sees every user's jobs);
    ``clock``: wall-clock seconds; ``local_time``: the local time blackout windows are judged in."""

    def __init__(self, policy: SitePolicy, slurm, *, spool: HarvestSpool | None = None,
                 clock: Callable[[], float] = time.time,
                 local_time: Callable[[], dt.datetime] = dt.datetime.now) -> None:
        self.policy, self.slurm, self.clock, self.local_time = policy, slurm, clock, local_time
        self.spool = spool or HarvestSpool(policy.spool_dir)
        self.start = clock()
        self.cycle = 0
        self._seen: dict[str, tuple[tuple[int, float], float]] = {}  # run id → ((seq, ts), service time it changed)
        self._cancelled_at: dict[str, float] = {}  # job id → last scancel (vanished runs)
        self._clashes: set[tuple[str, str, str]] = set()  # (run id, owner, job ids) of another user's jobs, logged
        self._missing_partitions: list[str] = []  # harvested partitions without a node in the last listing
        self._stop = threading.Event()

    def _weight(self, d: DemandFile) -> tuple[float, int | None, int | None, str]:
        """(weight, run GPU cap, account GPU cap, why 0) of a run under the policy."""
        if d.partition and d.partition not in self.policy.partitions:
            return 0.0, 0, 0, f"partition {d.partition!r} is not harvested (site policy: {self.policy.partitions})"
        if self.policy.qos and d.qos not in self.policy.qos:
            return 0.0, 0, 0, f"QoS {d.qos or '(default)'!r} may not harvest (site policy: {self.policy.qos})"
        acct = self.policy.account_grant(d.account)
        if acct is None:
            return 0.0, 0, 0, f"account {d.account!r} is not listed in the site policy"
        run = self.policy.runs.get(d.run_id)
        weight = acct.weight * (run.weight if run else 1.0)
        return weight, run.max_gpus if run else None, acct.max_gpus, ""

    def run_cycle(self) -> CycleResult:
        """One cycle (module docstring). Never raises on a Slurm failure: the shares of the last good cycle
        stay in place (runs see them age and stop submitting) and the result says why."""
        self.cycle += 1
        now = self.clock()
        res = CycleResult(cycle=self.cycle, shares={})
        posted = self.spool.read_demands()
        demands = {rid: p.demand for rid, p in posted.items()}
        res.demands = {rid: d.instances if d.active else 0 for rid, d in demands.items()}
        live_runs, vanished = self._live_runs(demands, now)
        try:
            nodes = self.slurm.sinfo_nodes(None)
            listed = self.slurm.squeue_jobs(all_states=True, only_mine=False)
            reservations = [r for r in self.slurm.reservations() if r.end is None or r.end > now]
            excluded = {*self.policy.exclude_nodes}
            if self.policy.exclude_features:
                bad = set(self.policy.exclude_features)
                excluded |= {n for n, f in self.slurm.node_features().items() if f & bad}
        except Exception as e:  # noqa: BLE001 - SlurmCommandError or a parse failure: keep last shares
            res.ok, res.error = False, f"{type(e).__name__}: {e}"
            return res
        res.slurm_listings = 4 if self.policy.exclude_features else 3
        res.excluded_nodes = sorted(excluded)
        self._note_missing_partitions(nodes, res)
        by_id = {j.job_id: j for j in listed}
        owned, why = self._owned_jobs(posted, [j for j in listed if j.comment.startswith(TAG_PREFIX)])
        blackout = res.blackout = self.policy.in_blackout(self.local_time())
        # a run is offered a node only when a job of its time limit started now ends before the node's reservation
        horizon = {rid: d.time_limit_s if d.time_limit_s is not None else self.policy.reservation_horizon_s
                   for rid, d in live_runs.items()}

        def reserved_within(h: float) -> set[str]:
            return {n for r in reservations if r.start is None or r.start - now < h for n in r.nodes}

        run_jobs = [j for rid in live_runs for j in owned.get(rid, [])]
        # a GPU is idle only where a job can start on it: with the CPUs the runs' jobs need per GPU (the least of them)
        cpus_per_gpu = min((max(1, math.ceil(d.cpus_per_instance / max(1, d.gpus_per_instance)))
                            for d in live_runs.values()), default=1)
        pools: dict[float, tuple[int, int, int]] = {}
        for h in {*horizon.values(), min(horizon.values(), default=self.policy.reservation_horizon_s)}:
            pools[h] = harvestable_gpus(
                nodes, run_jobs, partitions=self.policy.partitions, run_tags={d.tag for d in live_runs.values()},
                exclude_nodes=excluded | reserved_within(h), idle_share_free=self.policy.idle_share_free,
                blackout=blackout, cpus_per_gpu=cpus_per_gpu)
        shortest, longest = min(pools), max(pools)
        pool, idle, held = pools[shortest]
        res.pool_gpus, res.idle_gpus, res.held_gpus = pool, idle, held
        res.reserved_nodes = sorted(reserved_within(longest))  # kept from at least one run (its time limit)
        asks, caps = [], {}
        for rid, d in live_runs.items():
            weight, run_cap, account_cap, reason = self._weight(d)
            if reason or rid in why or not d.active:
                why[rid] = why.get(rid) or reason or "the run is over"
                continue
            if account_cap is not None:
                caps[d.account] = account_cap
            asks.append(RunDemand(rid, max(0, d.instances), d.gpus_per_instance, weight, d.account, run_cap))
        # runs whose jobs live longer may use only the nodes no reservation claims within their time limit
        groups = [(frozenset(r for r, hr in horizon.items() if hr >= h), pools[h][0]) for h in sorted(pools)
                  if h > shortest]
        rule = proportional_shares if self.policy.share_rule == "demand_proportional" else weighted_shares
        shares = rule(asks, pool, caps, groups)
        for rid, d in demands.items():
            n = shares.get(rid, 0)
            reason = "vanished" if rid in vanished else why.get(rid, "blackout" if blackout and not n else "")
            res.shares[rid] = n
            self._write_share(posted[rid], n, reason, owned.get(rid, []), by_id,
                              pool_gpus=pools[horizon[rid]][0] if rid in horizon else pool, idle_gpus=idle, now=now)
        for p in self.spool.shares.glob("*.json"):
            if p.stem not in demands:  # the run withdrew its demand: it left
                p.unlink(missing_ok=True)
        for rid in vanished:
            self._drain_vanished(demands[rid], owned.get(rid, []), now, res)
        res.vanished = vanished
        return res

    def _live_runs(self, demands: dict[str, DemandFile], now: float) -> tuple[dict[str, DemandFile], list[str]]:
        """(the runs whose demand changed within ``policy.demand_timeout_s``, the ids of those whose did not): a run's
        scavenger rewrites its demand every cycle, so one that stopped doing so is gone."""
        live_runs, vanished = {}, []
        for rid, d in demands.items():
            last = self._seen.get(rid)
            if last is None or last[0] != (d.seq, d.ts):  # the run's scavenger rewrote it: alive
                self._seen[rid] = ((d.seq, d.ts), now)
            if now - self._seen[rid][1] > self.policy.demand_timeout_s:
                vanished.append(rid)
            else:
                live_runs[rid] = d
        return live_runs, vanished

    def _write_share(self, posted: PostedDemand, instances: int, reason: str, jobs: list, by_id: dict, *,
                     pool_gpus: int, idle_gpus: int, now: float) -> None:
        """Write one run's share file (``posted``: its demand as the spool read it); a write that fails is logged,
        the cycle goes on."""
        d = posted.demand
        trainer = by_id.get(d.trainer_job) if d.trainer_job else None
        if trainer is not None and trainer.user and trainer.user != posted.owner:
            trainer = None  # another user's job: not this run's trainer
        try:
            self.spool.write_share(ShareFile(
                run_id=d.run_id, instances=instances, seq=d.seq, cycle=self.cycle, service_start=self.start, jobs=jobs,
                pool_gpus=pool_gpus, idle_gpus=idle_gpus, reason=reason, ts=now, trainer_job=d.trainer_job,
                trainer=trainer))
        except OSError as e:
            log.warning("harvest: cannot write the share of %s: %s", d.run_id, e)

    def _note_missing_partitions(self, nodes: list[NodeInfo], res: CycleResult) -> None:
        """Say loudly, once per change, when a partition the policy harvests has no node in Slurm's listing (the
        partition was removed or renamed after the service started): nothing there is harvested."""
        missing = sorted(set(self.policy.partitions) - {p for n in nodes for p in n.partitions})
        res.unknown_partitions = missing
        if missing != self._missing_partitions:
            if missing:
                log.error("harvest: the site policy's harvest.partitions %s: no node of %s is listed by Slurm "
                          "(removed or renamed?): nothing is harvested there", self.policy.partitions,
                          ", ".join(missing))
            else:
                log.info("harvest: every partition of the site policy is listed by Slurm again")
            self._missing_partitions = missing

    def _owned_jobs(self, posted: dict[str, PostedDemand], tagged: list[JobInfo]
                    ) -> tuple[dict[str, list[JobInfo]], dict[str, str]]:
        """Each run's jobs — those under its tag that belong to the Unix user owning its demand file — and the runs
        refused because another user holds their tag (run id → why): the user of the oldest live job under the tag
        (by submission, then job id) holds it. Jobs under a run's tag of any other user are never the run's: not
        listed to it, not counted in its share, never cancelled for it; each clash is logged once. A job whose user
        Slurm did not say (``""``) counts as the owner's."""
        by_tag: dict[str, list[JobInfo]] = {}
        for j in tagged:
            by_tag.setdefault(j.comment, []).append(j)
        owned: dict[str, list[JobInfo]] = {}
        refused: dict[str, str] = {}
        for rid, p in posted.items():
            jobs = by_tag.get(p.demand.tag, [])
            owned[rid] = [j for j in jobs if not j.user or j.user == p.owner]
            strangers = [j for j in jobs if j.user and j.user != p.owner]
            if not strangers:
                continue
            live = sorted((j for j in jobs if j.live), key=lambda j: (j.submit_time or 0.0, job_number(j.job_id)))
            holder = live[0].user if live and live[0].user else p.owner
            ids = ",".join(j.job_id for j in strangers)
            if holder != p.owner:
                refused[rid] = (f"run id {rid!r}: its tag is held by the jobs of user(s) {holder} (oldest live job "
                                f"{live[0].job_id}); the demand is user {p.owner}'s")
            key = (rid, p.owner, ids)
            if key not in self._clashes:
                self._clashes.add(key)
                log.warning("harvest: jobs %s of user(s) %s carry the tag of run %s, whose demand is user %s's: %s",
                            ids, ", ".join(sorted({j.user for j in strangers})), rid, p.owner,
                            "the demand is refused" if rid in refused else "ignored (never counted or cancelled)")
        return owned, refused

    def _drain_vanished(self, d: DemandFile, jobs: list[JobInfo], now: float, res: CycleResult) -> None:
        """Cancel the live jobs of a run that stopped posting its demand (again every ``cancel_every_s``);
        forget the run once none is live."""
        live = [j for j in jobs if j.live]
        if not live:
            log.info("harvest: run %s vanished and has no live job left; forgetting it", d.run_id)
            self.spool.forget(d.run_id)
            self._seen.pop(d.run_id, None)
            return
        due = [j.job_id for j in live if now - self._cancelled_at.get(j.job_id, float("-inf"))
               >= self.policy.cancel_every_s]
        if not due:
            return
        try:
            self.slurm.scancel(due)
        except Exception as e:  # noqa: BLE001 - retried next cycle
            log.warning("harvest: scancel of %s (run %s vanished) failed: %s", ",".join(due), d.run_id, e)
            return
        for jid in due:
            self._cancelled_at[jid] = now
        res.cancelled += due
        log.warning("harvest: run %s posted no demand for %.0f s: cancelled its jobs %s", d.run_id,
                    self.policy.demand_timeout_s, ",".join(due))

    def owners_report(self, since: str | None = None):
        """The :class:`scavenger.harvest_report.OwnersReport` since ``since`` (sacct's ``--starttime``; None: the
        last ``report_window_s``), from one ``sacct --allusers``. Raises SlurmCommandError (no accounting)."""
        from scavenger.harvest_report import owners_report

        since = since or dt.datetime.fromtimestamp(self.clock() - self.policy.report_window_s).strftime(
            "%Y-%m-%dT%H:%M:%S")
        rows = self.slurm.sacct_records(starttime=since, all_users=True)
        return owners_report(rows, rollout_prefix=self.policy.rollout_job_prefix,
                             spot_price_per_gpu_hour=self.policy.spot_price_per_gpu_hour,
                             on_demand_price_per_gpu_hour=self.policy.on_demand_price_per_gpu_hour)

    def stop(self) -> None:
        """Ask :meth:`serve` to return after the current cycle."""
        self._stop.set()

    def serve(self, max_cycles: int | None = None, status_path: Path | None = None, metrics=None) -> int:
        """Run cycles every ``poll_s`` until :meth:`stop` (or ``max_cycles``); each cycle's result goes to the
        log (as JSON to ``status_path``; to ``metrics``, a :class:`scavenger.metrics.HarvestMetrics`). Returns 0."""
        self.spool.create()
        last_report = last_said_at = float("-inf")
        last_said: tuple | None = None
        while not self._stop.is_set():
            res = self.run_cycle()
            if metrics is not None:
                if self.policy.report_every_s and self.clock() - last_report >= self.policy.report_every_s:
                    last_report = self.clock()
                    try:
                        metrics.refresh_report(self.owners_report())
                    except Exception as e:  # noqa: BLE001 - accounting may be down: the shares go on
                        log.warning("harvest: owners' report failed: %s", e)
                metrics.refresh(res)
            if not res.ok:
                log.warning("harvest: cycle %d: %s (shares unchanged)", res.cycle, res.error)
            else:
                try:
                    self.spool.beat(time.time())
                except OSError as e:
                    log.warning("harvest: cannot write %s: %s", self.spool.marker, e)
                said = (res.pool_gpus, res.blackout, tuple(sorted(res.shares.items())))
                if said != last_said or self.clock() - last_said_at >= SAY_EVERY_S:  # a line per change, not cycle
                    last_said, last_said_at = said, self.clock()
                    log.info("harvest: cycle %d pool %d GPUs (idle %d, held %d%s) shares %s", res.cycle,
                             res.pool_gpus, res.idle_gpus, res.held_gpus, ", blackout" if res.blackout else "",
                             res.shares)
            if status_path is not None:
                try:
                    write_json_atomic(status_path, msgspec.to_builtins(res))
                except OSError as e:
                    log.warning("harvest: cannot write %s: %s", status_path, e)
            if max_cycles is not None and self.cycle >= max_cycles:
                break
            self._stop.wait(self.policy.poll_s)
        return 0


class HarvestLink:
    """A run's side of the harvest service, used by its scavenger each reconciliation: :meth:`exchange` posts the
    demand and returns the share when it is fresh and was listed after the run's last action.

    ``max_age_s``: a share whose (service start, cycle) has not changed for this many seconds of the run's clock is
    stale — the service is down: the run submits nothing new and keeps its jobs."""

    def __init__(self, spool: str | os.PathLike[str], run_id: str, tag: str, *, account: str = "",
                 partition: str = "", qos: str = "", max_age_s: float = 60.0, trainer_job: str = "",
                 time_limit_s: float | None = None, cpus_per_instance: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spool = HarvestSpool(spool)
        self.run_id, self.tag, self.account, self.partition, self.qos = run_id, tag, account, partition, qos
        self.trainer_job, self.time_limit_s, self.cpus_per_instance = trainer_job, time_limit_s, cpus_per_instance
        self.max_age_s, self.clock = max_age_s, clock
        self.seq = 0
        self._last: tuple[float, int] | None = None
        self._changed_at = clock()

    def exchange(self, instances: int, gpus_per_instance: int, active: bool) -> tuple[ShareFile | None, str, bool]:
        """Post this cycle's demand; returns ``(share, "", False)`` when the share is fresh and covers the last
        action, ``(None, why, False)`` while the listing after the last action is awaited, ``(None, why, True)``
        when there is no fresh share at all (the service is down or not there: the run falls back to its own
        listing and submits nothing new). Raises OSError when the demand cannot be posted (no spool; a
        :class:`RunIdTaken` when another user holds the run id)."""
        self.spool.post_demand(DemandFile(run_id=self.run_id, tag=self.tag, instances=max(0, instances),
                                          gpus_per_instance=gpus_per_instance, account=self.account,
                                          partition=self.partition, qos=self.qos, active=active, seq=self.seq,
                                          ts=time.time(), time_limit_s=self.time_limit_s,
                                          trainer_job=self.trainer_job, cpus_per_instance=self.cpus_per_instance))
        s = self.spool.read_share(self.run_id)
        now = self.clock()
        if s is None:  # the service has not seen the demand yet; none at all for max_age_s: stale
            return None, f"no share from the harvest service in {self.spool.shares} yet", \
                now - self._changed_at > self.max_age_s
        key = (s.service_start, s.cycle)
        if key != self._last:
            self._last, self._changed_at = key, now
        if now - self._changed_at > self.max_age_s:
            return None, f"the harvest service's share is {now - self._changed_at:.0f} s old (service down?)", True
        if s.seq != self.seq:
            return None, "waiting for a listing taken after the last action", False
        return s, "", False

    def acted(self) -> None:
        """Record that this cycle submitted or cancelled: the next share must come from a newer listing."""
        self.seq += 1

    def leave(self) -> None:
        """Withdraw the demand (the run is over and its jobs are gone): its share goes to the others at once."""
        self.spool.withdraw(self.run_id)
