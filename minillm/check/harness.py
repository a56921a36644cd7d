"""The harness of the exercise checks (plumbing): run a check, compare tensors, explain a failure.

A check body raises CheckFailed with the feedback a student sees; `run_check` prints PASS or
FAIL with it; `compare` names the first wrong element and, when the result matches a known
mistake, that mistake's hint; `close_to`, `as_number` and `as_pair` do the same for the number an
exploration task answers; `run_explore` runs an exploration's check and reminds the student of
the sentence; `bounded` stops a student's function that does not return. The checks themselves are
in the other check_*.py modules; minillm/check/__init__.py is the front door and names them.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import torch
from minillm.utils.validate import is_number


class CheckFailed(Exception):
    """A check's assertion failed; the message is the feedback shown to the student."""


def fail(message: str, hint: str | None = None):
    raise CheckFailed(message + (f"\n    hint: {hint}" if hint else ""))


def run_check(name: str, body: Callable[[], None]) -> bool:
    """Run one check body: print PASS, or FAIL with feedback; return whether it passed."""
    try:
        with torch.no_grad():
            body()
    except CheckFailed as exc:
        print(f"FAIL {name}: {exc}")
        return False
    except NotImplementedError as exc:
        print(f"FAIL {name}: not implemented yet (NotImplementedError: {exc})")
        return False
    except Exception as exc:  # the student's code crashed: show where
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (in {frames[-1].name}, line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
        print(f"FAIL {name}: your code raised {type(exc).__name__}: {exc}{where}")
        return False
    print(f"PASS {name}")
    return True


EXPLAIN = "  now write, in the cell below, one sentence that explains the number (your teacher reads it)"


def run_explore(name: str, body: Callable[[], None]) -> bool:
    """run_check for an exploration task (check.explore_<name>): the number is half the answer."""
    ok = run_check(f"explore_{name}", body)
    print(EXPLAIN)
    return ok


def bounded(fn: Callable, what: str, max_lines: int = 200_000) -> Callable:
    """fn, stopped with a CheckFailed once it has run max_lines lines of Python (its callees' included).

    A student's loop that never ends would hang the check; counting lines (sys.settrace) stops it on
    every machine after the same amount of work, where a timer would depend on the machine's speed.
    """
    def call(*args, **kwargs):
        count, previous = 0, sys.gettrace()

        def tracer(frame, event, arg):
            nonlocal count
            if event == "line":
                count += 1
                if count > max_lines:
                    sys.settrace(previous)
                    fail(f"{what} did not return after {max_lines:,} lines of Python: a loop that never ends?",
                         "check that every loop makes progress: an index that advances, a queue that shrinks")
            return tracer

        sys.settrace(tracer)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.settrace(previous)
    return call


def as_number(what: str, got) -> float:
    """A student's answer as a float (a 0-d tensor too); fail naming its type otherwise."""
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if not is_number(got):
        fail(f"{what}: expected a number, got {type(got).__name__}")
    return float(got)


def close_to(what: str, got, expected: float, rel: float = 0.0, abs_: float = 0.0,
             mistakes: list[tuple[str, float]] = (), hint: str | None = None) -> None:
    """Fail unless |got - expected| <= max(abs_, rel * |expected|); name a known mistake if got matches one."""
    value = as_number(what, got)
    tol = max(abs_, rel * abs(expected))
    if abs(value - expected) <= tol:
        return
    for h, wrong in mistakes:
        if abs(value - wrong) <= max(tol, 1e-9 * abs(wrong)):
            fail(f"{what}: {value:g} is not the reference answer", h)
    fail(f"{what}: {value:g} is not the reference answer (within {'±' + format(tol, 'g')})", hint)


def as_pair(what: str, got) -> tuple:
    """A student's answer that must be two numbers (a tuple or list)."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        fail(f"{what}: expected a pair (two numbers), got {type(got).__name__}")
    return tuple(got)


def same_values(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-6) -> bool:
    """Whether a matches b in shape and values (dtype-agnostic; used to recognise known mistakes)."""
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    if a.dtype == torch.bool or b.dtype == torch.bool:
        return bool((a.bool() == b.bool()).all())
    return torch.allclose(a.double(), b.double(), atol=atol, rtol=0, equal_nan=True)


def compare(what: str, got, expected: torch.Tensor, atol: float = 1e-6, rtol: float = 0.0,
            mistakes: list[tuple[str, torch.Tensor]] = (), hint: str | None = None) -> None:
    """Fail unless got matches expected; name the first wrong element and the likely cause.

    mistakes: (hint, what that mistake would have produced); the first one that got matches
    becomes the hint. `hint` is the fallback.
    """
    if not isinstance(got, torch.Tensor):
        fail(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    if got.shape != expected.shape:
        for h, wrong in mistakes:
            if isinstance(wrong, torch.Tensor) and got.shape == wrong.shape and got.shape != expected.shape:
                fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}", h)
        fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}", hint)
    if got.dtype != expected.dtype:
        fail(f"{what}: dtype {got.dtype}, expected {expected.dtype}",
             "return the input's dtype" if expected.dtype != torch.bool else "return a bool tensor (True = may attend)")
    if expected.dtype == torch.bool:
        bad = got != expected
    else:
        g, e = got.double(), expected.double()
        bad = ~torch.isclose(g, e, atol=atol, rtol=rtol, equal_nan=False)
    if not bad.any():
        return
    idx = tuple(int(i) for i in bad.nonzero()[0])
    n_bad = int(bad.sum())
    message = (f"{what}: {n_bad} of {bad.numel()} elements wrong; first at index {idx}: "
               f"expected {expected[idx].item():.6g}, got {got[idx].item():.6g}")
    for h, wrong in mistakes:
        if same_values(got, wrong, atol=max(atol, 1e-6)):
            fail(message, h)
    fail(message, hint)


def expect_raises(what: str, exc_type: type[Exception], call: Callable[[], object], hint: str) -> None:
    try:
        call()
    except exc_type:
        return
    except NotImplementedError:
        raise
    except Exception as exc:
        fail(f"{what}: raised {type(exc).__name__} ({exc}), expected {exc_type.__name__}", hint)
    fail(f"{what}: did not raise {exc_type.__name__}", hint)
