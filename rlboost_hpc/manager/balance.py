"""Continuous balancing of the rollout manager (its invariant 6): learn each routable preemptible instance's decode
rate at its running batch, and release running requests beyond a donor's learned plateau toward instances with
headroom — or, in the step's tail (nothing queued), from the instance where a request decodes slowest toward an
idle, faster one. Released requests migrate per sample; dispatch gives each to the instance the balancer chose when
that one still has room, else to the least-loaded instance."""
from __future__ import annotations

import logging
from rlboost_hpc.manager.state import InstanceState as S
from rlboost_hpc.policy.dispatch import InstanceLoad
from rlboost_hpc.protocol import messages as M

log = logging.getLogger("rlboost.manager")


def balance(core, now: float) -> None:
    """Invariant 6 for ``core`` (a :class:`~rlboost_hpc.manager.core.ManagerCore`): learn each routable
    preemptible instance's decode rate at its batch, then release
    running requests beyond a donor's plateau toward instances with headroom."""
    if core._last_balance is None:
        core._last_balance = now
    dt = now - core._last_balance
    if dt < core.settings.balance_every_s:
        return
    core._last_balance = now
    insts = [i for i in core.fleet.values() if i.kind == "preemptible" and core.routable(i)]
    marks = {}
    for i in insts:
        running = len(i.inflight - i.releasing)
        prev = core._rate_marks.get(i.key)
        if prev is not None and prev[1] > 0 and running > 0:  # busy through the whole interval
            batch, rate = min(prev[1], running), (i.tokens_received - prev[0]) / dt
            core.balancer.observe(i.key, batch, rate)
            core.pool_rates.observe(batch, rate)
        marks[i.key] = (i.tokens_received, running)
        peak = core.balancer.peak(i.key)
        if peak is not None:
            core.step_account.learned_peak(i.key, peak)
    for key in set(core._rate_marks) - set(marks):
        if (i := core.fleet.get(key)) is None or i.state in (S.GONE, S.SUSPECT):
            core.balancer.forget(key)
    core._rate_marks = marks
    if not core.balancing or len(insts) < 2 or core.book.queue:  # queued work goes to idle instances by JSQ, not moves
        return
    by_key = {i.key: i for i in insts}
    loads = [InstanceLoad(i.key, 0, len(i.inflight - i.releasing), min(i.max_batch, core.settings.pending_limit))
             for i in insts]
    moves = core.balancer.moves_for(
        loads, now, queued_of=lambda k: [],
        running_of=lambda k: [(r, core.book.requests[r].n) for r in sorted(by_key[k].inflight - by_key[k].releasing)
                              if r in core.book.requests], tail=True)  # nothing is queued here (returned above else)
    release: dict[str, list[str]] = {}
    for m in moves:
        if m.kind == "running":
            release.setdefault(m.src, []).append(m.rid)
            core.book.requests[m.rid].prefer = m.dst  # JSQ alone could hand it to any idle instance, a slow one too
    for key, rids in release.items():
        inst = by_key[key]
        inst.releasing |= set(rids)
        core.counters.balancer_moves += len(rids)
        core.send(inst.peer, M.Release(rids=rids))
        log.debug("balancer: releasing %d running requests of %s (plateau %d)", len(rids), key,
                  core.balancer.plateau(key))
