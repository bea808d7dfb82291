"""Rewards in a persistent pool of worker processes, each answer under a deadline.

A reward is user-level code on model output (math-verify runs SymPy on whatever the policy wrote): one answer can
take unbounded time — ``answers_match("18", "(x+1)^{9999}")`` does not return within 25 s — and, run inline, it
would stall the trainer's step forever. Here:

* ``workers`` processes (``spawn``: no inherited threads or CUDA state) each hold a copy of the task and score
  answers one at a time; they persist across steps (no start-up cost per answer).
* Every answer has a deadline of ``timeout_s`` seconds from when a worker took it. A worker past its deadline is
  killed (SIGKILL: SymPy cannot be interrupted cooperatively) and replaced; the answer scores 0.0 and is counted
  in :attr:`RewardPool.timed_out`. A worker that dies otherwise is replaced and its answer re-scored once on
  another worker (then 0.0 and counted in :attr:`failed`).
* Results come back in input order; the pool is deterministic given deterministic rewards (a timed-out answer is
  0.0 whatever the machine's load, as long as the deadline is larger than honest answers need).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

log = logging.getLogger("rlboost.reward")


def _worker(task: Any, conn: Connection) -> None:  # pragma: no cover - runs in the child
    """Score ``(index, prompt, text)`` messages until the pipe closes; reply ``(index, reward)``."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C
    while True:
        try:
            idx, prompt, text = conn.recv()
        except (EOFError, OSError):
            return
        try:
            r = float(task.reward(prompt, text))
        except Exception:  # noqa: BLE001 - a reward never raises on model output; be safe anyway
            r = 0.0
        conn.send((idx, r))


class _Slot:
    def __init__(self, ctx, task) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(task, child), daemon=True, name="rlboost-reward")
        self.proc.start()
        child.close()
        self.item: int | None = None  # index being scored
        self.since = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardPool:
    """Score answers of ``task`` in ``workers`` processes with a per-answer deadline (see the module docstring).

    Args:
        task: a picklable :class:`~rlboost_hpc.tasks.base.Task` (sent to each worker once).
        workers: processes (≥ 1).
        timeout_s: per-answer deadline, seconds (> 0; ``task.reward_timeout_s``).

    Raises:
        ValueError: ``workers < 1`` or ``timeout_s <= 0``.
    """

    def __init__(self, task: Any, *, workers: int = 2, timeout_s: float = 5.0) -> None:
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"workers must be >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.task, self.timeout_s = task, timeout_s
        self._ctx = mp.get_context("spawn")
        self._slots = [_Slot(self._ctx, task) for _ in range(workers)]
        self.timed_out = 0  # answers that ran past their deadline (scored 0.0)
        self.failed = 0  # answers whose worker died twice (scored 0.0)
        self.replaced = 0  # workers killed or died and started anew

    def score(self, items: Sequence[tuple[Any, str]]) -> list[float]:
        """Rewards of ``(prompt, response_text)`` pairs, in order; never raises on model output, never waits
        more than ``timeout_s`` per answer plus queueing."""
        out: list[float | None] = [None] * len(items)
        todo = deque(range(len(items)))
        retried: set[int] = set()
        while todo or any(s.item is not None for s in self._slots):
            for s in self._slots:
                if s.item is None and todo:
                    i = todo.popleft()
                    p, t = items[i]
                    try:
                        s.conn.send((i, p, t))
                    except (BrokenPipeError, OSError):
                        todo.appendleft(i)
                        self._replace(s, "its pipe broke")
                        continue
                    s.item, s.since = i, time.monotonic()
            busy = [s for s in self._slots if s.item is not None]
            if not busy:
                continue
            now = time.monotonic()
            left = min(s.since + self.timeout_s for s in busy) - now
            ready = wait([s.conn for s in busy], timeout=max(0.0, left))
            for s in busy:
                if s.conn in ready:
                    try:
                        i, r = s.conn.recv()
                    except (EOFError, OSError):
                        i = s.item
                        self._replace(s, "it died")
                        if i in retried:
                            self.failed += 1
                            out[i] = 0.0
                        else:
                            retried.add(i)
                            todo.appendleft(i)
                        continue
                    out[i], s.item = r, None
                elif time.monotonic() - s.since >= self.timeout_s:
                    i = s.item
                    self.timed_out += 1
                    log.warning("reward of answer %d ran past %.1f s; scored 0, worker replaced: %.80r", i,
                                self.timeout_s, items[i][1])
                    out[i] = 0.0
                    self._replace(s, "it ran past its deadline")
        return [float(x) for x in out]  # type: ignore[arg-type]

    def _replace(self, s: _Slot, why: str) -> None:
        log.debug("reward worker %s replaced: %s", s.proc.pid, why)
        s.kill()
        fresh = _Slot(self._ctx, self.task)
        s.__dict__.update(fresh.__dict__)
        self.replaced += 1

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        for s in self._slots:
            s.kill()
        self._slots = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
