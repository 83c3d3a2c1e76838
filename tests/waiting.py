"""Waiting for a state, not for a clock: a test that needs "the request has reached the server"
waits for exactly that, bounded only so that a hang fails instead of stalling the suite."""

import time


def wait_until(pred, what: str, timeout: float = 60.0, every: float = 0.01) -> None:
    """Return once pred() is true; fail naming `what` if it never became true within `timeout` s."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
