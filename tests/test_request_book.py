"""The manager's request book (manager/request_book.py) on its own: pure state, no sockets, no clock.

The messages that drive it (submissions, token deltas, migrations, acknowledgements) are tested through the core
(tests/test_manager_core.py, tests/test_manager_restart.py)."""
from __future__ import annotations

from rlboost_hpc.manager.request_book import RequestBook
from rlboost_hpc.manager.state import RequestState as R
from rlboost_hpc.protocol import messages as M


def _spec(gid: str, n: int = 2) -> M.GroupSpec:
    return M.GroupSpec(gid=gid, prompt_ids=[1, 2], n=n, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=7,
                       stop_ids=[0])


def test_a_step_opens_its_groups_queued_in_order_with_the_window_of_versions_it_admits():
    book = RequestBook()
    book.open_step(3, 1, [_spec("g0"), _spec("g1")])
    assert list(book.queue) == ["g0/0", "g0/1", "g1/0", "g1/1"] and len(book) == 4
    req = book.get("g1/1")
    assert req.step == 3 and req.version == 1 and req.seed == 8 and req.state == R.QUEUED
    assert book.groups["g1"].rids == ["g1/0", "g1/1"] and not book.step_rolled_out(3)


def test_a_migrated_response_goes_first_and_a_released_held_one_last():
    book = RequestBook()
    book.open_step(0, 0, [_spec("g0")])
    req = book.get(book.queue.popleft())
    req.move(R.RUNNING, "a#0")
    book.first_in_line(req)
    assert req.state == R.QUEUED and list(book.queue) == ["g0/0", "g0/1"]
    book.queue.clear()
    book.last_in_line(book.get("g0/1"))
    book.last_in_line(req)
    assert list(book.queue) == ["g0/1", "g0/0"]


def test_a_step_is_rolled_out_when_every_group_is_done_and_delivered_groups_go_at_the_next_step():
    book = RequestBook()
    book.open_step(0, 0, [_spec("a", n=1), _spec("b", n=1)])
    for rid in ("a/0", "b/0"):
        req = book.get(rid)
        req.move(R.RUNNING, "i#0")
        req.move(R.DONE, finish_reason="stop")
        book.group_done(req)
    assert book.step_rolled_out(0) and not book.step_rolled_out(1) and not list(book.unfinished())
    assert [g.gid for g in book.ready_to_deliver()] == ["a", "b"]
    book.groups["a"].delivered = True  # (the trainer acknowledged it)
    assert [g.gid for g in book.ready_to_deliver()] == ["b"]
    book.open_step(1, 1, [_spec("c", n=1)])
    assert set(book.groups) == {"b", "c"} and book.get("a/0") is None and book.get("b/0") is not None
    book.clear()
    assert not book.groups and not book.queue and len(book) == 0
