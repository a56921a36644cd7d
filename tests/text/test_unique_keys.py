"""No key twice (minillm/text/constrained.py's scan_keys and UniqueKeys) and closed forced-call arguments
(minillm/text/tool_calls.py's closed_arguments), notebook 14.

scan_keys is held to Python's json on generated JSON texts cut at random places; UniqueKeys' mask on both
backends removes exactly the tokens that would repeat a key, and those tokens are ones the grammar alone
allows (so the check can fail); closed_arguments against jsonschema. The user's case through the server
is in tests/serve/test_server_structured.py.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.runtime.generate import generate_batch
from minillm.runtime.sampling import SamplingParams
from minillm.text.constrained import Constraints, scan_keys
from minillm.text.tool_calls import closed_arguments

KEYS = st.sampled_from(["a", "b", "city", "\u00e9t\u00e9", "x\"y"])  # few names: repeats are common
SCALAR = st.one_of(st.integers(-5, 5), st.booleans(), st.none(), st.text("ab\\\"{},:[] ", max_size=4))


def pairs_json(value) -> str:
    """JSON text of nested lists of (key, value) pairs (objects, repeats allowed) and lists (arrays)."""
    if isinstance(value, tuple):  # ("obj", pairs)
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=ascii_)}: {pairs_json(v)}"
                               for k, v, ascii_ in value[1]) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(pairs_json(v) for v in value) + "]"
    return json.dumps(value)


VALUES = st.recursive(SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.lists(st.tuples(KEYS, inner, st.booleans()), max_size=4).map(lambda pairs: ("obj", pairs))), max_leaves=12)


def has_repeat(text: str) -> bool:
    """Python's json on the same text: whether some object has a key twice."""
    found = []

    def hook(pairs):
        keys = [k for k, _ in pairs]
        found.append(len(keys) != len(set(keys)))
        return dict(pairs)

    json.loads(text, object_pairs_hook=hook)
    return any(found)


@settings(max_examples=300, deadline=None)
@given(VALUES, st.lists(st.integers(0, 200), max_size=6), st.text("<>ab\n", max_size=5))
def test_scan_keys_finds_the_repeats_json_finds(value, cuts, prefix):
    """Any JSON (keys escaped or not, nested), after a prefix, fed in arbitrary pieces: a repeat is seen
    exactly when json's object_pairs_hook sees one."""
    text = pairs_json(value)
    data = prefix.encode() + text.encode()
    state, repeated, start = (len(prefix.encode()), (), None), False, 0
    for cut in sorted(c % (len(data) + 1) for c in cuts) + [len(data)]:
        state, r = scan_keys(state, data[start:cut])
        repeated, start = repeated or r, cut
    assert repeated == has_repeat(text) and state[1] == () and state[2] is None, text


@pytest.fixture(scope="module")
def constraints(smollm2):
    model, tok = smollm2
    return {backend: Constraints(tok, model.config.vocab_size, backend) for backend in Constraints.BACKENDS}


@pytest.mark.parametrize("backend", Constraints.BACKENDS)
def test_the_mask_removes_exactly_the_repeating_tokens(constraints, smollm2, backend):
    """After {"city": "Paris", "city in an object open to any key, the grammar allows the tokens that close
    the key (the planted case: without UniqueKeys they would pass); the wrapper removes those and nothing
    else: the key may still grow ("cityscape")."""
    _, tok = smollm2
    made = constraints[backend]
    c = made.for_format({"type": "json_object"})
    for token in tok.encode('{"city": "Paris", "city'):
        c.advance(token)
    inner, outer = c.inner.mask(), c.mask()
    token_bytes, _ = made._keys
    closing = {t for t in inner.nonzero().flatten().tolist() if t < len(token_bytes) and token_bytes[t][:1] == b'"'}
    assert closing, "the grammar allows no closing quote here: the check would prove nothing"
    assert set((inner & ~outer).nonzero().flatten().tolist()) == closing
    assert not (outer & ~inner).any() and outer.sum() > 0


@pytest.mark.parametrize("backend", Constraints.BACKENDS)
def test_sampled_free_objects_never_repeat_a_key(constraints, smollm2, backend):
    """json_object answers of the embedded model, sampled: all parse, none repeats a key."""
    model, tok = smollm2
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a JSON object with the key \"a\" five "
                                       "times, each with a different number."}], add_generation_prompt=True)
    made = constraints[backend]
    outs = generate_batch(model, tok, [prompt] * 8, SamplingParams(temperature=1.0, seed=3), max_new_tokens=48,
                          constraints=[made.for_format({"type": "json_object"}) for _ in range(8)])
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in outs]
    for text in texts:
        try:
            assert not has_repeat(text), text
        except json.JSONDecodeError:  # cut by max_new_tokens: the prefix must still have no repeat
            assert not scan_keys((0, (), None), text.encode())[1], text


def test_closed_arguments_closes_what_lists_properties():
    schema = {"type": "object", "required": ["city"],
              "properties": {"city": {"type": "string"}, "where": {"type": "object", "properties": {"x": {}}},
                             "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {}}}},
                             "free": {"type": "object"}, "open": {"type": "object", "properties": {"y": {}},
                                                                   "additionalProperties": True}},
              "$defs": {"p": {"properties": {"q": {}}}}}
    schema["properties"]["shape"] = {"anyOf": [{"type": "object", "properties": {"r": {}}}, {"type": "string"}]}
    closed = closed_arguments(schema)
    ok = {"city": "Paris", "where": {"x": 1}, "tags": [{"t": 1}], "free": {"any": 1}, "open": {"y": 1, "z": 2},
          "shape": {"r": 1}}
    jsonschema.validate(ok, closed)
    for extra in ({**ok, "unit": "C"}, {**ok, "where": {"x": 1, "z": 2}}, {**ok, "tags": [{"t": 1, "u": 2}]},
                  {**ok, "shape": {"r": 1, "s": 2}}):
        jsonschema.validate(extra, schema)  # the function's own schema takes it
        with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
            jsonschema.validate(extra, closed)
    assert closed["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["free"]  # no properties listed: it allows more
    assert schema["properties"]["where"] == {"type": "object", "properties": {"x": {}}}  # the caller's is not changed
    for parts in ({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},  # closing each part, or the
                  {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}], "additionalProperties": True}):
        assert closed_arguments(parts) == parts  # branch beside the properties, would reject {"a": .., "b": ..}
    assert closed_arguments(None) == {"type": "object", "properties": {}, "additionalProperties": False}


def test_a_forced_call_without_parameters_is_empty_arguments(smollm2):
    model, tok = smollm2
    from minillm.text.tool_calls import call_format, encode_with_tools, parse_tool_calls, validate_tools
    tools, choice = validate_tools([{"type": "function", "function": {"name": "now"}}], "required")
    ids = encode_with_tools(tok, [{"role": "user", "content": "What time is it?"}], tools)
    made = Constraints(tok, model.config.vocab_size)
    out = generate_batch(model, tok, [ids], max_new_tokens=40, constraints=[made.for_format(call_format(tools, choice))])
    _, calls = parse_tool_calls(tok.decode(out[0], skip_special_tokens=True))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("now", "{}")]
    assert torch.is_tensor(made._keys[1])
