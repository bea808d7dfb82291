"""Dispatch of the rollout manager: queued responses to routable instances (its invariant 4), join-shortest-queue
below Θ (``policy.dispatch``), each response only to an instance holding a version of its window, the balancer's
choice first; a reserved engine only the step the trainer trains or seeds."""
from __future__ import annotations

from rlboost_hpc.manager.state import InstanceState as S, RequestState as R
from rlboost_hpc.policy.dispatch import arrival_share, choose_instance
from rlboost_hpc.protocol import messages as M


def ahead_of_training(core, req) -> bool:
    """Whether ``req`` belongs to a step submitted ahead (bounded staleness) of the one the trainer trains, or seeds
    while the seeding window is open: such work never goes to a reserved engine, which shares the trainer's devices
    (so it never generates while the trainer trains another step; its co-located fallback still serves the trained
    step, so no step waits on it). False when the trained step is unknown (-1: before the first close of seeding)."""
    if not core.settings.max_staleness or core.train_step < 0:
        return False
    return req.step > core.train_step + int(core.seeding_open)


def arriving(core, now: float) -> int:
    """Instances about to serve the latest version: live when it was set, loading it still (they reported no load
    since: one that loaded another version — another lineage's — is not about to serve), and quick to load the last
    one — at most ``arrival_hold_s`` and twice the slowest load of the previous version (plus 50 ms) after it was
    set. Their share of the step's work waits for them (:func:`~rlboost_hpc.policy.dispatch.arrival_share`)."""
    vs = core.version_serving
    if not vs.waiting or core.settings.arrival_hold_s <= 0:
        return 0
    if now - vs.set_at > min(core.settings.arrival_hold_s, 2 * vs.last.last_s + 0.05):
        return 0
    return sum(1 for k in vs.waiting - vs.reported if (i := core.fleet.get(k)) is not None
               and i.state in (S.READY, S.PULLING) and not core.serves(i))


def dispatch(core) -> None:
    """Invariant 4 for ``core`` (a :class:`~rlboost_hpc.manager.core.ManagerCore`). Join-shortest-queue
    (``policy.dispatch.choose_instance``): give each queued request to the routable instance with the fewest requests
    in flight, among those below min(Θ, its batch) and holding a version of its window; the rest wait here (delayed
    dispatch). ``dispatch_policy="round_robin"`` is the ablation baseline. While instances are about to load the
    version (:func:`arriving`), an instance takes at most an equal share of the step's work.

    An instance silent for more than ``dispatch_silence_s`` gets no new work while it stays routable: a node
    that vanished without closing its connections (power loss, partition) keeps its running responses until
    the heartbeat deadline suspects it, but takes no more with it."""
    if not core.book.queue:
        return
    now = core.clock()
    heard = now - core.settings.dispatch_silence_s
    cands = sorted((i for i in core.fleet.values() if i.last_seen >= heard and core.routable(i)),
                   key=lambda i: i.key)
    if not cands:
        return
    batches: dict[str, list[M.Work]] = {}
    deferred: list[str] = []
    share = arrival_share(len(core.book.queue) + sum(len(i.inflight) for i in cands), len(cands), arriving(core, now))
    limit = {i.key: min(core.settings.pending_limit, i.max_batch, share or i.max_batch) for i in cands}
    free = [i for i in cands if len(i.inflight) < limit[i.key]]  # in key order
    choose = core._rr.choose if core.settings.dispatch_policy == "round_robin" else choose_instance
    while core.book.queue and free:
        rid = core.book.queue.popleft()
        req = core.book.requests.get(rid)
        if req is None or req.state != R.QUEUED:
            continue
        # not back where a Release is still pending; holding a version of its window; no step ahead on a reserved
        ahead = ahead_of_training(core, req)
        ok = [i for i in free if rid not in i.releasing and i.version >= req.version
              and not (ahead and i.kind == "reserved")]
        if not ok:
            deferred.append(rid)
            continue
        loads = [len(i.inflight) for i in ok]  # all below Θ (and their batch size)
        inst = next((i for i in ok if i.key == req.prefer), None) or ok[choose(loads, core.settings.pending_limit)]
        req.prefer = None
        req.move(R.RUNNING, inst.key)
        req.attempts += 1
        req.assigned_at = now
        req.instances.append(inst.key)
        inst.inflight.add(rid)
        core.note_activity(inst)
        if len(inst.inflight) >= limit[inst.key]:
            free.remove(inst)
        if req.n:  # a partial response resumes here
            into = core.counters.migrations_by_engine["into"]
            into[inst.engine] = into.get(inst.engine, 0) + 1
        batches.setdefault(inst.key, []).append(req.work(inst.version))
        core.counters.dispatched += 1
        if inst.kind == "preemptible":  # with its peak so far (balance() keeps it current)
            core.step_account.dispatched(inst.key, core.clock(), core.balancer.peak(inst.key))
    core.book.queue.extendleft(reversed(deferred))
    for key, works in batches.items():
        core.send(core.fleet.instances[key].peer, M.Assign(works=works))
