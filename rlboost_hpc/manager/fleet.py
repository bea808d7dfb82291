"""The manager's fleet of rollout instances: every attempt that is not gone, which connection speaks as which, the
identities of the attempts that ended, and the one transition function of an instance's state.

A collaborator of :class:`~rlboost_hpc.manager.core.ManagerCore` that owns this state (a machine that owns its
state, as NeMo-RL's ``fleet_health.py``): a read side — :meth:`Fleet.get`, :meth:`~Fleet.of_peer`,
:meth:`~Fleet.values`, :meth:`~Fleet.live`, :meth:`~Fleet.has_ended` — and a write side — :meth:`~Fleet.join`,
:meth:`~Fleet.rebind`, :meth:`~Fleet.set_state`, :meth:`~Fleet.leave`, :meth:`~Fleet.forget`. Pure: no sockets, no
clock (times come in as arguments); what a change of state means elsewhere (the instance-seconds, the relay's
capacity) is its owner's, told through ``on_state``. The messages that drive it (registration, heartbeats, loads,
silence, fencing, deregistration) are handled by the core (``manager/instance_registry.py``).
"""
from __future__ import annotations

from typing import Callable, Iterable

from rlboost_hpc.manager.state import ALLOWED_TRANSITIONS, Instance, InstanceState

S = InstanceState

#: Identities of ended attempts the manager remembers (≈ 150 bytes each), to reject their re-registration: the
#: oldest is forgotten first. A requeued job registers under a new attempt number, so only a process stopped for
#: longer than this many other attempts took to end could ever register under a forgotten identity.
ENDED_KEPT = 100_000

#: Peers told "unknown instance" the fleet remembers (to tell each at most once a second); cleared past it.
TOLD_KEPT = 10_000


class Fleet:
    """The registered instances (see the module docstring). ``on_state(inst)`` is called after every change of an
    instance's state (:meth:`set_state`, :meth:`leave`).

    Invariants: ``by_peer`` maps exactly the peers of ``instances`` (one connection speaks as one instance); a gone
    attempt is never in ``instances`` and its identity is in ``ended`` (the last :data:`ENDED_KEPT`), so nothing
    scanned per tick or per dispatch grows with the attempts that ever ran.
    """

    def __init__(self, on_state: Callable[[Instance], None]) -> None:
        self.instances: dict[str, Instance] = {}  # every instance not gone: what liveness and dispatch scan
        self.by_peer: dict[bytes, str] = {}
        self.ended: dict[str, str] = {}  # identity → why, of the last ENDED_KEPT attempts that are gone
        self._told_unknown: dict[bytes, float] = {}  # peer → when it was last told it is unknown (seconds)
        self._on_state = on_state

    # ------------------------------------------------------------------ read side
    def get(self, key: str) -> Instance | None:
        return self.instances.get(key)

    def of_peer(self, peer: bytes) -> Instance | None:
        """The instance ``peer`` speaks as (None: not, or no longer, a registered instance)."""
        key = self.by_peer.get(peer)
        return self.instances.get(key) if key else None

    def values(self) -> Iterable[Instance]:
        return self.instances.values()

    def __len__(self) -> int:
        return len(self.instances)

    def __contains__(self, key: str) -> bool:
        return key in self.instances

    def live(self) -> list[Instance]:
        """Instances that still talk to the manager (a suspect is not presumed alive)."""
        return [i for i in self.instances.values() if i.state not in (S.GONE, S.SUSPECT)]

    def has_ended(self, key: str) -> bool:
        """``key`` is the identity of an attempt that ended (it may never register again)."""
        return key in self.ended

    # ------------------------------------------------------------------ write side
    def join(self, inst: Instance) -> None:
        """Register ``inst`` (a new identity: neither live nor ended).

        Raises:
            ValueError: ``inst.key`` is registered or ended (the caller rejects such a registration first).
        """
        if inst.key in self.instances or inst.key in self.ended:
            raise ValueError(f"instance {inst.key} is already registered or ended")
        self.instances[inst.key] = inst
        self.by_peer[inst.peer] = inst.key

    def rebind(self, inst: Instance, peer: bytes) -> None:
        """``inst`` speaks from the connection ``peer`` from now on (its process reconnected)."""
        self.by_peer.pop(inst.peer, None)
        inst.peer = peer
        self.by_peer[peer] = inst.key

    def set_state(self, inst: Instance, new: InstanceState) -> None:
        """The one place an instance's state changes (transitions in ``ALLOWED_TRANSITIONS``).

        Raises:
            RuntimeError: a transition the state machine does not have (a manager bug, never the peer's input).
        """
        if new == inst.state:
            return
        if new not in ALLOWED_TRANSITIONS[inst.state]:
            raise RuntimeError(f"instance {inst.key}: no transition {inst.state} → {new}")
        inst.state = new
        self._on_state(inst)

    def leave(self, inst: Instance, reason: str) -> None:
        """``inst`` is gone for good: out of the fleet, its identity kept among the last :data:`ENDED_KEPT`."""
        self.set_state(inst, S.GONE)
        inst.gone_reason = reason
        self.forget(inst.key, reason)

    def forget(self, key: str, reason: str) -> None:
        """The attempt ``key`` ended (``reason``): out of the fleet if it is in it (crash recovery replays a
        ``Left`` without a transition), remembered as ended."""
        inst = self.instances.pop(key, None)
        if inst is not None and self.by_peer.get(inst.peer) == key:
            del self.by_peer[inst.peer]
        self.ended[key] = reason
        if len(self.ended) > ENDED_KEPT:
            del self.ended[next(iter(self.ended))]

    def tell_unknown(self, peer: bytes, now: float) -> bool:
        """Whether to tell ``peer`` (not a registered instance) that it is unknown now, ``now`` in seconds: at most
        once a second per peer (the memory of whom was told is bounded by :data:`TOLD_KEPT`)."""
        if now - self._told_unknown.get(peer, -1e9) < 1.0:
            return False
        if len(self._told_unknown) > TOLD_KEPT:
            self._told_unknown.clear()
        self._told_unknown[peer] = now
        return True
