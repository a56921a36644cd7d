# Generated from notebooks/07_tokenizer.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Chat templates: Jinja rendered in jinja2's sandbox, with limits on time and size.

Built in notebooks/07_tokenizer.ipynb. A template is code written by a model's author and runs on
every request, so it runs where it cannot reach Python internals (the sandbox), for at most
TEMPLATE_SECONDS, and with its output and any string or list it builds under TEMPLATE_CHARS.
The helpers (`raise_exception`, `tojson`, `strftime_now`) are transformers' apply_chat_template's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


TEMPLATE_SECONDS = 2.0  # a chat template that renders for longer is refused
TEMPLATE_CHARS = 1_000_000  # and so is one whose output, or a string or list it builds, grows past this
_deadline: ContextVar[float] = ContextVar("template_deadline", default=float("inf"))


def _tick() -> None:
    if time.monotonic() > _deadline.get():
        raise jinja2.exceptions.TemplateError(f"the chat template ran for more than {TEMPLATE_SECONDS} s")


def _range(*args: int) -> Iterator[int]:
    """The sandbox's range (at most 100,000 items), checking the clock at every step of a loop."""
    for i in safe_range(*args):
        _tick()
        yield i


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's sandbox (no access to Python internals) plus limits on time and size: a template is
    code from the model's author, and `{% for i in range(10**5) %}` nested twice never ends."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left, right):
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise jinja2.exceptions.SecurityError(f"the chat template raises to the power {right}")
        if operator == "*" and isinstance(left, (int, float)) and isinstance(right, (str, list, tuple)):
            left, right = right, left
        if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
            if len(left) * right > TEMPLATE_CHARS:
                raise jinja2.exceptions.SecurityError(f"the chat template builds a value of {len(left) * right} items")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # every function call in a template
        _tick()
        return super().call(__context, __obj, *args, **kwargs)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = _range
    del env.globals["lipsum"]  # lorem ipsum of any length: no chat template needs it
    return env.from_string(template)


def validate_messages(messages: Any) -> None:
    """ValueError naming the first message that is not a dict with str 'role' and 'content'."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "missing" if key not in message else f"{type(message[key]).__name__}"
                raise ValueError(f"messages[{i}]['{key}'] must be a str, got {got}")


def render_chat(template: str, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Render a Jinja chat template in jinja2's sandbox, as transformers' apply_chat_template does."""
    if not isinstance(template, str):
        raise TypeError(f"template must be a str, got {type(template).__name__}")
    validate_messages(messages)
    token = _deadline.set(time.monotonic() + TEMPLATE_SECONDS)
    try:
        pieces, size = [], 0
        for piece in _compile(template).generate(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs):
            size += len(piece)
            if size > TEMPLATE_CHARS:
                raise jinja2.exceptions.TemplateError(f"the chat template's output passed {TEMPLATE_CHARS} characters")
            _tick()
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _deadline.reset(token)
