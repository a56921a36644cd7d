"""The type tests every boundary makes, in one home, so that each check reads the same way.

Python's bool is an int (True == 1), so `isinstance(x, int)` alone would take `max_tokens=True` as a
count of one. Each test here refuses bools. A caller keeps its own message and error, which names
the argument the way its users know it (`max_tokens` in the server, `max_new_tokens` in Python).

    if not is_positive_int(max_new_tokens):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
"""

from __future__ import annotations


def is_int(value) -> bool:
    """An int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value) -> bool:
    """An int (not a bool) >= 1: a count, a size, a number of steps."""
    return is_int(value) and value >= 1


def is_number(value) -> bool:
    """An int or a float, not a bool (NaN and infinity included: range checks are the caller's)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
