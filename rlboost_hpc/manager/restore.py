"""A restarted rollout manager continues the step in flight: its state rebuilt from the work log
(``manager/worklog.py``), and the responses it held handed back to the instances that were running them.

What a restart keeps: the trainer (its routing id, so its resent calls are recognised), the weight version and its
checksum, the step's groups with every token the log holds, trajectories' turns and observations (a tool call in
flight is asked of the new manager's environment again; a stateful environment's instances died with the old tool
processes, and the new ones rebuild each from the trajectory on its next step — ``tasks/environment.py``), finished responses, acknowledged groups, the counters of
the last compaction, and the registered instances by routing id. A restored instance is PULLING until it confirms
the current version (it re-registers when it hears the new epoch; it keeps its weights when their checksum is the
version's); it is suspected, as any instance, if it stays silent past the heartbeat deadline.

Unfinished responses are *held* for up to the heartbeat deadline (``heartbeat_timeout_s``) after the restart. A restored instance that re-registers is
asked to send every response it runs (or finished in the last seconds) again, whole (``Welcome.resend``): it adopts
those the log holds a prefix of (:func:`adopt`; the overlap must equal the log) — so neither the tokens of the last
commit window nor those it generated while the manager was away are lost. What no instance adopted is queued when
the hold ends and resumes, from the tokens the log holds, wherever dispatch puts it.
"""
from __future__ import annotations

import logging

from rlboost_hpc.manager import worklog as W
from rlboost_hpc.manager.state import ENV_PEER, Instance, InstanceState as S, Request, RequestState as R
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.stats import ManagerCounters

log = logging.getLogger("rlboost.manager")

#: The owner a response is replayed through on its way to a state the log recorded (never an instance's key).
REPLAYED = "<replayed>"


def restore(core, records: list[W.Record], now: float) -> None:
    """Rebuild ``core`` (a fresh :class:`~rlboost_hpc.manager.core.ManagerCore`) from a work log's ``records``, as
    of monotonic time ``now``; unfinished responses are held for their instances up to the heartbeat deadline
    (module docstring). Records of responses the log does not hold (a torn step) are ignored."""
    for i, rec in enumerate(records):
        if isinstance(rec, W.Begin) and i:  # a manager restarted after the log's first record (the snapshot's)
            core.counters.manager_restarts += 1
        _apply(core, rec, now)
    core.book.queue.clear()
    if core.settings.max_staleness:  # the steps in flight survive the next compaction (TrainerCalls._steps_in_flight)
        core.since_compact = list(records)
    core.held = {r.rid: None for r in core.book.unfinished() if r.state == R.QUEUED}
    core.held_since = now
    for r in core.book.unfinished():
        if r.state == R.ENVIRONMENT:  # its tool call died with the old manager's environment: ask again (a
            core.send(ENV_PEER, r.env_call())  # stateful environment is rebuilt by replaying the trajectory)
    if core.book.step_rolled_out(core.step):
        core.step_account.rollout_done_at = now
    core.counters.manager_restarts += 1
    log.info("restored from the work log: step %d, version %d, %d responses (%d unfinished, %d tokens), "
             "%d instances", core.step, core.lineage.latest.number, len(core.book), len(core.held),
             sum(r.n for r in core.book.requests.values()), len(core.fleet))


def _apply(core, rec: W.Record, now: float) -> None:
    """One record, as the manager that wrote it had applied it."""
    req: Request | None = core.book.get(getattr(rec, "rid", ""))
    if isinstance(rec, W.Frame):
        _replay_tokens(core, rec)
    elif isinstance(rec, W.Finished):
        if req is not None and req.state != R.DONE:
            if req.state == R.QUEUED:
                req.move(R.RUNNING, REPLAYED)
            req.move(R.DONE, finish_reason=rec.reason)
            core.book.group_done(req)
    elif isinstance(rec, W.ToolCall):
        if req is not None and req.state == R.QUEUED:
            req.move(R.RUNNING, REPLAYED)
            req.move(R.ENVIRONMENT)
    elif isinstance(rec, W.Observation):
        if req is not None and req.state == R.ENVIRONMENT:
            if req.env_row:
                req.env_step_done(req.turn, rec.reward, rec.error)
            if rec.ids:
                req.append_observation(rec.ids)
                req.move(R.QUEUED)
    elif isinstance(rec, W.Submit):
        core.trainer_calls.begin_step(rec.step, rec.version, rec.groups)
    elif isinstance(rec, W.Migrated):
        if req is not None:
            req.migrations += 1
    elif isinstance(rec, W.Acked):
        if rec.gid in core.book.groups:
            core.book.groups[rec.gid].delivered = True
    elif isinstance(rec, W.Joined):
        inst = Instance(key=rec.key, peer=rec.peer, kind=rec.kind, max_batch=rec.max_batch, registered_at=now,
                        last_seen=now, engine=rec.engine, relay_endpoint=rec.relay_endpoint, restored=True, spoke=False)
        core.fleet.join(inst)
        core.note_activity(inst)
    elif isinstance(rec, W.Silent):
        inst = core.fleet.get(rec.key)
        if inst is not None:  # (construction, not a transition: the instance is being rebuilt as it was)
            inst.state, inst.suspect_since = (S.SUSPECT, now) if rec.suspect else (S.PULLING, 0.0)
            inst.suspect_from = S.READY if rec.suspect else None  # (its version decides where it returns to; a
            # return is not counted as one from a silence while pulling, which this manager never saw)
            inst.restored = not rec.suspect  # its work was migrated when it went silent: nothing to resend
            core.note_activity(inst)
    elif isinstance(rec, W.Left):
        core.fleet.forget(rec.key, "gone before the manager restarted")
        core.activity.forget(rec.key)
    elif isinstance(rec, W.Hello):
        if core.trainer_peer not in (None, rec.peer or None):  # a resumed trainer said hello: as it was applied
            new_trainer(core)
            core.other_trainer = True
        core.trainer = rec
        if rec.weights_shards:
            core.relay.fanout = 0
    elif isinstance(rec, W.Version):
        if core.other_trainer and not rec.identity.same_weights(core.lineage.latest):  # the resumed trainer's ruled
            discard_stale(core)
        core.other_trainer = False
        core.lineage.make_current(rec.identity)  # (the latest with it)
    elif isinstance(rec, W.Seeding):
        core.seeding_open = rec.open
        if not rec.open:
            core.train_step = rec.step
    elif isinstance(rec, W.Counters):
        core.counters = rec.counters
    elif isinstance(rec, W.Evaluated):
        core.heldout[rec.when] = rec.result


def _replay_tokens(core, rec: W.Frame) -> None:
    """Apply the deltas of a journaled ``Tokens`` frame as the manager applied them (:class:`W.Frame`)."""
    msg: M.Tokens = M.decode(rec.data)
    ids, lps, lo, dropped = memoryview(msg.ids), memoryview(msg.logprobs), 0, set(rec.dropped)
    for rid, off, cnt, ver in zip(msg.rids, msg.offsets, msg.counts, msg.versions):
        hi = lo + 4 * cnt
        req = core.book.requests.get(rid)
        if req is not None and rid not in dropped and req.state != R.DONE and ver >= req.version:
            start = req.turn_start + off
            skip = req.n - start  # > 0: an adopted resend, applied past what the log held
            if 0 <= skip < cnt and off + cnt <= req.turn_budget() and (
                    not skip or bytes(req.ids[4 * start: 4 * req.n]) == bytes(ids[lo: lo + 4 * skip])):
                req.append(ids[lo + 4 * skip: hi], lps[lo + 4 * skip: hi], cnt - skip, ver)
        lo = hi


def adopt(core, req: Request, inst: Instance, offset: int, ids: memoryview) -> int | None:
    """A restored instance sent a delta of ``req`` (held since the restart) at ``offset`` (from the turn's start)
    with packed int32 ``ids``. It takes the response over when the delta starts at or before the length the log
    holds and the overlap equals the logged tokens (its resend, ``Welcome.resend``): returns how many leading tokens
    of the delta the log already holds (the rest apply). None: not adopted — a delta past a gap (tokens of the last
    commit window; the instance's resend follows) or one that disagrees with the log (it is told to release it)."""
    if not inst.restored or req.state != R.QUEUED or req.rid not in core.held:
        return None
    start = req.turn_start + offset
    skip = req.n - start
    if skip < 0 or skip > len(ids) // 4:
        return None
    if bytes(req.ids[4 * start: 4 * req.n]) != bytes(ids[: 4 * skip]):
        log.warning("instance %s resent %s with tokens other than the work log's; it is told to release it",
                    inst.key, req.rid)
        core.send(inst.peer, M.Release(rids=[req.rid]))
        return None
    del core.held[req.rid]
    req.move(R.RUNNING, inst.key)
    req.attempts += 1
    req.assigned_at = core.clock()
    req.instances.append(inst.key)
    inst.inflight.add(req.rid)
    core.note_activity(inst)
    core.counters.responses_adopted += 1
    return skip


def take_over(core, inst: Instance, peer: bytes) -> None:
    """An instance rebuilt from the work log and not heard from since registers from a new connection (its worker
    outlived a trainer crash and reconnected with a new agent, keeping its engine; or the resumed trainer's own
    reserved engine): that connection takes the identity over — the old routing id never spoke to this manager —
    once; the new agent holds nothing to resend. Responses it was adopting are queued."""
    for rid in list(inst.inflight):
        inst.inflight.discard(rid)
        core.book.first_in_line(core.book.requests[rid])
    core.fleet.rebind(inst, peer)
    inst.restored, inst.tokens_received, inst.tokens_generated, inst.spoke = False, 0, 0, True  # (a new agent)
    core.note_activity(inst)
    log.info("instance %s registers from a new connection after the restart; it takes its identity over", inst.key)


def unsent_tokens(inst: Instance) -> int:
    """Tokens ``inst`` generated that never reached the manager (what its loss regenerates); 0 for a restored
    instance that has not resent yet — what it generated before the restart is not this manager's to count."""
    return 0 if inst.restored else max(0, inst.tokens_generated - inst.tokens_received)


def release_held(core, now: float) -> None:
    """The hold after a restart is over — its time is up, or every restored instance has resent what it holds (one
    that was suspect at the kill is not waited for, nor, after ``alive_every_s``, one that has not spoken since the
    restart: it died meanwhile) —: what no instance adopted is queued (in step order). One holding tokens resumes on
    another instance from them: a migration, counted and journaled as one (its instance may have left in the commit
    window the kill lost, so that the old manager's count of it is gone too)."""
    t0 = core.held_since
    if t0 is None:
        return
    over = now >= t0 + core.settings.heartbeat_timeout_s
    if over or not any(i.restored and (i.last_seen > t0 or now < t0 + core.alive_every_s)  # (after a second, only
                       for i in core.fleet.values()):  # those that spoke since the restart count)
        for rid in core.held:
            req = core.book.get(rid)
            if req is None or req.state != R.QUEUED:
                continue
            core.book.last_in_line(req)
            if req.n:
                req.migrations += 1
                core.counters.responses_migrated += 1
                core.counters.tokens_migrated += req.n
                core.log_work(W.Migrated(rid))
        log.info("the hold after the restart is over: %d responses adopted, %d held ones queued (%s)",
                 core.counters.responses_adopted, len(core.held),
                 "its time is up" if over else "every restored instance resent")
        core.held, core.held_since = {}, None


def discard_stale(core) -> int:
    """A new trainer (resumed from a checkpoint) makes a version other than the restored one current: the restored
    unfinished responses were made by weights the trainer does not have. They are dropped (their instances told
    to release them) and counted; returns how many."""
    n, ended = 0, []
    for req in list(core.book.unfinished()):
        rid = req.rid
        n += 1
        if req.env_row:
            ended.append(rid)
        core.counters.responses_discarded_stale += 1
        core.counters.tokens_discarded_stale += req.n
        inst = core.fleet.get(req.instance or "")
        if inst is not None:
            inst.inflight.discard(rid)
            core.note_activity(inst)
            core.send(inst.peer, M.Release(rids=[rid]))
    if ended:
        core.send(ENV_PEER, M.EnvRelease(ended))
    core.book.clear()
    core.held, core.held_since = {}, None
    return n


def new_trainer(core) -> None:
    """A trainer other than the restored one said hello (a resumed trainer): every finished group it has not
    acknowledged is its to take, whoever acknowledged it before; the counters start over with it (its checkpoint
    holds the totals of the incarnations before)."""
    for g in core.book.groups.values():
        g.delivered = False
    core.counters = ManagerCounters()
