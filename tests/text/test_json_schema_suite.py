"""JSON-Schema-Test-Suite (draft 2020-12, data/json-schema-test-suite/) through both constraint backends.

For every group, each backend compiles the schema or refuses it by name (UnsupportedSchema). For an
accepted schema, every instance of the group, written as json.dumps writes it, is walked token by
token through the backend's mask: each token must be allowed, then the end token. A walk that gets
through is an *accepted* instance; the suite marks each instance valid or invalid. A backend may be
stricter than the schema (it writes one key order, json.dumps' separators, the properties it knows),
but an accepted invalid instance is *unsound*: the engine could generate it. There must be none.

The tokenizer is a small byte-level BPE (tests/support.py's tokenizer_gguf: 256 byte tokens and a
few merged words): the masks are the real ones, computed over a vocabulary small enough to walk the
whole suite in seconds. Counts per backend are printed (pytest -s) for the closing notes."""

from __future__ import annotations

import json
import time

import pytest

from support import DATA, tokenizer_gguf
from minillm.text.constrained import Constraints, JSONConstraint
from minillm.text.grammar import UnsupportedSchema
from minillm.text.tokenizer import Tokenizer

SUITE = DATA / "json-schema-test-suite" / "draft2020-12"
GROUPS = [(path.stem, i, group) for path in sorted(SUITE.glob("*.json"))
          for i, group in enumerate(json.loads(path.read_text(encoding="utf-8")))]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_gguf(tokenizer_gguf(tmp_path_factory.mktemp("vocab") / "tiny.gguf"))


def accepts(constraint, tokenizer: Tokenizer, text: str) -> bool:
    """Whether the mask lets `text`'s tokens through, one by one, and then the end token."""
    for token in tokenizer.encode(text):
        if not constraint.mask()[token]:
            return False
        constraint.advance(token)
    return bool(constraint.mask()[tokenizer.eos_token_ids[0]])


def run_suite(tokenizer: Tokenizer, backend: str) -> dict:
    counts = {"groups": 0, "refused": 0, "accepted": 0, "instances": 0, "valid_accepted": 0,
              "valid_rejected": 0, "invalid_rejected": 0, "unsound": [], "slowest_compile_s": 0.0}
    constraints = Constraints(tokenizer, tokenizer.vocab_size, backend)
    for name, i, group in GROUPS:
        counts["groups"] += 1
        start = time.perf_counter()
        try:
            constraints.for_schema(group["schema"])
        except UnsupportedSchema:
            counts["refused"] += 1
            continue
        counts["slowest_compile_s"] = max(counts["slowest_compile_s"], time.perf_counter() - start)
        counts["accepted"] += 1
        for test in group["tests"]:
            counts["instances"] += 1
            ok = accepts(constraints.for_schema(group["schema"]), tokenizer, json.dumps(test["data"], ensure_ascii=False))
            if ok and not test["valid"]:
                counts["unsound"].append(f"{name}[{i}] {group['description']}: {test['description']}")
            kind = ("valid_" if test["valid"] else "invalid_") + ("accepted" if ok else "rejected")
            counts[kind] = counts.get(kind, 0) + 1
    print(f"\n{backend}: " + json.dumps({k: len(v) if isinstance(v, list) else v for k, v in counts.items()}))
    return counts


@pytest.mark.parametrize("backend", Constraints.BACKENDS)
def test_no_backend_accepts_an_instance_the_suite_marks_invalid(tokenizer, backend):
    counts = run_suite(tokenizer, backend)
    assert counts["unsound"] == [], counts["unsound"][:20]
    assert counts["accepted"] >= {"llguidance": 150, "minillm": 40}[backend], counts  # the suite is really run
    assert counts["valid_accepted"] > counts["accepted"], counts  # and most valid instances pass


def test_a_boolean_schema_is_refused_by_name_by_both_backends(tokenizer):
    """llguidance's compiler panicked (PanicException, not an Exception) on `true` and `false`."""
    for backend in Constraints.BACKENDS:
        for schema in (True, False):
            with pytest.raises(UnsupportedSchema, match="a schema must be a JSON object"):
                Constraints(tokenizer, tokenizer.vocab_size, backend).for_schema(schema)


@pytest.mark.parametrize("schema, invalid", [
    ({"type": "object", "additionalProperties": False}, {"a": 1}),
    ({"type": "string", "enum": ["a", 1]}, 1),
    ({"type": "integer", "minimum": 0, "maximum": 5, "enum": [3, 9]}, 9),
    ({"const": "abc", "maxLength": 2}, None),
    ({"type": "string", "minLength": 2}, "😀"),
], ids=["additionalProperties false", "enum beside type", "enum beside maximum", "const beside maxLength",
        "minLength counts code points"])
def test_the_automaton_follows_every_keyword_beside_another(tokenizer, schema, invalid):
    """From the issue's probe: the own automaton accepted each of these invalid instances (or, for the
    const, compiled a schema that nothing satisfies). Now it rejects the instance or refuses the schema."""
    constraints = Constraints(tokenizer, tokenizer.vocab_size, "minillm")
    try:
        constraint = constraints.for_schema(schema)
    except UnsupportedSchema as exc:
        assert "no value is valid" in str(exc)
        return
    assert invalid is not None and not accepts(constraint, tokenizer, json.dumps(invalid, ensure_ascii=False))


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "minLength": 3, "maxLength": 2}, "minLength 3 is above maxLength 2: no value is valid"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3 is above maxItems 1: no value is valid"),
    ({"type": "string", "enum": [1, 2]}, "no value of the enum passes the schema's other keywords"),
    ({"anyOf": [{"type": "string"}], "maxLength": 2}, "with no other keyword beside it"),
])
def test_an_unsatisfiable_or_unsupported_combination_is_refused_by_name(tokenizer, schema, message):
    with pytest.raises(UnsupportedSchema, match=message):
        Constraints(tokenizer, tokenizer.vocab_size, "minillm").for_schema(schema)


def test_the_mask_is_empty_after_a_forbidden_token(tokenizer):
    """The dead state leads nowhere: before, stepping from it read another state's set (sets[-1])."""
    constraint = Constraints(tokenizer, tokenizer.vocab_size, "minillm").for_schema({"type": "boolean"})
    assert isinstance(constraint.inner, JSONConstraint)
    constraint.advance(tokenizer.encode("x")[0])
    assert not constraint.mask().any()


def test_json_object_compiles_in_under_a_second(tokenizer):
    """{"type": "object"} (response_format json_object) built 352,226 NFA nodes in over 10 s; a list
    is now one copy of its item with a loop back through ", "."""
    start = time.perf_counter()
    constraint = Constraints(tokenizer, tokenizer.vocab_size, "minillm").for_schema({"type": "object"})
    assert accepts(constraint, tokenizer, json.dumps({"a": [1, {"b": None}], "c": "d"}))
    assert time.perf_counter() - start < 1.0


def test_schemas_that_differ_only_in_key_order_keep_their_own_order(tokenizer):
    """The compiled-schema cache was keyed by sort_keys JSON: the second schema got the first's order."""
    constraints = Constraints(tokenizer, tokenizer.vocab_size, "llguidance")
    ab = {"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}}, "required": ["a", "b"]}
    ba = {**ab, "properties": {"b": {"type": "null"}, "a": {"type": "null"}}}
    assert accepts(constraints.for_schema(ab), tokenizer, '{"a": null, "b": null}')
    assert accepts(constraints.for_schema(ba), tokenizer, '{"b": null, "a": null}')
