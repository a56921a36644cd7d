"""A thinking model's grammar after </think>, and the reasoning budget (notebook 14's ThinkingGate).

The gate is held to the constraint it wraps: while thinking nothing is masked, in the forced close only
the spellings of the forced text, and after </think> its mask is exactly the mask of a fresh constraint
of the same format (llguidance's, the reference) at the same place. End to end, the embedded SmolLM2 runs
behind Qwen3.5's real chat template (its prompt opens <think>): the answer's reasoning comes apart
(notebook 10's parser), and the content after it follows the schema (checked by jsonschema).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from minillm.runtime.sampling import SamplingParams
from minillm.text.constrained import Constraints, ThinkingGate
from support import QWEN35_TEMPLATE, with_chat_template

FORMAT = {"type": "json_object"}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 130}}}


@pytest.fixture(scope="module")
def made(smollm2):
    model, tok = smollm2
    return Constraints(tok, model.config.vocab_size), tok


def feed(constraint, tok, text: str) -> None:
    """Advance through `text`'s tokens, each one allowed by the mask before it."""
    for token in tok.encode(text):
        assert constraint.mask()[token], f"{tok.decode([token])!r} masked out"
        constraint.advance(token)


def spelled(constraint, tok, steps: int) -> str:
    """What the mask forces: each step the longest allowed token (the forced text has one spelling per step)."""
    out = []
    for _ in range(steps):
        allowed = constraint.mask().nonzero().flatten().tolist()
        token = max(allowed, key=lambda t: len(tok.token_bytes(t)))
        out.append(tok.decode([token]))
        constraint.advance(token)
    return "".join(out)


def test_free_while_thinking_then_the_grammar_from_its_start(made):
    lib, tok = made
    gate = lib.for_format(FORMAT, thinking=True)
    assert isinstance(gate, ThinkingGate)
    feed(gate, tok, "Plain words, not JSON: the user wants {an object}")
    allowed = gate.mask()
    assert int(allowed.sum()) == len(allowed) - len(set(tok.eos_token_ids))  # nothing masked but the end: JSON is due
    assert bool(lib.for_format(None, thinking=True, budget=9).mask().all())  # no format: the answer may end
    feed(gate, tok, "</think>")
    assert gate.state == "closing"
    assert all(b"\n\n".startswith(tok.token_bytes(t)) for t in gate.mask().nonzero().flatten().tolist())
    assert spelled(gate, tok, 1) == "\n\n" and gate.state == "answer"
    fresh = lib.for_format(FORMAT)  # the reference: the format's own constraint, from its start
    assert bool((gate.mask() == fresh.mask()).all())
    for token in tok.encode('{"a": 1'):
        gate.advance(token)
        fresh.advance(token)
    assert bool((gate.mask() == fresh.mask()).all())


def test_budget_forces_the_close(made):
    lib, tok = made
    gate = lib.for_format(FORMAT, thinking=True, budget=4)
    feed(gate, tok, "one two three four")  # four tokens of reasoning
    assert gate.state == "closing"
    assert not gate.mask()[tok.eos_token_ids[0]]
    assert spelled(gate, tok, 8).startswith("\n</think>\n\n") and gate.state == "answer"
    half = lib.for_format(None, thinking=True, budget=3)  # no format: the budget alone
    feed(half, tok, "so </th")
    assert half.state == "closing"  # a </think> begun is finished, not written twice
    assert spelled(half, tok, 6).startswith("ink>\n\n")
    assert bool(half.mask().all())  # then free text
    assert lib.for_format(FORMAT, thinking=None, budget=4).__class__.__name__ == "UniqueKeys"  # no thinking: no gate
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="reasoning_budget must be an integer >= 0"):
            lib.for_format(FORMAT, thinking=True, budget=bad)


def test_an_answer_may_open_its_own_thinking_or_not(made):
    lib, tok = made
    opening = lib.for_format(FORMAT, thinking=False)  # the template thinks, the prompt left no <think> open
    mask = opening.mask()
    assert mask[tok.encode("{")[0]] and mask[tok.encode("<")[0]] and not mask[tok.encode("Hello")[0]]
    feed(opening, tok, "<think>\nhmm")
    assert opening.state == "thinking"
    direct = lib.for_format(FORMAT, thinking=False)
    feed(direct, tok, '{"')
    assert direct.state == "answer"
    fresh = lib.for_format(FORMAT)
    feed(fresh, tok, '{"')
    assert bool((direct.mask() == fresh.mask()).all())  # the grammar saw the same tokens
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=false's prompt
    assert not isinstance(lib.for_format(FORMAT, thinking=False, prompt_ids=closed), ThinkingGate)


@pytest.fixture(scope="module")
def qwen35(smollm2):
    return with_chat_template(smollm2, QWEN35_TEMPLATE)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3)],
                         ids=["greedy", "sampled"])
def test_schema_after_the_reasoning_end_to_end(qwen35, params):
    ask = [{"role": "user", "content": "Who wrote Hamlet, and how old did he get? Answer as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    answer = qwen35.chat(ask, params, response_format=fmt, reasoning_budget=12, max_new_tokens=80)
    assert answer.reasoning  # the free part, split off by notebook 10's parser
    jsonschema.validate(json.loads(answer.text), PERSON)
    assert answer.finish_reason == "stop"
    off = qwen35.chat(ask, params, response_format=fmt, chat_template_kwargs={"enable_thinking": False},
                      reasoning_budget=12, max_new_tokens=80)  # the prompt closed an empty <think>
    jsonschema.validate(json.loads(off.text), PERSON)
