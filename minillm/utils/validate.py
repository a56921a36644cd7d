"""The type tests every boundary makes, in one home, so that each check reads the same way.

Python's bool is an int (True == 1), so `isinstance(x, int)` alone would take `max_tokens=True` as a
count of one. Each test here refuses bools. A caller keeps its own message and error, which names
the argument the way its users know it (`max_tokens` in the server, `max_new_tokens` in Python).

    if not is_positive_int(max_new_tokens):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")

JSON from a client gets two more: `json_problem` finds, with its path, a string no UTF-8 can carry
(a lone surrogate) or nesting too deep for code that recurses; `shown` is a repr cut short, so that
a message names a 2 MB value without echoing it.
"""

from __future__ import annotations

import math


def is_int(value) -> bool:
    """An int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value) -> bool:
    """An int (not a bool) >= 1: a count, a size, a number of steps."""
    return is_int(value) and value >= 1


def is_number(value) -> bool:
    """An int or a float, not a bool (NaN and infinity included: range checks are the caller's)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def shown(value, limit: int = 80) -> str:
    """`repr(value)` for an error message, cut to about `limit` characters: a client's 2 MB string or
    10,000-element list is named, not echoed back. repr escapes lone surrogates, so the message
    always encodes to UTF-8."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_problem(value, max_depth: float = math.inf, path: str = "") -> tuple[str, str] | None:
    """(path, what is wrong) for the first value in a JSON value, keys included, that code downstream
    cannot take: a string holding a lone UTF-16 surrogate (JSON's "\\ud800": a Python str can hold
    one, UTF-8 cannot, so no tokenizer or response can carry it), or a value nested more than
    `max_depth` levels below the root (code that recurses over a value, such as repr or json.dumps,
    then stays far from Python's recursion limit). None if there is none. The path reads like
    "tools[0].function.description", below `path`.

    Walked with a list, not by recursion, so no nesting can exhaust the stack; a trail (parent trail,
    key or index) is spelled as a path only for what is reported."""
    todo = [(None, 0, value)]
    while todo:
        trail, depth, value = todo.pop()
        if depth > max_depth:
            return _path(trail, path), f"is nested more than {max_depth} levels deep"
        if isinstance(value, str) and not _is_text(value):
            return _path(trail, path), "holds a lone surrogate (not valid Unicode text)"
        if isinstance(value, dict):
            for key, item in reversed(value.items()):  # each key before its value
                todo += (((trail, key), depth + 1, item), ((trail, key), depth + 1, key))
        elif isinstance(value, list):
            todo += [((trail, i), depth + 1, item) for i, item in reversed(list(enumerate(value)))]
    return None


def _path(trail, root: str) -> str:
    """The path a trail spells below `root`: "tools[0].function.name"."""
    parts = []
    while trail is not None:
        trail, part = trail
        parts.append(f".{part}" if isinstance(part, str) and part.isidentifier() else f"[{shown(part, 40)}]")
    path = root + "".join(reversed(parts))
    return path[1:] if path.startswith(".") else path


def lone_surrogate(value, path: str = "") -> str | None:
    """The path of the first string in a JSON value, key or value, that holds a lone UTF-16 surrogate
    (see json_problem), such as "tools[0].function.description"; None if there is none."""
    problem = json_problem(value, path=path)
    return None if problem is None else problem[0]
