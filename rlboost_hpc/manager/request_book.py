"""The manager's book of responses: every response of the steps in flight, their GRPO groups, and the queue of those
waiting for an instance.

A collaborator of :class:`~rlboost_hpc.manager.core.ManagerCore` that owns this state (as the
:class:`~rlboost_hpc.manager.fleet.Fleet` owns the instances): a read side — :meth:`RequestBook.get`,
:meth:`~RequestBook.unfinished`, :meth:`~RequestBook.step_rolled_out`, :meth:`~RequestBook.ready_to_deliver` —
and a write side — :meth:`~RequestBook.open_step` (a step's groups queued at the tail, the delivered groups of
earlier steps forgotten), :meth:`~RequestBook.first_in_line` (a migrated response, a trajectory's next turn: at the
head), :meth:`~RequestBook.last_in_line`, :meth:`~RequestBook.group_done`, :meth:`~RequestBook.clear`. Dispatch
(``manager/assign.py``) takes from the head of :attr:`~RequestBook.queue`. Pure: no sockets, no clock; what a
response's tokens, turns and finish mean is the request table's (``manager/request_table.py``).
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

from rlboost_hpc.manager.state import Group, Request, RequestState, step_requests
from rlboost_hpc.protocol import messages as M

R = RequestState


class RequestBook:
    """Responses by id (``requests``), GRPO groups by id (``groups``) and the queue of response ids waiting for an
    instance (``queue``; see the module docstring).

    Invariants: every queued id is a response in the book; a group's responses are in the book until the group is
    delivered and a later step opens; a response is in ``queue`` at most once while it is ``QUEUED`` (dispatch skips
    any other id it finds there).
    """

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, Group] = {}
        self.queue: deque[str] = deque()

    # ------------------------------------------------------------------ read side
    def get(self, rid: str) -> Request | None:
        return self.requests.get(rid)

    def __len__(self) -> int:
        return len(self.requests)

    def unfinished(self) -> Iterator[Request]:
        """Every response that is not done (queued, running or waiting for its environment)."""
        return (r for r in self.requests.values() if r.state != R.DONE)

    def step_rolled_out(self, step: int) -> bool:
        """Every response of every group of ``step`` is done (False when the book holds no group of it)."""
        groups = [g for g in self.groups.values() if g.step == step]
        return bool(groups) and all(g.done >= len(g.rids) for g in groups)

    def ready_to_deliver(self) -> list[Group]:
        """The finished groups the trainer has not acknowledged."""
        return [g for g in self.groups.values() if g.done == len(g.rids) and not g.delivered]

    # ------------------------------------------------------------------ write side
    def open_step(self, step: int, lowest_version: int, specs: list[M.GroupSpec]) -> None:
        """Forget the delivered groups (and their responses) of earlier steps; add the groups ``specs`` of ``step``,
        their responses admitting versions from ``lowest_version``, queued at the tail in group order."""
        for gid in [g for g, grp in self.groups.items() if grp.delivered]:
            for rid in self.groups.pop(gid).rids:
                self.requests.pop(rid, None)
        for g in specs:
            reqs = step_requests(step, lowest_version, g)
            for r in reqs:
                self.requests[r.rid] = r
                self.queue.append(r.rid)
            self.groups[g.gid] = Group(step=step, gid=g.gid, rids=[r.rid for r in reqs])

    def first_in_line(self, req: Request) -> None:
        """``req`` waits for an instance again, before everything queued (a migration, a trajectory's next turn: the
        tail of its step goes first)."""
        req.move(R.QUEUED)
        self.queue.appendleft(req.rid)

    def last_in_line(self, req: Request) -> None:
        """``req`` (queued) waits for an instance after everything queued (held responses released in step order
        after a manager restart)."""
        self.queue.append(req.rid)

    def group_done(self, req: Request) -> Group:
        """``req`` finished: counted in its group, which is returned."""
        grp = self.groups[req.gid]
        grp.done += 1
        return grp

    def clear(self) -> None:
        """Forget every response, group and queued id (a new trainer lineage: nothing restored is its)."""
        self.requests.clear()
        self.groups.clear()
        self.queue.clear()
