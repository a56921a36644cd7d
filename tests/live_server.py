"""Helpers for tests that drive a live server (test_server_hardening.py, test_server_ops.py)."""

from __future__ import annotations

import time


def slow_steps(app, monkeypatch, seconds: float) -> None:
    """Make each engine step of `app` sleep first: a request then lasts as long as a test needs,
    whatever the CPU (the event loop must never wait for a step)."""
    engine = app.state.engine.engine
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow)


def wait_until(condition, timeout: float = 10.0) -> bool:
    """Poll `condition` every 50 ms; False if it is still false after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
