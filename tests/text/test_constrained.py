"""Structured outputs (minillm/text/grammar.py, minillm/text/constrained.py): the from-scratch DFA against json and jsonschema, its
token masks against llguidance's, and sampled SmolLM2 answers that always validate."""

import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.api import LLM
from minillm.runtime.generate import apply_constraints
from minillm.text.constrained import Constraints, validate_response_format
from minillm.text.grammar import DFA, MAX_DEPTH, UnsupportedSchema, any_json, schema_pattern
from minillm.runtime.generate import generate_batch
from minillm.runtime.sampling import SamplingParams

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", None]}, "nickname": {"type": "string", "maxLength": 12}}}
SCHEMAS = {  # five schemas: nested objects, enums, arrays, optional properties, every scalar type
    "person": PERSON,
    "team": {"type": "object", "additionalProperties": False, "required": ["team", "members"],
             "properties": {"team": {"type": "string", "maxLength": 20},
                            "members": {"type": "array", "minItems": 1, "maxItems": 3, "items": PERSON}}},
    "review": {"type": "object", "additionalProperties": False, "required": ["stars", "verdict", "tags"],
               "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "verdict": {"enum": ["good", "bad", "mixed"]},
                              "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}}}},
    "flags": {"type": "object", "additionalProperties": False, "required": ["ok", "note", "count"],
              "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 30},
                             "count": {"anyOf": [{"type": "integer", "minimum": -50, "maximum": 1000}, {"const": "many"}]}}},
    "point": {"type": "object", "additionalProperties": False, "required": ["where"],
              "properties": {"where": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                       "properties": {"x": {"type": "integer", "minimum": -999, "maximum": 999},
                                                      "y": {"type": "integer", "minimum": -999, "maximum": 999}}}}},
}
READING = {"type": "object", "additionalProperties": False, "required": ["value", "count"],  # not sampled: unbounded
           "properties": {"value": {"type": "number"}, "count": {"type": "integer"}}}    # numbers ramble at T=1
VALID = {
    "person": [{"name": "Ann", "age": 31, "pet": "cat"}, {"name": "Bo \"B\" \u00e9\u4e2d", "age": 120, "pet": None,
                                                          "nickname": "b"}],
    "team": [{"team": "red", "members": [{"name": "A", "age": 0, "pet": "dog"}]}],
    "review": [{"stars": 4, "verdict": "mixed", "tags": []}, {"stars": 1, "verdict": "bad", "tags": ["x", "y"]}],
    "flags": [{"ok": True, "note": None, "count": -50}, {"ok": False, "note": "n\\n", "count": "many"}],
    "point": [{"where": {"x": 0, "y": -999}}, {"where": {"x": 125, "y": 7}}],
    "reading": [{"value": -1.5e-3, "count": 0}, {"value": 12, "count": -7}, {"value": 0.25, "count": 31}],
}
INVALID = {  # each breaks one rule of its schema
    "person": ['{"name": "Ann", "age": 31}', '{"name": "Ann", "age": 3.5, "pet": "cat"}',
               '{"name": "Ann", "age": 31, "pet": "cow"}',
               '{"name": "' + "x" * 25 + '", "age": 1, "pet": "cat"}', '{"name": "Ann", "age": 031, "pet": "cat"}'],
    "team": ['{"team": "red", "members": []}', '{"team": "red", "members": [' + ", ".join(
        ['{"name": "A", "age": 0, "pet": "dog"}'] * 4) + "]}"],
    "review": ['{"stars": 6, "verdict": "good", "tags": []}', '{"stars": 4, "verdict": "good", "tags": [1]}'],
    "flags": ['{"ok": 1, "note": null, "count": 3}', '{"ok": true, "note": null, "count": "few"}',
              '{"ok": true, "note": null, "count": -51}'],
    "point": ['{"where": {"x": 0}}', '{"where": {"x": 0, "y": 1, "z": 2}}', '{"where": {"x": 1000, "y": 1}}'],
    "reading": ['{"value": 4., "count": 1}', '{"value": .5, "count": 1}', '{"value": 1, "count": 1.5}',
                '{"value": 01, "count": 1}'],
}
CHECKED = {**SCHEMAS, "reading": READING}


@pytest.mark.parametrize("name", CHECKED)
def test_dfa_accepts_exactly_the_schemas_texts(name):
    dfa = DFA(schema_pattern(CHECKED[name]))
    for value in VALID[name]:
        text = json.dumps(value, ensure_ascii=False)
        jsonschema.validate(value, CHECKED[name])  # the examples themselves are right
        assert dfa.accepts(dfa.read(text.encode())), text
        assert not dfa.accepts(dfa.read(text[:-1].encode()))  # a prefix is not a whole value
    for text in INVALID[name]:
        assert not dfa.accepts(dfa.read(text.encode())), text
        with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(text), CHECKED[name])  # the counter-examples are really wrong


def test_properties_come_in_the_schemas_order():
    """Valid JSON with the properties reordered is not produced: the pattern writes them as listed
    (OpenAI's structured outputs do the same), so one schema has one spelling per value."""
    dfa = DFA(schema_pattern(PERSON))
    assert not dfa.accepts(dfa.read(b'{"age": 31, "name": "Ann", "pet": "cat"}'))
    jsonschema.validate({"age": 31, "name": "Ann", "pet": "cat"}, PERSON)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=8)
ANY = DFA(any_json())


def depth(value) -> int:
    if isinstance(value, (list, dict)):
        children = value.values() if isinstance(value, dict) else value
        return 1 + max((depth(c) for c in children), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_json_accepts_what_json_dumps_writes(value):
    text = json.dumps(value, ensure_ascii=False)
    assert ANY.accepts(ANY.read(text.encode())) == (depth(value) <= MAX_DEPTH)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]":, 0123456789.-eEtrufalsn\\', max_size=14))
def test_any_json_accepts_only_json(text):
    if ANY.accepts(ANY.read(text.encode())):
        json.loads(text)  # every accepted text parses


@pytest.fixture(scope="module")
def backends(smollm2):
    model, tok = smollm2
    return {name: Constraints(tok, model.config.vocab_size, name) for name in Constraints.BACKENDS}


@pytest.mark.parametrize("name", CHECKED)
def test_masks_equal_llguidance_but_where_explained(smollm2, backends, name):
    """Along each valid example's tokens, both masks allow the same tokens, with two explained
    differences: llguidance lets only the tokenizer's own spelling through where the text is forced
    (ours allows every spelling, so llguidance's mask is then one token), and it forbids the DEL byte
    0x7F in strings, which JSON allows."""
    _, tok = smollm2
    for value in VALID[name]:
        ids = tok.encode(json.dumps(value, ensure_ascii=False)) + [tok.eos_token_ids[0]]
        ours, theirs = backends["minillm"].for_schema(CHECKED[name]), backends["llguidance"].for_schema(CHECKED[name])
        for token in ids:
            a, b = ours.mask(), theirs.mask()
            assert a[token] and b[token]
            assert not (b & ~a).any(), "llguidance allows a token the DFA forbids"
            extra = (a & ~b).nonzero().flatten().tolist()
            if extra and b.sum() > 1:
                assert all(0x7F in tok.token_bytes(t) for t in extra), [tok.token_bytes(t) for t in extra[:5]]
            ours.advance(token)
            theirs.advance(token)


def test_masks_are_cached_per_state(smollm2, backends):
    c = backends["minillm"].for_schema(SCHEMAS["point"])
    first = c.mask()
    again = backends["minillm"].for_schema(SCHEMAS["point"]).mask()
    assert again is first  # one walk of the vocabulary per DFA state, shared by every request


PROMPTS = {"person": "Describe a person.", "team": "Describe a small team.", "review": "Review a film.",
           "flags": "Report a status.", "point": "Give a point on a map."}


def sampled(smollm2, name, constraints, n, max_new_tokens=256):  # room to spare for long sampled answers
    model, tok = smollm2
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[name] + " Answer in JSON."}])
    outs = generate_batch(model, tok, [prompt] * n, SamplingParams(temperature=1.0, seed=0), max_new_tokens=max_new_tokens,
                          constraints=constraints)
    return [tok.decode(o, skip_special_tokens=True) for o in outs]


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("name", SCHEMAS)
def test_fifty_sampled_answers_all_validate(smollm2, backends, name):
    schema = SCHEMAS[name]
    texts = sampled(smollm2, name, [backends["llguidance"].for_schema(schema) for _ in range(50)], 50)
    assert all(validates(t, schema) for t in texts), [t for t in texts if not validates(t, schema)][:3]


def test_without_the_constraint_answers_fail(smollm2):
    """The same requests unconstrained: a measurable share is not valid (the constraint is what makes them)."""
    texts = sampled(smollm2, "person", None, 50, max_new_tokens=80)  # a person in JSON takes about 30
    assert sum(not validates(t, PERSON) for t in texts) >= 10


def test_the_from_scratch_backend_samples_valid_answers(smollm2, backends):
    texts = sampled(smollm2, "review", [backends["minillm"].for_schema(SCHEMAS["review"]) for _ in range(8)], 8)
    assert all(validates(t, SCHEMAS["review"]) for t in texts), texts


def test_llm_chat_takes_response_format(smollm2):
    model, tok = smollm2
    llm = LLM(model, tok)
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": SCHEMAS["point"]}}
    out = llm.chat([{"role": "user", "content": "A point?"}], SamplingParams(temperature=1.0, seed=1),
                   response_format=fmt, max_new_tokens=60)
    assert validates(out.text, SCHEMAS["point"]) and out.finish_reason == "stop"
    obj = llm.chat([{"role": "user", "content": "Is the sky blue? Answer as a JSON object with the key answer."}],
                   response_format={"type": "json_object"}, max_new_tokens=60)
    assert isinstance(json.loads(obj.text), dict) and obj.finish_reason == "stop"
    with pytest.raises(ValueError, match="speculative"):
        llm.chat([{"role": "user", "content": "x"}], response_format=fmt, speculative="ngram")


def test_a_pydantic_model_is_a_response_format():
    pydantic = pytest.importorskip("pydantic", reason="pydantic comes with fastapi, in requirements.txt")

    class Point(pydantic.BaseModel):
        x: float
        y: float

    schema, prefix, suffix = validate_response_format(Point)
    assert prefix == suffix == "" and schema["required"] == ["x", "y"] and schema["properties"]["x"]["type"] == "number"


@pytest.mark.parametrize("schema, feature", [
    ({"type": "string", "pattern": "a+"}, "pattern"), ({"type": "object", "properties": {"a": {"$ref": "#/x"}}}, "$ref"),
    ({"type": "integer", "minimum": 3}, "minimum"), ({"type": "number", "minimum": 0, "maximum": 1}, "integer"),
    ({"type": "integer", "minimum": 3, "maximum": 2}, "above"), ({"type": "date"}, "date"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}, "additionalProperties"),
    ({"type": "string", "maxLength": 1000}, "maxLength"), ({"enum": []}, "enum")])
def test_unsupported_schemas_name_the_feature(backends, schema, feature):
    with pytest.raises(UnsupportedSchema, match=feature.replace("$", r"\$")):
        backends["minillm"].for_schema(schema)


@pytest.mark.parametrize("schema, words", [({"type": "date"}, "date"), ({"$ref": "#/nowhere"}, "nowhere")])
def test_llguidance_errors_name_the_problem(backends, schema, words):
    with pytest.raises(UnsupportedSchema, match=words):
        backends["llguidance"].for_schema(schema)


@pytest.mark.parametrize("fmt", [{"type": "xml"}, "json", {"type": "json_schema"}, {"type": "json_schema",
                                                                                    "json_schema": {"name": "x"}}])
def test_bad_response_formats(fmt):
    with pytest.raises(ValueError, match="response_format"):
        validate_response_format(fmt)


def test_apply_constraints_masks_only_constrained_rows(smollm2, backends):
    model, _ = smollm2
    logits = torch.zeros(2, model.config.vocab_size)
    out = apply_constraints(logits, [backends["llguidance"].for_schema(SCHEMAS["point"]), None])
    assert torch.isinf(out[0]).sum() > 0 and not torch.isinf(out[1]).any()
    assert apply_constraints(logits, [None, None]) is logits
