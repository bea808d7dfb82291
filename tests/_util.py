"""Small helpers shared by the integration tests."""
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
