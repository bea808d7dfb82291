"""The trainer's side of the rollout manager: its calls (hello, version changes, steps, the end of seeding, policy
state, step times, acknowledgements, stats, redelivery) and the delivery of finished GRPO groups to it.

A collaborator held by :class:`~rlboost_hpc.manager.core.ManagerCore` as ``core.trainer_calls`` (the same single
writer); the
invariants it keeps are the core's: the version changes only between steps, when no response is unfinished (1,
strict on-policy), and each finished group reaches the trainer until it acknowledges it, then never again (2,
exactly once). Every call is answered idempotently by its call id: a call resent after a lost reply changes
nothing twice.
"""
from __future__ import annotations

import logging

import numpy as np

from rlboost_hpc.manager import worklog as W
from rlboost_hpc.manager.restore import discard_stale, new_trainer
from rlboost_hpc.manager.state import Group, Instance, InstanceState as S, Request
from rlboost_hpc.protocol import messages as M

log = logging.getLogger("rlboost.manager")


class TrainerCalls:
    """The trainer-facing handlers of the rollout manager (see the module docstring): a collaborator of ``core`` (a
    :class:`~rlboost_hpc.manager.core.ManagerCore`), which holds the state owners it works on — the fleet, the
    request book, the lineage, the counters — and calls it for the messages of its kind (``_on_<Message>``, found by
    the core's dispatch table). It keeps no state of its own.
    """

    def __init__(self, core) -> None:  # (a ManagerCore: not imported, it imports this module)
        self.core = core

    def _on_TrainerHello(self, peer: bytes, inst: Instance | None, msg: M.TrainerHello) -> None:
        if self.core.trainer_peer not in (None, peer):  # a resumed trainer takes over the restored step
            new_trainer(self.core)
            self.core.other_trainer = True
        self.core.trainer = W.Hello(peer, msg.weights_endpoint, msg.weights_shards, msg.model_config, msg.model_arch,
                                    msg.adapter)
        if msg.weights_shards:  # a relay holder serves one buffer; a sharded version has one per trainer holder
            self.core.relay.fanout = 0
        self.core.log_work(self.core.trainer)
        self.core.send(peer, M.Ok(what="hello", cid=msg.cid))

    def _trainer_only(self, peer: bytes, what: str) -> bool:
        if peer != self.core.trainer_peer:
            self.core.registry.unknown(peer, what)
            return False
        return True

    def _on_SetVersion(self, peer: bytes, inst: Instance | None, msg: M.SetVersion) -> None:
        if not self._trainer_only(peer, "set-version"):
            return
        latest = self.core.lineage.latest
        same = msg.identity.same_weights(latest)
        if msg.version == latest.number and not same and not self.core.other_trainer:
            self.core.send(peer, M.Error(what="setver", cid=msg.cid, error=(
                f"version {msg.version} is current with checksum {latest.checksum:x}; the same trainer cannot "
                f"make it current again with checksum {msg.checksum:x}")))
            return
        if same:  # a resent call (its reply was lost): already in force
            if self.core.other_trainer:  # a resumed trainer confirms the restored version: journaled, so a restart
                self.core.log_work(W.Version(msg.version, latest.checksum))  # does not discard its work later
            self.core.other_trainer = False
            self.core.send(peer, M.Ok(what="setver", cid=msg.cid))
            return
        # a trainer resumed from a checkpoint of another version (another number, or the same number with other
        # weights: another checksum): the restored work is not its own, and its version rules (it may be older than
        # the restored one, and than versions live instances hold: those are of no lineage it continues)
        resumed, self.core.other_trainer = self.core.other_trainer, False
        if resumed and discard_stale(self.core):
            log.warning("the resumed trainer's version %d (checksum %x) is not the restored %d (checksum %x): the "
                        "restored unfinished responses are discarded", msg.version, msg.checksum, latest.number,
                        latest.checksum)
        # (k = 0: every unfinished response; k ≥ 1: those whose window the new version leaves)
        k = self.core.settings.max_staleness
        unfinished = [r for r in self.core.book.unfinished() if r.version < msg.version - k]
        if unfinished:
            self.core.send(peer, M.Error(what="setver", cid=msg.cid, error=(
                f"{len(unfinished)} responses of version {unfinished[0].version} are unfinished; the version "
                "changes only between steps (in-flight work is never discarded)" if not k else
                f"{len(unfinished)} responses admitting versions from {unfinished[0].version} are unfinished; "
                f"version {msg.version} would make them older than max_staleness = {k}")))
            return
        if msg.version < self.core.lineage.latest.number and not resumed:
            self.core.send(peer, M.Error(what="setver", cid=msg.cid,
                                         error=f"version {msg.version} < latest {self.core.lineage.latest.number}"))
            return
        self.core.step_account.close(self.core.clock(), self.core.activity.take(self.core.clock()))
        self.core.lineage.make_current(msg.identity)  # (the latest with it)
        self.core.log_work(W.Version(msg.version, msg.checksum))
        if self.core.settings.max_staleness and not self.core.seeding_open:
            # the trained step is over: the next one's seeding starts now. A submit opens it too, but the run's
            # last k steps were all submitted ahead: without this their steps stayed "ahead" of the one trained,
            # the reserved engine never took them, and with no preemptible instance the step waited for its timeout
            self.core.seeding_open = True
            self.core.log_work(W.Seeding(True, self.core.train_step))
        for i in self.core.fleet.values():  # an instance holding the old version is pulling from now on
            if i.state != S.GONE:
                self.core.note_activity(i)
        self.core.relay.reset()
        self.core.version_serving.set_version(msg.version, self.core.clock(), [
            i.key for i in self.core.fleet.live() if i.kind == "preemptible" and i.state != S.DRAINING])
        if self.core.on_version is not None:  # the journal records it durably before anyone acts on it
            self.core.on_version(msg.version)
        for i in self.core.fleet.live():
            if i.state in (S.READY, S.PULLING, S.FENCED):
                self.core.registry.new_version(i)
        self.core.send(peer, M.Ok(what="setver", cid=msg.cid))

    def _on_SubmitStep(self, peer: bytes, inst: Instance | None, msg: M.SubmitStep) -> None:
        if not self._trainer_only(peer, "submit"):
            return
        # msg.version: the version that will train the step; k ≥ 1 admits steps up to k versions ahead
        latest, k = self.core.lineage.latest.number, self.core.settings.max_staleness
        if not latest <= msg.version <= latest + k:
            self.core.send(peer, M.Error(what="submit", cid=msg.cid, error=(
                f"step {msg.step} asks version {msg.version}, latest is {latest}"
                + (f" (max_staleness = {k})" if k else ""))))
            return
        if msg.groups and all(
                g.gid in self.core.book.groups and self.core.book.groups[g.gid].step == msg.step
                and self.core.book.requests[self.core.book.groups[g.gid].rids[0]].prompt_ids == list(g.prompt_ids)
                for g in msg.groups):
            self.core.send(peer, M.Ok(what="submit", cid=msg.cid))  # a resent call: the step is already submitted
            return
        if not self.core.environment and any(g.max_turns > 1 for g in msg.groups):
            self.core.send(peer, M.Error(what="submit", cid=msg.cid, error="multi-turn groups need an environment "
                                                                           "(the manager was started without one)"))
            return
        new = [(g.gid, f"{g.gid}/{i}") for g in msg.groups for i in range(g.n)]
        book = self.core.book
        dup = next((rid for gid, rid in new if rid in book.requests and not book.groups[gid].delivered), None)
        if dup is None and len({rid for _, rid in new}) < len(new):  # (twice in this call)
            dup = next(rid for _, rid in new if sum(r == rid for _, r in new) > 1)
        if dup is not None:
            self.core.send(peer, M.Error(what="submit", cid=msg.cid, error=f"duplicate request id {dup}"))
            return
        self.begin_step(msg.step, msg.version, msg.groups)
        if self.core.worklog is not None:  # the last step is over: its records give way to a snapshot (compaction)
            latest = self.core.lineage.latest
            self.core.worklog[:] = [W.Compact(), self.core.trainer, W.Version(latest.number, latest.checksum),
                                    *(r for i in self.core.fleet.values() if i.state != S.GONE for r in (
                                        W.Joined(i.key, i.peer, i.kind, i.max_batch, i.engine, i.relay_endpoint),
                                        *((W.Silent(i.key, True),) if i.state == S.SUSPECT else ()))),
                                    W.Counters(self.core.counters), W.Seeding(False, self.core.train_step),
                                    *(W.Evaluated(when, r) for when, r in self.core.heldout.items()),
                                    *self._steps_in_flight(msg.step),
                                    W.Submit(msg.step, msg.version, list(msg.groups))]
            if self.core.settings.max_staleness:
                self.core.since_compact.append(self.core.worklog[-1])
        self.core.send(peer, M.Ok(what="submit", cid=msg.cid))

    def _steps_in_flight(self, step: int) -> list[W.Record]:
        """Bounded staleness: the work-log records of the steps other than ``step`` that are not delivered yet (their
        submission and everything journaled for their responses since the last compaction), so that compaction
        keeps them; [] under strict on-policy (only one step is ever in flight)."""
        kept = self.core.since_compact
        self.core.since_compact = []
        if not self.core.settings.max_staleness:
            return []
        live = {gid for gid, g in self.core.book.groups.items() if not g.delivered and g.step != step}
        out: list[W.Record] = []
        for rec in kept:
            if isinstance(rec, W.Submit):
                groups = [g for g in rec.groups if g.gid in live]
                if groups:
                    out.append(W.Submit(rec.step, rec.version, groups))
            elif isinstance(rec, W.Frame):
                if any(r.partition("/")[0] in live for r in M.decode(rec.data).rids):
                    out.append(rec)
            elif isinstance(rec, (W.Finished, W.ToolCall, W.Observation, W.Migrated)):
                if rec.rid.partition("/")[0] in live:
                    out.append(rec)
        self.core.since_compact = list(out)
        return out

    def begin_step(self, step: int, version: int, groups: list[M.GroupSpec]) -> None:
        """Forget the delivered groups of earlier steps, open seeding and queue ``groups`` of ``step`` (trained by
        weight ``version``; its responses admit versions from ``version − max_staleness``): a submitted step, or one
        rebuilt from the work log."""
        self.core.book.open_step(step, version - self.core.settings.max_staleness, groups)
        self.core.step, self.core.seeding_open, self.core.failed_step = max(self.core.step, step), True, None

    def _on_CloseSeeding(self, peer: bytes, inst: Instance | None, msg: M.CloseSeeding) -> None:
        if not self._trainer_only(peer, "close-seeding"):
            return
        self.core.seeding_open, self.core.train_step = False, msg.step
        self.core.log_work(W.Seeding(False, msg.step))
        remote = any(i.kind == "preemptible" and self.core.routable(i) for i in self.core.fleet.values())
        released = self.release_reserved() if remote else 0
        if not remote:  # the reserved engine keeps generating until remote capacity appears (end_fallback)
            self.core.step_account.open_fallback(self.core.clock())
            self.end_fallback(self.core.clock())
        self.core.send(peer, M.Ok(what=f"closeseed released={released} remote={int(remote)}", cid=msg.cid))

    def release_reserved(self) -> int:
        """Seeding is over and remote capacity serves: the reserved engines hand their unfinished responses back
        (``Release``; they continue on preemptible instances, tokens kept). Called when seeding closes with remote
        capacity, and when the first preemptible instance becomes ready during a co-located fallback — so the
        remote pool takes over the step's remaining work, as the simulator's fallback does. Returns the responses
        released."""
        released = 0
        for i in self.core.fleet.values():
            if i.kind == "reserved" and i.state == S.READY and i.inflight:
                rids = sorted(i.inflight - i.releasing)
                i.releasing |= set(rids)
                released += len(rids)
                self.core.send(i.peer, M.Release(rids=rids))
        return released

    def _on_PolicyState(self, peer: bytes, inst: Instance | None, msg: M.PolicyState) -> None:
        if self._trainer_only(peer, "policy-state"):
            self.core.policy_decision = msg

    def _on_StepTimes(self, peer: bytes, inst: Instance | None, msg: M.StepTimes) -> None:
        if self._trainer_only(peer, "step-times"):
            self.core.dist.step_seconds.observe(msg.wall_s)
            self.core.step_account.step_times(msg)

    def _on_Evaluation(self, peer: bytes, inst: Instance | None, msg: M.Evaluation) -> None:
        if self._trainer_only(peer, "evaluation"):
            self.core.heldout[msg.when] = msg.result
            self.core.log_work(W.Evaluated(msg.when, msg.result))

    def _on_AckGroup(self, peer: bytes, inst: Instance | None, msg: M.AckGroup) -> None:
        if self._trainer_only(peer, "ack"):
            grp = self.core.book.groups.get(msg.gid)
            if grp is not None and not grp.delivered:
                grp.delivered = True
                self.core.log_work(W.Acked(msg.gid))

    def _on_GetStats(self, peer: bytes, inst: Instance | None, msg: M.GetStats) -> None:
        self.core.send(peer, M.Stats(stats=self.core.stats(), cid=msg.cid))

    def _on_Redeliver(self, peer: bytes, inst: Instance | None, msg: M.Redeliver) -> None:
        if self._trainer_only(peer, "redeliver"):
            for grp in self.core.book.ready_to_deliver():
                self._deliver(grp)
                self.core.counters.groups_redelivered += 1

    # ------------------------------------------------------------------ progress
    def group_progress(self, req: Request) -> None:
        grp = self.core.book.group_done(req)
        if grp.done < len(grp.rids):
            return
        if grp.step == self.core.step and self.core.book.step_rolled_out(self.core.step):
            self.core.step_account.rollout_done(self.core.clock())
        if self.core.trainer_peer is None:
            return
        self._deliver(grp)
        self.core.counters.groups_delivered += 1
        self.core.counters.responses_delivered += len(grp.rids)

    def _deliver(self, grp: Group) -> None:
        """Send a finished group to the trainer (again, when it asks: it acknowledges what it took)."""
        responses = []
        for rid in grp.rids:
            r = self.core.book.requests[rid]
            # the versions the engines stamped (checked per delta above, and again by the trainer)
            responses.append(M.Response(
                rid=rid, sample=r.sample, ids=bytes(r.ids), logprobs=bytes(r.logprobs),
                version_runs=np.array(r.runs, dtype="<i4").tobytes(), finish_reason=r.finish_reason,
                migrations=r.migrations, instances=r.instances,
                observation_runs=np.array(r.observations, dtype="<i4").tobytes(), turns=r.turn + 1,
                env_return=sum(r.env_rewards), env_error=r.env_error))
        self.core.send(self.core.trainer_peer, M.GroupDone(step=grp.step, gid=grp.gid, responses=responses))

    def end_fallback(self, now: float) -> None:
        """End the step's co-located fallback (seeding closed with no remote capacity) once a preemptible instance
        is pulling or ready — remote capacity, as the simulator defines it (the rollout's end and the version's change
        end it too: :class:`StepAccount`); its seconds add to the step's."""
        if self.core.step_account.fallback_since is None:
            return
        if any(i.kind == "preemptible" and i.state in (S.PULLING, S.READY) for i in self.core.fleet.values()):
            self.core.step_account.end_fallback(now)

    def fail_step(self, error: str) -> None:
        self.core.failed_step = error
        if self.core.trainer_peer is not None:
            self.core.send(self.core.trainer_peer, M.StepFailed(step=self.core.step, error=error))
