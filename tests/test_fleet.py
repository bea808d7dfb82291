"""The manager's fleet (manager/fleet.py) on its own: pure state, no sockets, no clock.

Its read side and write side as the core uses them; the messages that drive it are tested through the core
(tests/test_manager_core.py)."""
from __future__ import annotations

import pytest

import rlboost_hpc.manager.fleet as fleet_mod
from rlboost_hpc.manager.fleet import Fleet
from rlboost_hpc.manager.state import Instance, InstanceState as S


def _inst(key: str, peer: bytes) -> Instance:
    return Instance(key=key, peer=peer, kind="preemptible", max_batch=8, registered_at=0.0, last_seen=0.0)


def test_join_maps_the_peer_and_refuses_a_live_or_ended_identity():
    fleet = Fleet(lambda i: None)
    a = _inst("a#0", b"pa")
    fleet.join(a)
    assert fleet.get("a#0") is a and fleet.of_peer(b"pa") is a and "a#0" in fleet and len(fleet) == 1
    with pytest.raises(ValueError, match="a#0"):
        fleet.join(_inst("a#0", b"other"))
    fleet.leave(a, "preempted")
    assert fleet.has_ended("a#0") and fleet.of_peer(b"pa") is None and "a#0" not in fleet
    with pytest.raises(ValueError, match="a#0"):
        fleet.join(_inst("a#0", b"pa"))


def test_state_changes_only_along_the_state_machine_and_each_is_told_once():
    told = []
    fleet = Fleet(lambda i: told.append(i.state))
    a = _inst("a#0", b"pa")
    fleet.join(a)
    fleet.set_state(a, S.READY)
    fleet.set_state(a, S.READY)  # no change: not told
    fleet.set_state(a, S.DRAINING)
    with pytest.raises(RuntimeError, match="draining → ready"):
        fleet.set_state(a, S.READY)
    fleet.set_state(a, S.SUSPECT)
    assert told == [S.READY, S.DRAINING, S.SUSPECT] and a.state == S.SUSPECT
    assert fleet.live() == []  # a suspect is not presumed alive


def test_a_gone_attempt_leaves_the_fleet_and_only_the_last_ended_identities_are_kept(monkeypatch):
    monkeypatch.setattr(fleet_mod, "ENDED_KEPT", 3)
    told = []
    fleet = Fleet(lambda i: told.append((i.key, i.state)))
    for n in range(5):
        inst = _inst(f"j#{n}", f"p{n}".encode())
        fleet.join(inst)
        fleet.leave(inst, "drained")
        assert inst.gone_reason == "drained" and (inst.key, S.GONE) in told
    assert list(fleet.ended) == ["j#2", "j#3", "j#4"] and not fleet.instances and not fleet.by_peer
    fleet.forget("restored#0", "gone before the manager restarted")  # (crash recovery: never joined here)
    assert fleet.has_ended("restored#0") and not fleet.has_ended("j#2")


def test_a_reconnected_process_speaks_from_its_new_peer_only():
    fleet = Fleet(lambda i: None)
    a = _inst("a#0", b"old")
    fleet.join(a)
    fleet.rebind(a, b"new")
    assert fleet.of_peer(b"new") is a and fleet.of_peer(b"old") is None and a.peer == b"new"
    assert fleet.by_peer == {b"new": "a#0"}


def test_an_unknown_peer_is_told_at_most_once_a_second_and_the_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(fleet_mod, "TOLD_KEPT", 2)
    fleet = Fleet(lambda i: None)
    assert fleet.tell_unknown(b"x", 10.0) and not fleet.tell_unknown(b"x", 10.5) and fleet.tell_unknown(b"x", 11.0)
    for n in range(5):
        assert fleet.tell_unknown(f"p{n}".encode(), 12.0)
    assert fleet.tell_unknown(b"x", 11.2)  # forgotten: the memory was cleared past TOLD_KEPT peers
