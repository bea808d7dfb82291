"""Small helpers shared by the tests."""
from __future__ import annotations

import time


def wait_for(pred, timeout: float, what: str, interval: float = 0.25):
    """Poll ``pred`` until it returns something truthy (returned) or ``timeout`` seconds pass (AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def collect_until(eng, req, k: int):
    """Run ``req`` on engine ``eng`` until ≥ k tokens came back (or it finished), abort it, and return
    ``(ids, logprobs, finish_reason or None)``: every token the engine produced, including those handed back by
    ``abort`` (the Engine contract: engines that produce tokens asynchronously return them there)."""
    eng.add(req)
    ids: list[int] = []
    lps: list[float] = []
    while True:
        for e in eng.step():
            assert e.rid == req.rid and len(e.token_ids) == len(e.logprobs)
            ids += e.token_ids
            lps += e.logprobs
            if e.finished:
                return ids, lps, e.finish_reason
        if len(ids) >= k:
            ev = eng.abort(req.rid)
            if ev is not None:
                assert len(ev.token_ids) == len(ev.logprobs)
                ids += ev.token_ids
                lps += ev.logprobs
                if ev.finished:
                    return ids, lps, ev.finish_reason
            assert eng.num_active == 0
            return ids, lps, None
