# Generated from notebooks/A2_template_sandbox.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Chat templates: Jinja rendered in jinja2's sandbox, with limits on time and size.

Built in notebooks/A2_template_sandbox.ipynb, the appendix of notebook 07. A template is code
written by a model's author and runs on every request, so it runs where it cannot reach Python
internals (the sandbox), for at most TEMPLATE_SECONDS, and with its output and any string or list
it builds under TEMPLATE_CHARS.
The helpers (`raise_exception`, `tojson`, `strftime_now`) are transformers' apply_chat_template's.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, wraps
from string import Formatter
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' tojson, written piece by piece so that its size is checked as it grows."""
    if (indent if isinstance(indent, int) else len(indent or "")) > 16:
        raise jinja2.exceptions.SecurityError(f"the chat template indents JSON by {indent!r} (at most 16)")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, size = [], 0
    for piece in encoder.iterencode(value):
        size += len(piece)
        _within(size, "writes JSON")
        pieces.append(piece)
    return "".join(pieces)


TEMPLATE_SECONDS = 2.0  # a chat template that renders for longer is refused
TEMPLATE_CHARS = 1_000_000  # and so is one whose output, or any value it builds, grows past this size
_deadline: ContextVar[float] = ContextVar("template_deadline", default=float("inf"))


def _tick() -> None:
    if time.monotonic() > _deadline.get():
        raise jinja2.exceptions.TemplateError(f"the chat template ran for more than {TEMPLATE_SECONDS} s")


def _range(*args: int) -> Iterator[int]:
    """The sandbox's range (at most 100,000 items), checking the clock at every step of a loop."""
    for i in safe_range(*args):
        _tick()
        yield i


def _ticking(items: Any) -> Iterator[Any]:
    """Any `{% for %}`'s items, checking the clock at every step (two nested loops over long lists
    call nothing and print nothing, so only the loop itself can notice the time)."""
    for item in items:
        _tick()
        yield item


def _size(value: Any, seen: dict[int, int] | None = None) -> int:
    """What a value weighs against TEMPLATE_CHARS: a string its characters, a list, tuple or dict
    its items plus what they weigh. A list repeated inside another counts each time it appears,
    as it does when the template prints it; `seen` makes that cost one visit per distinct list."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3  # about its number of digits
    if not isinstance(value, (list, tuple, dict)):
        return 1
    seen = {} if seen is None else seen
    if id(value) not in seen:
        seen[id(value)] = 0  # a cycle cannot be built in the sandbox; this only guards the walk
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total = len(value)
        for item in items:
            total += _size(item, seen)
            if total > TEMPLATE_CHARS:
                break
        seen[id(value)] = total
    return seen[id(value)]


def _within(size: int, what: str, unit: str = "characters or items") -> None:
    """SecurityError, before the value is built, when it would weigh more than TEMPLATE_CHARS."""
    if size > TEMPLATE_CHARS:
        raise jinja2.exceptions.SecurityError(
            f"the chat template {what} of {size:,} {unit} (the limit is {TEMPLATE_CHARS:,})")


def _joined_size(items: Iterable[Any], separator: str = "") -> int:
    """The length of separator.join(str(x) for x in items), counted without building it."""
    total = -len(separator)
    for item in items:
        total += len(separator) + (len(item) if isinstance(item, str) else 10 * _size(item) + 8)  # repr's bound
        _within(total, "joins a string")
    return max(total, 0)


_WIDTHS = re.compile(r"\d+")


def _check_format(fmt: str, printf: bool) -> None:
    """A `%` or str.format pattern whose field widths or precisions would pad past the limit, or
    come from an argument (`%*d`, `{:{w}}`), is refused before it is applied."""
    specs = re.findall(r"%[^a-zA-Z%]*", fmt) if printf else [spec or "" for _, _, spec, _ in Formatter().parse(fmt)]
    for spec in specs:
        if "*" in spec and printf or "{" in spec:
            raise jinja2.exceptions.SecurityError(f"the chat template formats with a width from an argument: {spec!r}")
        _within(max((int(w) if len(w) < 12 else 10**12 for w in _WIDTHS.findall(spec)), default=0), "pads a field")


def _check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """The str methods whose result can outgrow their string, sized before they run. Returns the
    arguments to call with: join's items are gathered once, to be sized and then joined."""
    arg = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("ljust", "rjust", "center", "zfill") and isinstance(arg, int):
        _within(arg, f"pads a string ({name})")
    elif name == "expandtabs" and isinstance(arg, int):
        _within(len(text) + text.count("\t") * arg, "expands tabs into a string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = text.count(args[0]) if args[0] else len(text) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        _within(len(text) + count * (len(args[1]) - len(args[0])), "replaces into a string")
    elif name == "join" and args:
        args = (list(args[0]),)
        _within(_joined_size(args[0], text), "joins a string")
    elif name == "translate" and isinstance(arg, dict):
        _within(len(text) * max((_size(v) for v in arg.values()), default=1), "translates a string")
    return args


def _checked_filter(name: str, function: Callable) -> Callable:
    """A Jinja filter with its size checks: the filters that grow a value by an argument are sized
    before they run, and every filter's result is weighed after."""
    skip = 1 if getattr(function, "jinja_pass_arg", None) else 0  # the environment jinja passes some filters

    @wraps(function)
    def checked(*args, **kwargs):
        head, value, rest = args[:skip], args[skip] if len(args) > skip else None, args[skip + 1:]
        option = next(iter([*rest, *kwargs.values()]), None)  # the width, count or separator
        if name == "center" and isinstance(option, int):
            _within(option, "pads a string (center)")
        elif name == "indent" and isinstance(value, str):
            width = len(option) if isinstance(option, str) else option if isinstance(option, int) else 4
            _within(len(value) + (value.count("\n") + 1) * width, "indents a string")
        elif name == "wordwrap" and isinstance(value, str):
            wrap = kwargs.get("wrapstring", rest[2] if len(rest) > 2 else None) or "\n"
            _within(len(value) + (len(value) + 1) * len(wrap), "wraps a string")
        elif name == "format" and isinstance(value, str):
            _check_format(value, printf=True)
        elif name in ("batch", "slice") and isinstance(option, int):
            _within(option, f"cuts a list into pieces ({name})")
        elif name in ("join", "sum") and value is not None:
            value = list(value)  # gathered once, to be sized and then passed on
            if name == "join":
                _within(_joined_size(value, option if isinstance(option, str) else ""), "joins a string")
            else:
                _within(sum(_size(item) for item in value), "sums lists")
            args = (*head, value, *rest)
        result = function(*args, **kwargs)
        _within(_size(result), f"builds a value with the {name} filter")
        return result

    return checked


class _BudgetedCode(CodeGenerator):
    """Jinja's code generator, with `~` joined by the environment's size-checked concat."""

    def visit_Concat(self, node, frame) -> None:
        self.write("concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _bounded_concat(pieces: Iterable[Any]) -> str:
    """`~`, a macro's output and a `{% set %}` block, joined only once their length is known."""
    pieces = [piece if isinstance(piece, str) else str(piece) for piece in pieces]
    _within(sum(map(len, pieces)), "joins a string")
    return "".join(pieces)


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's sandbox (no access to Python internals) plus limits on time and size: a template is
    code from the model's author, and `{% for i in range(10**5) %}` nested twice never ends."""

    code_generator_class = _BudgetedCode
    concat = staticmethod(_bounded_concat)
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator: str, left, right):
        numbers = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise jinja2.exceptions.SecurityError(f"the chat template raises to the power {right}")
        if operator == "**" and numbers:
            _within(left.bit_length() * abs(right) // 3, "raises a number", "digits")
        elif operator == "*" and numbers:
            _within((left.bit_length() + right.bit_length()) // 3, "multiplies numbers", "digits")
        elif operator == "*" and isinstance(right, (str, list, tuple)) and isinstance(left, int):
            _within(_size(right) * left, "repeats a value")
        elif operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
            _within(_size(left) * right, "repeats a value")
        elif operator == "+" and isinstance(left, (str, list, tuple)):
            _within(_size(left) + _size(right), "adds a value")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, printf=True)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # every function call in a template
        _tick()
        if isinstance(getattr(__obj, "__self__", None), str):
            args = _check_str_method(__obj.__self__, __obj.__name__, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _within(_size(result), "builds a value")
        return result

    def wrap_str_format(self, value):
        """str.format and format_map, with the widths in the pattern checked first."""
        sandboxed = super().wrap_str_format(value)
        if sandboxed is None:
            return None

        @wraps(sandboxed)
        def checked(*args, **kwargs):
            _check_format(value.__self__, printf=False)
            return sandboxed(*args, **kwargs)

        return checked

    def _parse(self, source, name, filename):
        """The template's syntax tree, with every `{% for %}` loop's items passed through `_ticking`."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name("_ticking", "load"), [loop.iter], [], None, None)
        return tree


class _Generation(Extension):
    """transformers' {% generation %}...{% endgeneration %} (it marks the assistant's tokens for training
    masks): rendering a prompt, the block is its text as is."""

    tags = {"generation"}

    def parse(self, parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_text"), [], [], body).set_lineno(lineno)

    def _text(self, caller) -> str:
        return caller()


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _Generation])
    env.filters["tojson"] = _tojson
    del env.filters["pprint"]  # a debugging aid whose indentation grows with depth: no chat template needs it
    env.filters = {name: _checked_filter(name, f) for name, f in env.filters.items()}
    env.globals.update(raise_exception=_raise_exception, range=_range, _ticking=_ticking,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    del env.globals["lipsum"]  # lorem ipsum of any length: no chat template needs it
    return env.from_string(template)


def validate_template(template: Any, where: str) -> None:
    """ValueError naming `where` (a file, a GGUF key) when a chat template is not a str or does not
    compile: a model folder's syntax error is reported when it is loaded, not on the first chat."""
    if not isinstance(template, str):
        raise ValueError(f"{where}: the chat template must be a str, got {type(template).__name__}")
    try:
        _compile(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"{where}: the chat template does not compile (line {exc.lineno}: {exc.message})") from None


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
            _within(size, "writes output")
            _tick()
            pieces.append(piece)
        return "".join(pieces)
    except RecursionError:  # a macro that calls itself without end
        raise jinja2.exceptions.TemplateError("the chat template recursed too deeply") from None
    except jinja2.exceptions.TemplateError:
        raise
    except Exception as exc:  # `{{ 1 / 0 }}`, `{{ 'x'.encode('bad') }}`: the template's own error, named as such
        raise jinja2.exceptions.TemplateError(f"the chat template raised {type(exc).__name__}: {exc}") from exc
    finally:
        _deadline.reset(token)


RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tools", "documents")  # the request's own fields
TEMPLATE_KWARGS_CHARS = 16_384  # as JSON: far above a handful of switches


def validate_template_kwargs(kwargs: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """A caller's template variables ({"enable_thinking": False}, ...) checked: names to JSON values, none of
    RESERVED_TEMPLATE_KWARGS, at most TEMPLATE_KWARGS_CHARS as JSON; ValueError naming `where`. None: {}."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{where} must be an object of template variables, got {type(kwargs).__name__}")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{where}: {name!r} is not a template variable name (letters, digits and _)")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"{where}.{name} is set from the request itself, not by a template variable")
    try:
        size = len(json.dumps(kwargs, allow_nan=False))
    except (TypeError, ValueError):
        raise ValueError(f"{where} must hold JSON values only (strings, numbers, booleans, null, lists, objects)") from None
    if size > TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"{where} is {size:,} characters as JSON, over the limit of {TEMPLATE_KWARGS_CHARS:,}")
    return dict(kwargs)
