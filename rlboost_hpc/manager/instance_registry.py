"""The instance-facing handlers of the rollout manager: registration (and the rejection of a live or ended
identity), heartbeats, weight loads and their failures, the relay hand-outs that follow them, silence (suspect),
recovery, fencing, draining and the end of an attempt (gone: out of the fleet, its identity kept among the last
``ENDED_KEPT``). Who is registered and in which :class:`InstanceState` is the fleet's (``manager/fleet.py``).

A collaborator held by :class:`~rlboost_hpc.manager.core.ManagerCore` as ``core.registry`` (the same single
writer, pure: no sockets, time from the core's injected clock); the invariants it keeps are the core's 7 (busy is
not dead, dead is not alive: one transition function, :meth:`Fleet.set_state`) and the weight side of 1 and 4 (an
instance is routable only once it loaded a version new work may go to, with the trainer's checksum).
"""
from __future__ import annotations

import logging

from rlboost_hpc.manager import worklog as W
from rlboost_hpc.manager.restore import take_over, unsent_tokens
from rlboost_hpc.manager.state import Instance, InstanceState
from rlboost_hpc.policy.relay import Source
from rlboost_hpc.protocol import messages as M
from rlboost_hpc.protocol.identity import instance_key

S = InstanceState

log = logging.getLogger("rlboost.manager")


#: The counter of each kind of warned end (``Deregister.cause``): one definition, shared by the report and
#: Prometheus.
_LEAVE_COUNTER = {"preempted": "instances_preempted_with_warning", "time_limit": "instances_time_limit",
                  "drained": "instances_drained", "stopped": "instances_drained"}


class InstanceRegistry:
    """The instance-facing handlers of the rollout manager (see the module docstring): a collaborator of ``core`` (a
    :class:`~rlboost_hpc.manager.core.ManagerCore`), which holds the state owners it works on — the fleet, the
    request book, the lineage, the counters — and calls it for the messages of its kind (``_on_<Message>``, found by
    the core's dispatch table). It keeps no state of its own.
    """

    def __init__(self, core) -> None:  # (a ManagerCore: not imported, it imports this module)
        self.core = core

    def state_changed(self, inst: Instance) -> None:
        """The fleet changed the state of ``inst`` (:meth:`Fleet.set_state`): its instance-seconds, and the relay
        capacity it no longer needs or gives."""
        self.core.note_activity(inst)
        if inst.state in (S.GONE, S.SUSPECT, S.FENCED, S.DRAINING):  # it neither serves nor needs relay capacity now
            self._hand_out(self.core.relay.gone(inst.key))

    def _pull_source(self, inst: Instance) -> Source:
        """Where ``inst`` fetches the latest version (relay); the trainer for reserved instances."""
        return self.core.relay.want(inst.key) if inst.kind == "preemptible" else Source()

    def new_version(self, inst: Instance) -> None:
        src, latest, hello = self._pull_source(inst), self.core.lineage.latest, self.core.trainer
        self.core.send(inst.peer, M.NewVersion(version=latest.number, checksum=latest.checksum, peers=list(src.peers),
                                               wait=src.wait, weights_endpoint=hello.weights_endpoint,
                                               weights_shards=hello.weights_shards))

    def _hand_out(self, handed: list[tuple[str, Source]]) -> None:
        latest = self.core.lineage.latest
        for key, src in handed:
            i = self.core.fleet.get(key)
            if i is not None:
                self.core.send(i.peer, M.PullFrom(version=latest.number, checksum=latest.checksum,
                                                  peers=list(src.peers)))

    def suspect(self, inst: Instance, reason: str) -> None:
        """Invariant 7: out of routing now, its unfinished responses migrate; it may come back."""
        if inst.state in (S.SUSPECT, S.GONE):
            return
        taken = list(inst.inflight)
        self.core.counters.responses_assigned_to_vanished += sum(
            1 for rid in taken if (r := self.core.book.get(rid)) is not None and r.assigned_at > inst.last_seen)
        for rid in taken:
            self.core.table.requeue(rid, inst, reason)
        inst.taken_back.update(taken)
        unsent = unsent_tokens(inst)
        self.core.counters.tokens_regenerated += unsent
        self.core.counters.instances_suspected += 1
        if inst.state == S.PULLING and inst.kind == "preemptible":
            self.core.counters.suspected_while_pulling += 1
        inst.suspect_from, inst.suspect_since = inst.state, self.core.clock()
        self.core.fleet.set_state(inst, S.SUSPECT)
        self.core.log_work(W.Silent(inst.key, True))
        log.info("instance %s suspect (%s); %d responses migrated, %d unsent tokens", inst.key, reason,
                 len(taken), unsent)

    def recover(self, inst: Instance) -> None:
        """A suspect spoke again under its identity: back where it was, without re-registering."""
        self.core.log_work(W.Silent(inst.key, False))
        back = inst.suspect_from or S.PULLING
        if back in (S.DRAINING, S.FENCED):
            new = back
        elif self.core.holds_latest(inst):
            new = S.READY
        else:
            new = S.PULLING
        self.core.fleet.set_state(inst, new)
        if new == S.PULLING:
            self.new_version(inst)
        self.core.counters.instances_recovered += 1
        if back == S.PULLING and inst.kind == "preemptible":
            self.core.counters.recovered_while_pulling += 1
        # Whatever it still generates for what was taken from it (now, or in an earlier silence whose Release may
        # have been lost with a connection) was resumed elsewhere: none of it is dispatched to it again until it
        # confirms (Released); the Release goes out again for all of it.
        inst.releasing |= inst.taken_back
        inst.taken_back.clear()
        if inst.releasing:
            self.core.send(inst.peer, M.Release(rids=sorted(inst.releasing)))
        log.info("instance %s answers again after %.1f s suspect; now %s", inst.key,
                 self.core.clock() - inst.suspect_since, new)

    def instance_gone(self, inst: Instance, reason: str, *, cause: str | None) -> None:
        """Remove ``inst`` for good: it deregistered (``cause``: its :data:`M.LeaveCause`), or a suspect expired
        (``cause=None``); unfinished responses resume elsewhere. A suspect's work and unsent tokens were
        accounted when it went silent."""
        if inst.state == S.GONE:
            return
        unsent = 0
        if inst.state != S.SUSPECT:
            for rid in list(inst.inflight):
                self.core.table.requeue(rid, inst, reason)
            unsent = unsent_tokens(inst)
            self.core.counters.tokens_regenerated += unsent
        if cause is not None:  # it deregistered: a warned end, counted by its kind
            self.core.counters.tokens_regenerated_after_warning += unsent
            field = _LEAVE_COUNTER[cause]
            setattr(self.core.counters, field, getattr(self.core.counters, field) + 1)
        else:
            self.core.counters.instances_expired += 1
        # A gone attempt leaves the fleet, so that nothing a week-long run does per tick or per dispatch grows with
        # the attempts that ever ran; its identity is remembered (bounded) so it can never register again.
        self.core.fleet.leave(inst, reason)
        self.core.activity.forget(inst.key)
        self.core.log_work(W.Left(inst.key))
        log.info("instance %s gone (%s); %d unsent tokens", inst.key, reason, unsent)

    def fence(self, inst: Instance, reason: str) -> None:
        """Stop routing to ``inst`` and take its work back; it may recover only by loading the latest version."""
        if inst.state in (S.GONE, S.FENCED, S.SUSPECT):
            return
        taken = sorted(inst.inflight)
        for rid in taken:
            self.core.table.requeue(rid, inst, reason)
        inst.releasing.update(taken)  # not given back to it before it confirmed the Release below
        self.core.fleet.set_state(inst, S.FENCED)
        self.core.counters.instances_fenced += 1
        log.warning("instance %s fenced: %s", inst.key, reason)
        if taken:  # tell it to stop working on them; whatever it still sends is dropped as late
            self.core.send(inst.peer, M.Release(rids=taken))

    # agent messages ------------------------------------------------------------
    def _on_Register(self, peer: bytes, inst: Instance | None, msg: M.Register) -> None:
        key = instance_key(msg.job_id, msg.attempt)
        existing = self.core.fleet.get(key)
        if existing is not None and existing.peer != peer and not existing.spoke:  # its process, a new connection
            take_over(self.core, existing, peer)
        if existing is not None and existing.peer == peer:
            pass  # a retried Register from the same identity (a reconnect keeps it): answer again
        elif existing is not None or self.core.fleet.has_ended(key):
            self.core.counters.rejected_registrations += 1
            why = ("identity %s is already registered (live)" if existing is not None
                   else "identity %s belongs to an attempt that already ended; a requeued job must register "
                        "with a new attempt number")
            self.core.send(peer, M.Reject(reason=why % key))
            log.warning("rejected registration of %s from %r", key, peer)
            return
        else:
            now = self.core.clock()
            existing = Instance(key=key, peer=peer, kind=msg.kind, max_batch=msg.max_batch, registered_at=now,
                                last_seen=now, engine=msg.engine, relay_endpoint=msg.relay_endpoint)
            self.core.fleet.join(existing)
            self.core.log_work(W.Joined(key, peer, msg.kind, msg.max_batch, msg.engine, msg.relay_endpoint))
            self.core.counters.registrations += 1
            self.core.note_activity(existing)
        inst = existing
        s, hello, latest = self.core.settings, self.core.trainer, self.core.lineage.latest
        src = self._pull_source(inst) if latest.number >= 0 and not self.core.holds_latest(inst) else Source()
        self.core.send(peer, M.Welcome(
            instance=key, latest_version=latest.number, weights_endpoint=hello.weights_endpoint,
            model_config=hello.model_config, model_arch=hello.model_arch, heartbeat_s=s.heartbeat_s,
            stream_every_tokens=s.stream_every_tokens, stream_every_s=s.stream_every_s, epoch=self.core.epoch,
            peers=list(src.peers), wait=src.wait, weights_shards=hello.weights_shards,
            latest_checksum=latest.checksum, resend=inst.restored, on_new_version=s.on_new_version,
            adapter=hello.adapter))

    def unknown(self, peer: bytes, what: str) -> None:
        """A message from a peer that is not (or no longer) a registered instance: drop it and tell the peer
        once a second, so an instance declared lost (e.g. starved of CPU past the heartbeat deadline) learns it
        and re-registers as a new attempt instead of talking into the void."""
        self.core.counters.protocol_rejects += 1
        if self.core.fleet.tell_unknown(peer, self.core.clock()):
            log.warning("%s from unregistered peer %r dropped", what, peer)
            if peer != self.core.trainer_peer:
                self.core.send(peer, M.Reject(reason=f"unknown instance ({what} from a peer that is not registered: "
                                                     "declared lost or never registered); register as a new attempt"))

    def _on_Heartbeat(self, peer: bytes, inst: Instance | None, msg: M.Heartbeat) -> None:
        if inst is None:
            return self.unknown(peer, "heartbeat")
        inst.tokens_generated = max(inst.tokens_generated, msg.tokens_generated)
        modelled, late = inst.emulated_s
        if msg.modelled_s > modelled or msg.late_s > late:  # an emulated engine's timing: what is new since
            if not inst.restored or modelled or late:  # (a restored instance's first figures: an earlier manager's)
                self.core.counters.emulated_modelled_seconds += max(0.0, msg.modelled_s - modelled)
                self.core.counters.emulated_late_seconds += max(0.0, msg.late_s - late)
            inst.emulated_s = (max(modelled, msg.modelled_s), max(late, msg.late_s))

    def _on_WeightsLoaded(self, peer: bytes, inst: Instance | None, msg: M.WeightsLoaded) -> None:
        if inst is None:
            return self.unknown(peer, "weights-loaded")
        self.core.counters.weight_loads += 1
        if msg.load_s > self.core.settings.heartbeat_timeout_s:
            self.core.counters.slow_weight_loads += 1  # longer than the deadline: it had to keep heartbeating
        self.core.dist.pull_seconds.observe(msg.pull_s)
        if msg.wire_bytes >= msg.nbytes > 0:
            self.core.dist.full_pull_seconds.observe(msg.pull_s)
        self.core.counters.weight_pulled_bytes += msg.wire_bytes + msg.base_wire_bytes
        if msg.base_source:
            self._count_base(msg)
        latest = self.core.lineage.latest
        if msg.version == latest.number and latest.checksum and msg.checksum != latest.checksum:
            # bytes other than the trainer's export: never routable; it is asked to leave (a replacement pulls anew)
            self.core.counters.weight_checksum_mismatches += 1
            self.core.counters.weight_load_failures += 1
            reason = (f"loaded version {msg.version} with checksum {msg.checksum:x}, the trainer published "
                      f"{latest.checksum:x}")
            self.fence(inst, reason)
            self.core.send(inst.peer, M.Drain(reason=reason))
            return
        inst.version, inst.checksum = msg.version, msg.checksum
        of_lineage = self.core.lineage.holds(msg.identity)
        if not of_lineage:  # a version the current trainer never made (a pull begun before a resume): not routable
            self.core.counters.weight_loads_of_another_lineage += 1
            log.info("instance %s loaded version %d (checksum %x), not of the current lineage (latest %d, checksum "
                     "%x): it is not routed to", inst.key, msg.version, msg.checksum, self.core.lineage.latest.number,
                     self.core.lineage.latest.checksum)
        self.core.version_serving.reported.add(inst.key)  # not about to load the latest any more (manager/assign.py)
        delay = self.core.version_serving.loaded(inst.key, msg.version, self.core.clock()) if of_lineage else None
        if delay is not None:
            self.core.dist.version_serving_seconds.observe(delay)
        self.core.note_activity(inst)
        if self.core.holds_latest(inst) and inst.kind == "preemptible":  # it holds it: it serves it too
            self._hand_out(self.core.relay.done(inst.key, inst.relay_endpoint))
        if inst.state in (S.PULLING, S.FENCED) and of_lineage:  # (of the lineage: within its window of versions)
            self.core.fleet.set_state(inst, S.READY)
            inst.ready_at = inst.ready_at or self.core.clock()
            if inst.kind == "preemptible" and not self.core.seeding_open:  # the end of a co-located fallback
                self.core.trainer_calls.release_reserved()

    def _count_base(self, msg: M.WeightsLoaded) -> None:
        """A LoRA instance's base load: counted by source (an unknown source is counted as a pull)."""
        c = self.core.counters
        field = {"path": "base_loads_from_path", "cache": "base_loads_from_cache",
                 "trainer": "base_loads_in_trainer"}.get(msg.base_source, "base_loads_pulled")
        setattr(c, field, getattr(c, field) + 1)
        c.base_pulled_bytes += msg.base_wire_bytes

    def _on_WeightsFailed(self, peer: bytes, inst: Instance | None, msg: M.WeightsFailed) -> None:
        if inst is None:
            return self.unknown(peer, "weights-failed")
        self.core.counters.weight_load_failures += 1
        log.warning("instance %s failed to load version %d: %s", inst.key, msg.version, msg.error)
        if inst.state == S.READY:
            self.fence(inst, f"weight load failed: {msg.error}")
        elif inst.state == S.PULLING:
            self.core.fleet.set_state(inst, S.FENCED)
            self.core.counters.instances_fenced += 1

    def _on_Draining(self, peer: bytes, inst: Instance | None, msg: M.Draining) -> None:
        if inst is None:
            return self.unknown(peer, "draining")
        if inst.state != S.GONE:
            self.core.fleet.set_state(inst, S.DRAINING)

    def _on_Deregister(self, peer: bytes, inst: Instance | None, msg: M.Deregister) -> None:
        if inst is None:
            return self.unknown(peer, "deregister")
        inst.tokens_generated = max(inst.tokens_generated, msg.tokens_generated)
        self.instance_gone(inst, f"deregistered: {msg.reason}", cause=msg.cause)
        self.core.send(peer, M.Farewell())  # (the service holds it until the work log's commit holds the Deregister)

