# Generated from notebooks/14_structured_outputs.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Patterns over bytes, their automata, and the patterns of a JSON schema (constrained decoding, part 1).

Built in notebooks/14_structured_outputs.ipynb: patterns (`Byte`, `Seq`, `Alt`, `Star`, `Sep`), an NFA by
Thompson's construction (Russ Cox, "Regular Expression Matching Can Be Simple And Fast"), a DFA by lazy
subset construction, and `schema_pattern(schema)` for a subset of JSON Schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.utils.validate import is_int


@dataclass(frozen=True)
class Byte:
    """One byte from a set."""

    allowed: frozenset[int]


@dataclass(frozen=True)
class Seq:
    """The parts in order (none: the empty string)."""

    parts: tuple


@dataclass(frozen=True)
class Alt:
    """Any one of the options."""

    options: tuple


@dataclass(frozen=True)
class Star:
    """The part repeated zero or more times."""

    part: object


@dataclass(frozen=True)
class Sep:
    """item (sep item)*, with one copy of item."""

    item: object
    sep: object


def lit(text: str) -> Seq:
    """The UTF-8 bytes of `text`, in order."""
    return Seq(tuple(Byte(frozenset([b])) for b in text.encode()))


def byte_range(lo: int, hi: int) -> Byte:
    return Byte(frozenset(range(lo, hi + 1)))


def seq(*parts) -> Seq:
    return Seq(parts)


def alt(*options) -> Alt:
    return Alt(options)


def optional(part) -> Alt:
    return Alt((part, Seq(())))


class NFA:
    """Thompson's construction: nodes joined by byte edges and empty edges; node 0 starts."""

    def __init__(self, pattern):
        self.edges: list[list[tuple[frozenset[int], int]]] = [[]]  # per node: (bytes, next node)
        self.empty: list[list[int]] = [[]]  # per node: nodes reached without reading a byte
        self.final = self._build(pattern, 0)

    def _node(self) -> int:
        self.edges.append([])
        self.empty.append([])
        return len(self.edges) - 1

    def _build(self, p, start: int) -> int:
        """Wire pattern p from node `start`; return the node where it ends."""
        if isinstance(p, Byte):
            end = self._node()
            self.edges[start].append((p.allowed, end))
            return end
        if isinstance(p, Seq):
            for part in p.parts:
                start = self._build(part, start)
            return start
        if isinstance(p, Alt):
            end = self._node()
            for option in p.options:
                entry = self._node()
                self.empty[start].append(entry)
                self.empty[self._build(option, entry)].append(end)
            return end
        if isinstance(p, Star):  # entry -> part -> entry; leave from entry
            entry = self._node()
            self.empty[start].append(entry)
            self.empty[self._build(p.part, entry)].append(entry)
            return entry
        if isinstance(p, Sep):  # entry -> item -> end -> sep -> entry; leave from end
            entry = self._node()
            self.empty[start].append(entry)
            end = self._build(p.item, entry)
            self.empty[self._build(p.sep, end)].append(entry)
            return end
        raise TypeError(f"not a pattern: {p!r}")


def closure(nfa: NFA, nodes) -> frozenset[int]:
    """The nodes reachable from `nodes` by empty edges (them included)."""
    seen, todo = set(nodes), list(nodes)
    while todo:
        for nxt in nfa.empty[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return frozenset(seen)


class DFA:
    """Subset construction on demand: a DFA state is a set of NFA nodes, numbered when first met."""

    DEAD = -1

    def __init__(self, pattern):
        self.nfa = NFA(pattern)
        self.sets: list[frozenset[int]] = []
        self.number: dict[frozenset[int], int] = {}
        self.moves: dict[tuple[int, int], int] = {}  # (state, byte) -> state, filled as bytes are read
        self.start = self._state(closure(self.nfa, [0]))

    def _state(self, nodes: frozenset[int]) -> int:
        if not nodes:
            return self.DEAD
        if nodes not in self.number:
            self.number[nodes] = len(self.sets)
            self.sets.append(nodes)
        return self.number[nodes]

    def step(self, state: int, byte: int) -> int:
        key = (state, byte)
        if state == self.DEAD:  # nothing leaves the dead state (and sets[-1] is another state's set)
            return self.DEAD
        if key not in self.moves:
            targets = [t for n in self.sets[state] for allowed, t in self.nfa.edges[n] if byte in allowed]
            self.moves[key] = self._state(closure(self.nfa, targets))
        return self.moves[key]

    def accepts(self, state: int) -> bool:
        return state != self.DEAD and self.nfa.final in self.sets[state]

    def read(self, data: bytes, state: int | None = None) -> int:
        state = self.start if state is None else state
        for b in data:
            state = self.step(state, b)
            if state == self.DEAD:
                break
        return state


DIGIT, NONZERO, HEX = byte_range(0x30, 0x39), byte_range(0x31, 0x39), Byte(frozenset(b"0123456789abcdefABCDEF"))
CONTINUATION = byte_range(0x80, 0xBF)
UTF8_CHAR = alt(  # two to four bytes, valid UTF-8 only
    seq(byte_range(0xC2, 0xDF), CONTINUATION),
    seq(Byte(frozenset([0xE0])), byte_range(0xA0, 0xBF), CONTINUATION),
    seq(Byte(frozenset([*range(0xE1, 0xED), 0xEE, 0xEF])), CONTINUATION, CONTINUATION),
    seq(Byte(frozenset([0xED])), byte_range(0x80, 0x9F), CONTINUATION),
    seq(Byte(frozenset([0xF0])), byte_range(0x90, 0xBF), CONTINUATION, CONTINUATION),
    seq(byte_range(0xF1, 0xF3), CONTINUATION, CONTINUATION, CONTINUATION),
    seq(Byte(frozenset([0xF4])), byte_range(0x80, 0x8F), CONTINUATION, CONTINUATION))
NOT_SURROGATE = alt(  # four hex digits outside D800-DFFF: one \u escape is then one character, as
    seq(Byte(frozenset(b"0123456789abcefABCEF")), HEX, HEX, HEX),  # JSON Schema's lengths count them
    seq(Byte(frozenset(b"dD")), byte_range(0x30, 0x37), HEX, HEX))
STRING_CHAR = alt(
    Byte(frozenset(range(0x20, 0x80)) - frozenset(b'"\\')),
    seq(lit("\\"), alt(Byte(frozenset(b'"\\/bfnrt')), seq(lit("u"), NOT_SURROGATE))),
    UTF8_CHAR)
INTEGER = seq(optional(lit("-")), alt(lit("0"), seq(NONZERO, Star(DIGIT))))
NUMBER = seq(INTEGER, optional(seq(lit("."), DIGIT, Star(DIGIT))),
             optional(seq(Byte(frozenset(b"eE")), optional(Byte(frozenset(b"+-"))), DIGIT, Star(DIGIT))))
SCALARS = {"integer": INTEGER, "number": NUMBER, "boolean": alt(lit("true"), lit("false")), "null": lit("null")}


def string_pattern(min_length: int = 0, max_length: int | None = None) -> Seq:
    """A JSON string of min_length..max_length characters (no maximum: any length)."""
    chars = [STRING_CHAR] * min_length
    if max_length is None:
        chars.append(Star(STRING_CHAR))
    else:
        tail = Seq(())
        for _ in range(max_length - min_length):  # nested: each further character is optional
            tail = optional(seq(STRING_CHAR, tail))
        chars.append(tail)
    return seq(lit('"'), *chars, lit('"'))


def separated(item, min_items: int = 0, max_items: int | None = None) -> Seq | Alt:
    """min_items..max_items copies of `item` with ", " between them."""
    if max_items == 0:
        return Seq(())
    if max_items is None and min_items <= 1:  # the common case, with one copy of the item
        return Sep(item, lit(", ")) if min_items else optional(Sep(item, lit(", ")))
    rest = [seq(lit(", "), item)] * max(min_items - 1, 0)
    if max_items is None:
        rest.append(Star(seq(lit(", "), item)))
    else:
        tail = Seq(())
        for _ in range(max_items - max(min_items, 1)):
            tail = optional(seq(lit(", "), item, tail))
        rest.append(tail)
    filled = seq(item, *rest)
    return filled if min_items else optional(filled)


def _same_length(lo: str, hi: str):
    """The decimal strings from lo to hi (lo <= hi), both with the same number of digits."""
    if lo == hi:
        return lit(lo)
    if len(lo) == 1:
        return byte_range(ord(lo), ord(hi))
    if lo[0] == hi[0]:
        return seq(lit(lo[0]), _same_length(lo[1:], hi[1:]))
    k = len(lo) - 1
    options = [seq(lit(lo[0]), _same_length(lo[1:], "9" * k)), seq(lit(hi[0]), _same_length("0" * k, hi[1:]))]
    if int(hi[0]) - int(lo[0]) > 1:  # a whole block of first digits between them: any k digits follow
        options.append(seq(byte_range(ord(lo[0]) + 1, ord(hi[0]) - 1), *[DIGIT] * k))
    return alt(*options)


def natural_range(lo: int, hi: int):
    """The integers lo..hi (0 <= lo <= hi), no leading zeros: one run per digit count."""
    runs = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10**n - 1)
        runs.append(_same_length(str(a), str(b)))
    return alt(*runs)


def integer_range(lo: int, hi: int):
    """The integers lo..hi (and "-0" when the range holds 0 and negatives, as llguidance writes it)."""
    parts = [] if hi < 0 else [natural_range(max(lo, 0), hi)]
    if lo < 0 <= hi:
        parts.append(lit("-0"))
    if lo < 0:
        parts.append(seq(lit("-"), natural_range(max(-hi, 1), -lo)))
    return alt(*parts)


def properties_pattern(properties: dict, required: Sequence[str], depth: int, first: bool = True, i: int = 0):
    """The properties from the i-th on, in the schema's order; one not required may be left out."""
    names = list(properties)
    if i == len(names):
        return Seq(())
    name = names[i]
    member = seq(lit(("" if first else ", ") + json.dumps(name) + ": "), schema_pattern(properties[name], depth + 1))
    present = seq(member, properties_pattern(properties, required, depth, False, i + 1))
    if name in required:
        return present
    return alt(present, properties_pattern(properties, required, depth, first, i + 1))


class UnsupportedSchema(ValueError):
    """A schema, or a feature of one, that the from-scratch compiler does not handle (named in the message)."""


IGNORED = {"title", "description", "$schema", "$id", "examples", "default", "$comment"}  # no effect on the text
KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum",
            "const", "anyOf", "minLength", "maxLength", "minimum", "maximum"} | IGNORED
MAX_DEPTH = 6  # nesting of objects and arrays; json_object's free JSON goes this deep


def any_json(depth: int = 0):
    """Any JSON value nested at most MAX_DEPTH deep (response_format {"type": "json_object"} wants an object)."""
    scalars = [string_pattern(), NUMBER, *list(SCALARS.values())[2:]]
    if depth >= MAX_DEPTH:
        return alt(*scalars)
    inner = any_json(depth + 1)
    member = seq(string_pattern(), lit(": "), inner)
    return alt(*scalars, seq(lit("{"), separated(member), lit("}")), seq(lit("["), separated(inner), lit("]")))


def schema_pattern(schema, depth: int = 0):
    """The pattern of every JSON text, written with json.dumps' separators, that `schema` accepts."""
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"a schema must be a JSON object, got {schema!r}")
    unknown = sorted(set(schema) - KEYWORDS)
    if unknown:
        raise UnsupportedSchema(f"schema keyword {unknown[0]!r} is not supported (supported: {sorted(KEYWORDS - IGNORED)})")
    if depth > MAX_DEPTH:
        raise UnsupportedSchema(f"schemas nested deeper than {MAX_DEPTH} levels are not supported")
    if "enum" in schema or "const" in schema:
        return alt(*(lit(text) for text in _enum_texts(schema)))
    if "anyOf" in schema:
        if not isinstance(schema["anyOf"], list) or not schema["anyOf"] or set(schema) - IGNORED - {"anyOf"}:
            raise UnsupportedSchema("anyOf must be a non-empty list of schemas, with no other keyword beside it")
        return alt(*(schema_pattern(s, depth) for s in schema["anyOf"]))
    kind = schema.get("type")
    if isinstance(kind, list):
        return alt(*(schema_pattern({**schema, "type": k}, depth) for k in kind))
    if "minimum" in schema or "maximum" in schema:
        return _bounded_integer(schema)
    if kind in SCALARS:
        return SCALARS[kind]
    if kind == "string":
        return string_pattern(*_counts(schema, "minLength", "maxLength"))
    if kind == "array":
        items = schema_pattern(schema.get("items", {"type": ["string", "number", "boolean", "null"]}), depth + 1)
        return seq(lit("["), separated(items, *_counts(schema, "minItems", "maxItems")), lit("]"))
    if kind == "object":
        properties, required = schema.get("properties", {}), schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list) or set(required) - set(properties):
            raise UnsupportedSchema("properties must be an object, and required a list of its names")
        if schema.get("additionalProperties", False) is not False:
            raise UnsupportedSchema("additionalProperties other than false is not supported")
        if not properties and "additionalProperties" in schema:  # false: no property at all
            return lit("{}")
        if not properties:
            return alt(lit("{}"), seq(lit("{"), separated(seq(string_pattern(), lit(": "), any_json(depth + 1))), lit("}")))
        return seq(lit("{"), properties_pattern(properties, required, depth), lit("}"))
    raise UnsupportedSchema(f"schema type {kind!r} is not supported")


def _bounded_integer(schema: dict):
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if schema.get("type") != "integer" or not all(is_int(v) for v in (lo, hi)):
        raise UnsupportedSchema("minimum and maximum are supported together, as ints, on type integer only")
    if lo > hi:
        raise UnsupportedSchema(f"minimum {lo} is above maximum {hi}")
    return integer_range(lo, hi)


def _count(schema: dict, key: str, default):
    value = schema.get(key, default)
    if value is not default and not (is_int(value) and 0 <= value <= 64):
        raise UnsupportedSchema(f"{key} must be an int from 0 to 64, got {value!r}")
    return value


def _counts(schema: dict, low: str, high: str) -> tuple[int, int | None]:
    """(minimum, maximum or None) of minLength/maxLength or minItems/maxItems."""
    lo, hi = _count(schema, low, 0), _count(schema, high, None)
    if hi is not None and lo > hi:
        raise UnsupportedSchema(f"{low} {lo} is above {high} {hi}: no value is valid")
    return lo, hi


def _enum_texts(schema: dict) -> list[str]:
    """The JSON texts of the enum's (or const's) values that jsonschema finds valid for the other keywords."""
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    if not isinstance(values, list) or not values:
        raise UnsupportedSchema("enum must be a non-empty list")
    import jsonschema  # on use: importing it compiles a Lark grammar for its IRI formats, a second of every start-up

    rest = jsonschema.Draft202012Validator({k: v for k, v in schema.items() if k not in ("enum", "const")})
    texts = [json.dumps(v, ensure_ascii=False) for v in values if rest.is_valid(v)]
    if not texts:
        raise UnsupportedSchema("no value of the enum passes the schema's other keywords: no value is valid")
    if any(not t.isascii() and any(0xD800 <= ord(c) <= 0xDFFF for c in t) for t in texts):
        raise UnsupportedSchema("an enum value holds a lone surrogate, which is not valid UTF-8")
    return texts
