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
import llguidance.numpy  # not llguidance.torch: its import compiles a kernel we never call (torch.compile)
import torch

from minillm.text.grammar import DFA, UnsupportedSchema, lit, schema_pattern, seq
from minillm.text.reasoning import END_THINK, THINK, closes_thinking, held_back

THINK_BYTES, END_THINK_BYTES, SEPARATOR = THINK.encode(), END_THINK.encode(), b"\n\n"  # SEPARATOR: after </think>
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}  # as json.dumps


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
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32
        self.words = torch.from_numpy(self.bitmask[0])  # (ceil(V / 32),) the same memory, seen by torch

    def mask(self) -> torch.Tensor:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask)
        bits = (self.words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (V / 32, 32): bit j of word i
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
    text; minillm's own type "tool_call" ({"schema", "prefix", "suffix"}) forces a function call (one that
    brings its own Lark grammar, {"lark": ...}, is None here: only Constraints compiles it)."""
    if response_format is None:
        return None
    if hasattr(response_format, "model_json_schema"):  # a pydantic model
        return response_format.model_json_schema(), "", ""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in ("text", "json_object", "json_schema", "tool_call"):
        raise ValueError(f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, "
                         f"got {response_format!r}")
    if kind == "text" or kind == "tool_call" and isinstance(response_format.get("lark"), str):
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
            body = json.dumps({**schema, "x-guidance": JSON_LAYOUT})
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
        return UniqueKeys(self._inner(schema, prefix, suffix), *self._token_bytes(), prefix)

    def _token_bytes(self) -> tuple[list[bytes], torch.Tensor]:
        if self._keys is None:  # each token's bytes, and which hold a quote
            token_bytes = token_bytes_of(self.tokenizer, self.vocab_size)
            quoted = torch.zeros(self.vocab_size, dtype=torch.bool)
            quoted[[i for i, data in enumerate(token_bytes) if b'"' in data]] = True
            self._keys = (token_bytes, quoted)
        return self._keys

    def _inner(self, schema: dict, prefix: str, suffix: str):
        key = json.dumps([schema, prefix, suffix])  # not sorted: key order matters
        if self.backend == "minillm":
            if key not in self.compiled:
                self._vocabulary = self._vocabulary or Vocabulary(self.tokenizer, self.vocab_size)
                self.compiled[key] = (DFA(seq(lit(prefix), schema_pattern(schema), lit(suffix))), {})
            dfa, masks = self.compiled[key]
            return JSONConstraint(dfa, self._vocabulary, masks)
        if key not in self.compiled:
            self.compiled[key] = guidance_grammar(schema, prefix, suffix, self._llguidance())
        return GuidanceConstraint(llguidance.LLMatcher(self._llguidance(), self.compiled[key]), self.vocab_size)

    def _llguidance(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                       eos_token=list(self.tokenizer.eos_token_ids))
        return self._lltokenizer

    def for_format(self, response_format, thinking: bool | None = None, budget: int | None = None,
                   prompt_ids=()):
        """The constraint of an OpenAI response_format, or None for free text. thinking (LLM.thinking of
        the prompt; None: the template does not think) puts the grammar after the reasoning, and budget
        (reasoning tokens, or None) ends the reasoning: ThinkingGate, below. A prompt that closed an empty
        thinking (enable_thinking=false) gets the grammar from the first token."""
        make = self._maker(response_format)  # compiled now: a bad format fails here
        if thinking is False and closes_thinking(self.tokenizer.decode(list(prompt_ids[-16:]))):
            thinking = None
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise ValueError(f"reasoning_budget must be an integer >= 0 (tokens of reasoning), got {budget!r}")
        if thinking is None or make is None and budget is None:
            return None if make is None else make()
        return ThinkingGate(make, self._token_bytes()[0], self.vocab_size, self.tokenizer.eos_token_ids,
                            self.compiled.setdefault("gate", {}), thinking, budget)

    def _maker(self, response_format):
        """A function making fresh constraints of the format, or None for free text."""
        if isinstance(response_format, dict) and isinstance(response_format.get("lark"), str):  # tool_calls' XML
            grammar = self._lark(response_format["lark"])
            return lambda: GuidanceConstraint(llguidance.LLMatcher(self._llguidance(), grammar), self.vocab_size)
        spec = validate_response_format(response_format)
        if spec is None:
            return None
        self._inner(*spec)  # compiles it (once per backend)
        return lambda: self.for_schema(*spec)

    def _lark(self, text: str) -> str:
        """A Lark grammar checked by llguidance (the minillm backend reads JSON schemas only)."""
        if self.backend == "minillm":
            raise UnsupportedSchema("the minillm backend follows JSON schemas only; this format is a Lark "
                                    "grammar (Qwen3.5's XML tool calls): use the llguidance backend")
        if text not in self.compiled:
            try:
                grammar = llguidance.LLMatcher.grammar_from_lark(text)
            except ValueError as exc:
                raise UnsupportedSchema(f"grammar not supported: {exc}") from None
            error = llguidance.LLMatcher.validate_grammar(grammar, self._llguidance())
            if error:
                raise UnsupportedSchema(f"grammar not supported: {error}")
            self.compiled[text] = grammar
        return self.compiled[text]


class ThinkingGate:
    """A thinking model's constraint: free reasoning until </think>, then the format's grammar (a fresh
    make_inner(); None: free text). States: "start" (the answer may still open <think>), "thinking",
    "closing" (text forced), "answer"; the steps between them are the functions below."""

    def __init__(self, make_inner, token_bytes: list[bytes], vocab_size: int, eos_token_ids, masks: dict,
                 thinking: bool, budget: int | None = None):
        self.make_inner, self.token_bytes, self.masks = make_inner, token_bytes, masks  # masks: shared cache
        self.free = masks.setdefault("free", torch.ones(vocab_size, dtype=torch.bool))
        self.reasoning = self.free if make_inner is None else masks.setdefault("no end", self.free.clone())
        self.reasoning[list(eos_token_ids)] = make_inner is None  # with a format the answer must reach it
        self.budget, self.spent, self.text, self.forced = budget, 0, b"", b""  # text: the last bytes read
        self.state, self.inner, self.inner_mask = "start", make_inner() if make_inner else None, None
        if thinking:  # the prompt opened <think>
            enter_thinking(self, b"")

    def mask(self) -> torch.Tensor:
        """(V,) bool: True where the token may come next."""
        if self.state == "start":  # the spellings of <think>, or the grammar's first tokens
            opening = spelling_mask(self, "open", self.text)
            if self.inner is None:
                return opening if self.make_inner else self.free
            self.inner_mask = self.inner.mask()  # kept: advance asks whether the token was the grammar's
            return opening | self.inner_mask
        if self.state == "closing":
            return spelling_mask(self, "force", self.forced)
        return self.reasoning if self.state == "thinking" else self.free if self.inner is None else self.inner.mask()

    def advance(self, token_id: int) -> None:
        data = self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""
        if self.state == "start":
            read_start(self, token_id, data)
        elif self.state == "thinking":
            self.spent += 1
            read_reasoning(self, data)
        elif self.state == "closing":
            self.forced = self.forced[len(data):]
            if not self.forced:
                enter_answer(self)
        elif self.inner is not None:
            self.inner.advance(token_id)


def read_start(g: ThinkingGate, token_id: int, data: bytes) -> None:
    """The first tokens: <think> opened (reasoning), still possible, or not (the answer, under the grammar)."""
    if g.inner is not None and (g.inner_mask if g.inner_mask is not None else g.inner.mask())[token_id]:
        g.inner.advance(token_id)
    else:
        g.inner = None
    text = (g.text + data).lstrip()
    if text.startswith(THINK_BYTES):
        enter_thinking(g, text[len(THINK_BYTES):])
    elif THINK_BYTES.startswith(text):
        g.text = text
    else:
        g.state = "answer"


def enter_thinking(g: ThinkingGate, text: bytes) -> None:
    g.state, g.inner, g.text = "thinking", None, b""
    read_reasoning(g, text)


def read_reasoning(g: ThinkingGate, data: bytes) -> None:
    """Reasoning text: </think> ends it (then a grammar waits for the separator); so does the budget."""
    g.text += data
    at = g.text.find(END_THINK_BYTES)
    if at >= 0:
        after = g.text[at + len(END_THINK_BYTES):]
        g.forced, g.state = SEPARATOR[len(after):] if g.make_inner and SEPARATOR.startswith(after) else b"", "closing"
        if not g.forced:
            enter_answer(g)
    elif g.budget is not None and g.spent >= g.budget:  # finish a </think> begun, else write it all
        begun = held_back(g.text, END_THINK_BYTES)
        g.forced, g.state = (END_THINK_BYTES[begun:] if begun else b"\n" + END_THINK_BYTES) + SEPARATOR, "closing"
    g.text = g.text[-len(END_THINK_BYTES):]


def enter_answer(g: ThinkingGate) -> None:
    g.state, g.inner = "answer", g.make_inner() if g.make_inner else None


def spelling_mask(g: ThinkingGate, kind: str, text: bytes) -> torch.Tensor:
    """The tokens that keep an opening <think> possible after `text` (kind "open") or spell a beginning
    of the forced `text` ("force"); kept per text, shared by every request."""
    if (kind, text) not in g.masks:
        mask = torch.zeros_like(g.free)
        if kind == "open":
            ok = [i for i, b in enumerate(g.token_bytes) if b and opens(text + b)]
        else:
            ok = [i for i, b in enumerate(g.token_bytes) if b and text.startswith(b)]
        mask[ok] = True
        g.masks[kind, text] = mask
    return g.masks[kind, text]


def opens(text: bytes) -> bool:
    """Whether text, leading whitespace aside, begins <think> (or is it, and more): whitespace alone does
    not, or a token of it would lead a grammar that takes none into thinking."""
    text = text.lstrip()
    return bool(text) and (THINK_BYTES.startswith(text) or text.startswith(THINK_BYTES))
