"""The request schema, walked (issue 51): every field the server reads on /v1/chat/completions and
/v1/completions, one at a time, replaced by a hostile value (each wrong type, huge, empty, null, a
lone surrogate, nested wrong types), and the spec's fields the server refuses or ignores (issue 52) and an
unknown one. Each request must answer 200, or 400 whose `error.param` names
the field (the field itself, a field around it, or one inside it), or for `model` the documented 404
`model_not_found`; never a 5xx, and never slower than REQUEST_SECONDS. A live server on 127.0.0.1,
through httpx; SmolLM2 answers, two tokens at a time, in a context of 256 tokens."""

from __future__ import annotations

import copy
import json
import re
import time

import httpx
import pytest

from minillm.api import LLM
from minillm.serve.server import BackgroundServer, create_app

MODEL = "smollm2"
REQUEST_SECONDS = 30.0  # each request's bound, over loopback: a hang fails the case, not the run
MEGA = "x" * (2 << 20)  # a 2 MiB string: the app takes bodies up to 8 MiB here, so it reaches the checks

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
        "max_tokens": 2, "temperature": 0, "top_p": 1, "seed": 1, "presence_penalty": 0, "frequency_penalty": 0,
        "stop": ["\n\n"], "n": 1, "stream": False, "stream_options": {"include_usage": False}, "logprobs": True,
        "top_logprobs": 0, "ignore_eos": False}  # top_logprobs needs logprobs: true (a 400 otherwise, as OpenAI)
TOOLS = {**CHAT, "messages": [{"role": "user", "content": "Weather in Paris?"},
                              {"role": "assistant", "content": None, "tool_calls": [CALL]},
                              {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}],
         "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
FORMAT = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
    "name": "point", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}}}
TEXT = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "top_p": 1, "seed": 1,
        "presence_penalty": 0, "frequency_penalty": 0, "stop": ["\n\n"], "n": 1, "best_of": 1, "stream": False,
        "stream_options": {"include_usage": False}, "ignore_eos": False}

# (base body, the paths of the fields the server reads in it); a path absent from the base is added
CHAT_FIELDS = [(CHAT, ["model", "messages", "messages[1]", "messages[1].role", "messages[1].content",
                       "messages[1].content[0]", "messages[1].content[0].type", "messages[1].content[0].text",
                       "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "presence_penalty",
                       "frequency_penalty", "stop", "stop[0]", "n", "best_of", "stream", "stream_options",
                       "stream_options.include_usage", "logprobs", "top_logprobs", "ignore_eos", "response_format",
                       "tools", "tool_choice", "parallel_tool_calls", "logit_bias", "modalities", "audio", "store",
                       "service_tier", "user", "metadata", "functions", "not_an_openai_field"]),
               (TOOLS, ["messages[0].content", "messages[1].content", "messages[1].tool_calls",
                        "messages[1].tool_calls[0]", "messages[1].tool_calls[0].function",
                        "messages[1].tool_calls[0].function.name", "messages[1].tool_calls[0].function.arguments",
                        "messages[2].content", "tools", "tools[0]", "tools[0].type", "tools[0].function",
                        "tools[0].function.name", "tools[0].function.description", "tools[0].function.parameters",
                        "tools[0].function.parameters.properties", "tool_choice", "tool_choice.type",
                        "tool_choice.function", "tool_choice.function.name", "parallel_tool_calls"]),
               (FORMAT, ["response_format", "response_format.type", "response_format.json_schema",
                         "response_format.json_schema.name", "response_format.json_schema.schema",
                         "response_format.json_schema.schema.properties"])]
TEXT_FIELDS = [({**TEXT, "prompt": ["Once upon a time"]}, ["prompt", "prompt[0]"]),
               ({**TEXT, "prompt": [9707, 11, 1090]}, ["prompt", "prompt[0]", "prompt[1]"]),  # token ids
               (TEXT, ["model", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                       "seed", "presence_penalty", "frequency_penalty", "stop", "n", "best_of", "stream",
                       "stream_options", "stream_options.include_usage", "logprobs", "ignore_eos", "response_format",
                       "tools", "tool_choice", "suffix", "echo", "logit_bias", "user", "not_an_openai_field"])]


def hostile(valid) -> dict[str, object]:
    """The values each field is replaced by, by name: wrong types, huge, empty, null, lone surrogates,
    nested wrong types; a list field also gets 10,000 copies of its own first element."""
    values = {"null": None, "true": True, "zero": 0, "minus one": -1, "one and a half": 1.5, "string": "x",
              "list of a number": [1], "object": {"a": 1}, "1e308": 1e308, "-1e308": -1e308, "2**70": 2**70,
              "-2**70": -2**70, "NaN": float("nan"), "Infinity": float("inf"), "2 MiB string": MEGA,
              "10,000 numbers": [1] * 10_000, "10,000 keys": {f"k{i}": i for i in range(10_000)},
              "empty string": "", "empty list": [], "empty object": {}, "lone surrogate": "\ud800",
              "surrogate in a list": ["\udfff"], "surrogate as a key": {"\ud800": 1},
              "nested lists": [[[None]]], "object of lists": {"a": [None, {"b": []}]}}
    if isinstance(valid, list) and valid:
        values["10,000 of its element"] = valid[:1] * 10_000
    return values


STEP = re.compile(r"\.?([A-Za-z_]\w*)|\[(\d+)\]")


def steps(path: str) -> list:
    return [name if name else int(index) for name, index in STEP.findall(path)]


def replaced(base: dict, path: str, value) -> dict:
    body = copy.deepcopy(base)
    *outer, last = steps(path)
    target = body
    for step in outer:
        target = target[step]
    target[last] = value
    return body


def valid_at(base: dict, path: str):
    value = base
    for step in steps(path):
        try:
            value = value[step]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def names(param, path: str) -> bool:
    """`param` names the field at `path`: the field itself, one around it, or one inside it."""
    if not isinstance(param, str):
        return False
    return any(a == b or a.startswith(b + ".") or a.startswith(b + "[") for a, b in ((path, param), (param, path)))


def outcome(status: int, error: dict | None, path: str) -> str | None:
    """Which accepted answer this is, or None if it breaks the rule. Besides a 200 and a 400 naming the
    field: a 400 naming a field that refers to this one, and saying so (`tool_choice needs tools`); a
    prompt grown past the context, which OpenAI names `messages` (or `prompt`) with the code
    context_length_exceeded whichever part of it grew; and an unknown model's documented 404."""
    root, error = steps(path)[0], error or {"param": None, "message": "", "code": None}
    if status == 200:
        return "200"
    if status == 400 and names(error["param"], path):
        return "400 naming the field"
    if status == 400 and isinstance(error["param"], str) and re.search(rf"\b{root}\b", error["message"]):
        return "400 naming the field it refers to"
    if status == 400 and error["code"] == "context_length_exceeded" and root in ("messages", "tools", "prompt"):
        return "400 context_length_exceeded"
    if status == 404 and root == "model" and error["code"] == "model_not_found":
        return "404 model_not_found"
    return None


@pytest.fixture(scope="module")
def live(smollm2):
    app = create_app(LLM(*smollm2), model_name=MODEL, num_blocks=16, max_body_bytes=8 << 20, request_timeout=5.0)
    background = BackgroundServer(app)
    with httpx.Client(base_url=background.url, timeout=REQUEST_SECONDS) as client:
        yield client
    background.stop()


def walk(client: httpx.Client, endpoint: str, fields) -> tuple[dict[str, int], list[str]]:
    """Send every (field, hostile value) once; the counts of each outcome and the cases that broke the rule."""
    counts, broken = {"requests": 0}, []
    for base, paths in fields:
        for path in paths:
            for what, value in hostile(valid_at(base, path)).items():
                data = json.dumps(replaced(base, path, value))  # ensure_ascii: a surrogate travels as \ud800
                start = time.monotonic()
                try:
                    r = client.post(endpoint, content=data, headers={"Content-Type": "application/json"})
                except httpx.TimeoutException:
                    broken.append(f"{path} = {what}: no answer in {REQUEST_SECONDS} s")
                    continue
                seconds, counts["requests"] = time.monotonic() - start, counts["requests"] + 1
                error = r.json().get("error") if r.headers.get("content-type") == "application/json" else None
                kind = outcome(r.status_code, error, path)
                if kind is None:
                    broken.append(f"{path} = {what}: {r.status_code} {r.text[:200]}")
                else:
                    counts[kind] = counts.get(kind, 0) + 1
                assert seconds < REQUEST_SECONDS
    return counts, broken


@pytest.mark.parametrize("endpoint, fields", [("/v1/chat/completions", CHAT_FIELDS), ("/v1/completions", TEXT_FIELDS)],
                         ids=["chat", "completions"])
def test_every_field_replaced_by_hostile_values_is_a_200_or_a_400_naming_it(live, endpoint, fields, capsys):
    """The counts are printed; the last request, a valid one, shows that none of them harmed the server."""
    counts, broken = walk(live, endpoint, fields)
    with capsys.disabled():
        print(f"\n{endpoint}: {counts}")
    assert not broken, f"{len(broken)} of {counts['requests']} cases broke the rule:\n" + "\n".join(broken[:40])
    assert counts.get("200") and counts.get("400 naming the field", 0) > counts["requests"] // 2
    assert live.get("/health").json()["in_flight"] == 0 and live.post(endpoint, json=fields[0][0]).status_code == 200
