# Generated from notebooks/14_structured_outputs.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Constrained decoding, part 2: a JSON schema's automaton lifted to a per-step mask over the tokens.

Built in notebooks/14_structured_outputs.ipynb on minillm/text/grammar.py. `JSONConstraint` (ours) and
`GuidanceConstraint` (llguidance, the default) follow one request: mask() before a step, advance(token)
after; notebook 10's `apply_constraints` applies them. Related work: Willard and Louf, "Efficient
Guided Generation for Large Language Models" (2023). V: the vocabulary (the model's logits).
"""

from __future__ import annotations

import json

import llguidance
import llguidance.torch
import torch

from minillm.text.grammar import DFA, UnsupportedSchema, lit, schema_pattern, seq


def token_bytes_of(tokenizer, vocab_size: int) -> list[bytes]:
    """Each token's bytes, special tokens as none (a grammar never writes them); vocab_size is the model's."""
    return [b"" if i in tokenizer.special_ids else tokenizer.token_bytes(i)
            for i in range(min(tokenizer.vocab_size, vocab_size))]


class Vocabulary:
    """The tokens' bytes in a trie (node: ({byte: child}, [token ids ending here])), special tokens left out;
    vocab_size is the model's."""

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(tokenizer.eos_token_ids)
        self.root: tuple[dict, list] = ({}, [])
        self.token_bytes = token_bytes_of(tokenizer, vocab_size)
        for token_id, data in enumerate(self.token_bytes):
            node = self.root
            for b in data:
                node = node[0].setdefault(b, ({}, []))
            node[1].append(token_id)

    def allowed(self, dfa: DFA, state: int) -> list[int]:
        """Every token whose bytes the DFA reads from `state` without dying: one walk down the trie."""
        found, todo = [], [(self.root, state)]
        while todo:
            (children, _), s = todo.pop()
            for b, child in children.items():
                t = dfa.step(s, b)
                if t != DFA.DEAD:
                    found.extend(child[1])
                    todo.append((child, t))
        return found


class JSONConstraint:
    """One request's place in a schema: mask() before each step, advance(token) after it."""

    def __init__(self, dfa: DFA, vocabulary: Vocabulary, masks: dict[int, torch.Tensor]):
        self.dfa, self.vocabulary, self.masks = dfa, vocabulary, masks  # masks: shared
        self.state = dfa.start

    def mask(self) -> torch.Tensor:
        """(V,) bool: True where the token may come next."""
        if self.state not in self.masks:
            mask = torch.zeros(self.vocabulary.vocab_size, dtype=torch.bool)
            mask[self.vocabulary.allowed(self.dfa, self.state)] = True
            if self.dfa.accepts(self.state):
                mask[list(self.vocabulary.eos_token_ids)] = True
            self.masks[self.state] = mask
        return self.masks[self.state]

    def advance(self, token_id: int) -> None:
        if token_id not in self.vocabulary.eos_token_ids:
            self.state = self.dfa.read(self.vocabulary.token_bytes[token_id], self.state)


class GuidanceConstraint:
    """JSONConstraint's contract on an llguidance matcher (llguidance compiles the schema itself)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32

    def mask(self) -> torch.Tensor:
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask)
        bits = (self.bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (V / 32, 32): bit j of word i
        return bits.bool().flatten()[: self.vocab_size]

    def advance(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)


def scan_keys(state: tuple, data: bytes) -> tuple[tuple, bool]:
    """(state after `data`, whether a key closed that its object already had). state: (bytes of the prefix
    still to skip, the open containers as (is_object, keys, a key comes next), the key being read or None)."""
    skip, stack, key = state
    in_string = escape = repeated = False
    if key is not None:  # inside a string: key holds (bytes so far, is_key, escape pending)
        in_string, (text, is_key, escape) = True, key
    for b in data:
        if skip:
            skip -= 1
        elif in_string:
            if escape or b not in b'\\"':
                text, escape = (text + bytes([b]) if is_key else text), False
            elif b == 0x5C:  # backslash: the next byte is escaped
                text, escape = (text + b"\\" if is_key else text), True
            else:  # the closing quote
                in_string = False
                if is_key:
                    name, (_, keys, _) = key_text(text), stack[-1]
                    repeated = repeated or name in keys
                    stack = (*stack[:-1], (True, keys | {name}, False))
        elif b == 0x22:  # an opening quote: a key if an object waits for one
            in_string, text, escape = True, b"", False
            is_key = bool(stack) and stack[-1][0] and stack[-1][2]
        elif b in b"{[":
            stack = (*stack, (b == 0x7B, frozenset(), b == 0x7B))
        elif b in b"}]":
            stack = stack[:-1]
        elif b == 0x2C and stack and stack[-1][0]:  # a comma in an object: a key comes next
            stack = (*stack[:-1], (True, stack[-1][1], True))
    return (skip, stack, (text, is_key, escape) if in_string else None), repeated


def key_text(raw: bytes) -> str:
    """A key's text with JSON's escapes read (\\u0061 and a are one key)."""
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw.decode("utf-8", "replace")


class UniqueKeys:
    """Any constraint, with no key written twice in one object: the keys are tracked beside the grammar
    (scan_keys), and a token that would close a key its object already has is masked out."""

    def __init__(self, inner, token_bytes: list[bytes], quoted: torch.Tensor, prefix: str):
        self.inner, self.token_bytes, self.quoted = inner, token_bytes, quoted  # quoted: (V,) bool, holds a '"'
        self.state = (len(prefix.encode()), (), None)

    def mask(self) -> torch.Tensor:
        mask = self.inner.mask()
        if not any(keys for is_object, keys, _ in self.state[1] if is_object):  # no key yet: none can repeat
            return mask
        candidates = (mask & self.quoted).nonzero().flatten().tolist()  # only a quote can close a key
        repeats = [t for t in candidates if scan_keys(self.state, self.token_bytes[t])[1]]
        if repeats:
            mask = mask.clone()  # the inner mask may be cached and shared
            mask[repeats] = False
        return mask

    def advance(self, token_id: int) -> None:
        self.inner.advance(token_id)
        if token_id < len(self.token_bytes):
            self.state = scan_keys(self.state, self.token_bytes[token_id])[0]


def validate_response_format(response_format) -> tuple[dict, str, str] | None:
    """OpenAI's response_format (or a pydantic model class) -> (schema, prefix, suffix), or None for free
    text; minillm's own type "tool_call" ({"schema", "prefix", "suffix"}) forces a function call."""
    if response_format is None:
        return None
    if hasattr(response_format, "model_json_schema"):  # a pydantic model
        return response_format.model_json_schema(), "", ""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in ("text", "json_object", "json_schema", "tool_call"):
        raise ValueError(f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, "
                         f"got {response_format!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}, "", ""
    spec = response_format if kind == "tool_call" else response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError("response_format json_schema needs {'name': ..., 'schema': {...}}")
    return spec["schema"], str(response_format.get("prefix", "")), str(response_format.get("suffix", ""))


def guidance_grammar(schema: dict, prefix: str, suffix: str, lltokenizer) -> str:
    """llguidance's grammar for prefix + JSON following `schema` (json.dumps' separators) + suffix."""
    if not isinstance(schema, dict):  # true, false: llguidance panics
        raise UnsupportedSchema(f"a schema must be a JSON object, got {schema!r}")
    try:
        if prefix or suffix:
            body = json.dumps({**schema, "x-guidance": {"item_separator": ", ", "key_separator": ": ",
                                                        "whitespace_flexible": False}})
            grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {json.dumps(prefix)} %json {body} {json.dumps(suffix)}")
        else:
            grammar = llguidance.JsonCompiler(separators=(", ", ": ")).compile(json.dumps(schema))  # keys in order
    except ValueError as exc:
        raise UnsupportedSchema(f"schema not supported: {exc}") from None
    except BaseException as exc:  # a Rust panic
        if type(exc).__name__ != "PanicException":
            raise
        raise UnsupportedSchema(f"schema not supported: llguidance failed on it ({exc})") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)
    if error:
        raise UnsupportedSchema(f"schema not supported: {error}")
    return grammar


class Constraints:
    """Each request's constraint, from backend "llguidance" (the default) or "minillm" (the DFA above)."""

    BACKENDS = ("llguidance", "minillm")

    def __init__(self, tokenizer, vocab_size: int, backend: str = "llguidance"):
        if backend not in self.BACKENDS:
            raise ValueError(f"constraint backend must be one of {self.BACKENDS}, got {backend!r}")
        self.tokenizer, self.vocab_size, self.backend = tokenizer, vocab_size, backend
        self.compiled: dict[str, object] = {}
        self._vocabulary = self._lltokenizer = self._keys = None

    def for_schema(self, schema: dict, prefix: str = "", suffix: str = "") -> UniqueKeys:
        """A fresh constraint for prefix + JSON following `schema` + suffix, no key twice in an object."""
        if self._keys is None:  # each token's bytes, and which hold a quote
            token_bytes = token_bytes_of(self.tokenizer, self.vocab_size)
            quoted = torch.zeros(self.vocab_size, dtype=torch.bool)
            quoted[[i for i, data in enumerate(token_bytes) if b'"' in data]] = True
            self._keys = (token_bytes, quoted)
        return UniqueKeys(self._inner(schema, prefix, suffix), *self._keys, prefix)

    def _inner(self, schema: dict, prefix: str, suffix: str):
        key = json.dumps([schema, prefix, suffix])  # not sorted: key order matters
        if self.backend == "minillm":
            if key not in self.compiled:
                self._vocabulary = self._vocabulary or Vocabulary(self.tokenizer, self.vocab_size)
                self.compiled[key] = (DFA(seq(lit(prefix), schema_pattern(schema), lit(suffix))), {})
            dfa, masks = self.compiled[key]
            return JSONConstraint(dfa, self._vocabulary, masks)
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                       eos_token=list(self.tokenizer.eos_token_ids))
        if key not in self.compiled:
            self.compiled[key] = guidance_grammar(schema, prefix, suffix, self._lltokenizer)
        return GuidanceConstraint(llguidance.LLMatcher(self._lltokenizer, self.compiled[key]), self.vocab_size)

    def for_format(self, response_format):
        """The constraint of an OpenAI response_format, or None for free text."""
        spec = validate_response_format(response_format)
        return None if spec is None else self.for_schema(*spec)
