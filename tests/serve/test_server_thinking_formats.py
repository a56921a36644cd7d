"""A thinking model's structured answers through the server and the openai client: response_format and a
forced tool call with thinking on (the grammar after </think>, notebook 14's ThinkingGate), the server's
reasoning_budget, and Qwen3.5's XML calls chosen from its template, whole and streamed.

The model is the embedded SmolLM2 behind Qwen3.5's real chat template (data/llama-cpp-vocab/templates/
Qwen3.5-4B.jinja), whose prompt opens <think>. SmolLM2 never closes it on its own, so without a budget
its whole answer would be reasoning; the server's budget closes it, and the content after it is held to
the schema by jsonschema, the call's arguments to the function's parameters. Each streamed answer must
join to the whole answer of the same greedy request.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from minillm.serve.server import BackgroundServer, create_app
from support import QWEN35_TEMPLATE, with_chat_template

MODEL = "smollm2"
ASK = [{"role": "user", "content": "Who wrote Hamlet? Answer as JSON."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "born"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "born": {"type": "integer", "minimum": 1000,
                                                                              "maximum": 2100}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["C", "F"]}}}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def client(smollm2):
    background = BackgroundServer(create_app(with_chat_template(smollm2, QWEN35_TEMPLATE), model_name=MODEL,
                                             num_blocks=64, reasoning_budget=10))
    yield openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    background.stop()


def ask(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=90, temperature=0, **kwargs)


def joined(chunks) -> tuple[str, str, dict, str]:
    """(reasoning, content, {index: [name, arguments]}, finish_reason) of a stream."""
    reasoning, content, calls, finish = [], [], {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta, finish = choice.delta, choice.finish_reason or finish
            reasoning.append((delta.model_extra or {}).get("reasoning") or "")
            content.append(delta.content or "")
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
    return "".join(reasoning), "".join(content), calls, finish


def test_json_after_the_reasoning(client):
    message = ask(client, response_format=FORMAT).choices[0].message
    extra = message.model_extra or {}
    assert extra["reasoning"] and extra["reasoning"] == extra["reasoning_content"]
    jsonschema.validate(json.loads(message.content), PERSON)
    reasoning, content, calls, finish = joined(ask(client, response_format=FORMAT, stream=True))
    assert (reasoning, content, calls, finish) == (extra["reasoning"], message.content, {}, "stop")


def test_a_forced_xml_call_after_the_reasoning(client):
    done = ask(client, tools=[WEATHER], tool_choice="required")
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and (choice.message.model_extra or {}).get("reasoning")
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    reasoning, content, calls, finish = joined(ask(client, tools=[WEATHER], tool_choice="required", stream=True))
    assert calls == {0: ["get_weather", call.function.arguments]} and finish == "tool_calls"
    assert reasoning == choice.message.model_extra["reasoning"] and not content.strip()


def test_a_bad_budget_fails_at_start_up(smollm2):
    with pytest.raises(ValueError, match="reasoning_budget must be an integer >= 0"):
        create_app(with_chat_template(smollm2, QWEN35_TEMPLATE), reasoning_budget=-2)
