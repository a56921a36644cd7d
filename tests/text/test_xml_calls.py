"""Qwen3.5's XML tool calls (notebook 14): read whole and streamed, forced by grammar, chosen from the template.

The reference is Qwen3.5's real chat template (data/llama-cpp-vocab/templates/Qwen3.5-4B.jinja): it renders
an assistant turn's tool_calls in the format the model was trained on, and what minillm reads back from
that rendering must be the arguments the template was given, typed by the tools' schemas. The stream
(notebook 18's ToolCallStream) must send fragments that join to the whole answer's arguments, however
the text is cut. A forced call (the Lark grammar) is run on the embedded SmolLM2 behind that template,
greedy and sampled, and its arguments are held to the function's schema by jsonschema.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from minillm.runtime.sampling import SamplingParams
from minillm.serve.tool_stream import ToolCallStream
from minillm.text.constrained import Constraints
from minillm.text.grammar import UnsupportedSchema
from minillm.text.tool_calls import call_format, call_style, parse_tool_calls, read_xml_call, tools_template
from support import QWEN35_TEMPLATE, with_chat_template

PLAN = {"type": "function", "function": {"name": "plan_trip", "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "budget": {"type": "number"},
                   "hotel": {"type": "boolean"}, "stops": {"type": "array", "items": {"type": "string"}},
                   "prefs": {"type": "object"}, "note": {"type": "string"}}}}}
ARGUMENTS = {"city": "New York", "days": 3, "budget": 1250.5, "hotel": True, "stops": ["MoMA", "Central Park"],
             "prefs": {"food": "vegan", "max_walk_km": 4}, "note": "two lines:\nfirst < second, a & b"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["C", "F"]}}}}}


@pytest.fixture(scope="module")
def qwen35(smollm2):
    return with_chat_template(smollm2, QWEN35_TEMPLATE)


def rendered_calls(llm, calls: list[dict]) -> str:
    """The assistant turn as Qwen3.5's template writes it, from <tool_call> to the end of the turn."""
    messages = [{"role": "user", "content": "Plan it."},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c} for c in calls]}]
    text = llm.tokenizer.chat_text(messages, add_generation_prompt=False, tools=[PLAN, WEATHER])
    turn = text[text.rindex("<|im_start|>assistant"):]
    return turn[turn.index("<tool_call>"):turn.rindex("<|im_end|>")]


def test_the_template_chooses_the_style(qwen35, smollm2):
    assert call_style(tools_template(qwen35.tokenizer)) == "xml"
    assert call_style(tools_template(smollm2[1])) == "json"  # SmolLM2's own template: Hermes JSON in the prompt


def test_what_the_template_writes_reads_back(qwen35):
    text = rendered_calls(qwen35, [{"name": "plan_trip", "arguments": ARGUMENTS},
                                   {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}])
    assert "<function=plan_trip>" in text and "<parameter=days>\n3\n</parameter>" in text
    content, calls = parse_tool_calls(text, [PLAN, WEATHER])
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["plan_trip", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == ARGUMENTS
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    untyped = json.loads(parse_tool_calls(text, [])[1][0]["function"]["arguments"])  # no schemas: JSON if it reads
    assert untyped["days"] == 3 and untyped["city"] == "New York" and untyped["hotel"] == "True"


@pytest.mark.parametrize("body", [
    "<function=plan_trip>\n<parameter=city>\nRome\n</parameter>\n",  # never closed
    "<function=plan_trip>\n<parameter=city>\nRome\n</parameter>\n<parameter=city>\nOslo\n</parameter>\n</function>",
    "<function=plan_trip>\n<city>Rome</city>\n</function>",
    "<function=plan_trip>\n</function>\ntrailing words",
])
def test_a_block_that_is_not_a_call_stays_text(body):
    assert read_xml_call(body, [PLAN]) is None
    text = f"Sure.\n<tool_call>\n{body}\n</tool_call>"
    assert parse_tool_calls(text, [PLAN]) == (text, [])


@pytest.mark.parametrize("seed", range(6))
def test_streamed_fragments_join_to_the_whole_answer(qwen35, seed):
    text = "Let me check.\n\n" + rendered_calls(qwen35, [{"name": "plan_trip", "arguments": ARGUMENTS},
                                                       {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "F"}}])
    rng, stream, content, calls, at = random.Random(seed), ToolCallStream(tools=[PLAN, WEATHER]), "", {}, 0
    while at < len(text):
        step = rng.randint(1, 9)
        sent, deltas = stream.feed(text[at:at + step])
        at += step
        content += sent
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d.get("function", {}).get("name") or call["name"]
            call["arguments"] += d["function"].get("arguments", "")
    more, last, finish = stream.end("stop")
    whole_content, whole_calls = parse_tool_calls(text, [PLAN, WEATHER])
    assert (content + more).strip() == whole_content and finish == "tool_calls" and not last
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]


def test_the_forced_grammar_compiles_for_odd_names_and_refuses_the_dfa(smollm2):
    model, tok = smollm2
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ['a "quoted" \\ key'],
                                                                        "properties": {'a "quoted" \\ key': {"type": "string"}}}}}
    fmt = call_format([odd], "required", style="xml")
    assert re.search(r"%json|/", fmt["lark"])
    Constraints(tok, model.config.vocab_size).for_format(fmt)  # llguidance compiles it
    with pytest.raises(UnsupportedSchema, match="llguidance"):
        Constraints(tok, model.config.vocab_size, backend="minillm").for_format(fmt)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=11)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("budget", [None, 8])
def test_a_forced_xml_call_is_well_formed(qwen35, params, budget):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    thinking = {"reasoning_budget": budget} if budget is not None else {"chat_template_kwargs": {"enable_thinking": False}}
    answer = qwen35.chat(ask, params, tools=[WEATHER], tool_choice="required", max_new_tokens=120, **thinking)
    assert answer.finish_reason == "stop", answer
    (call,) = answer.tool_calls
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    assert (answer.reasoning is not None) == (budget is not None)
