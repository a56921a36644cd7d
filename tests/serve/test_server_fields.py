"""Every request field does what it says or is refused by name (issue 52): unknown fields get
OpenAI's 400 (with --lenient: logged, answered); fields the server does not do get a 400 whose
`error.param` names them; the ones it does (top_logprobs, a json_schema's name and schema,
parallel_tool_calls) follow OpenAI's rules; an answer cut inside a character does not end in
U+FFFD; vLLM's /tokenize and /detokenize agree with the tokenizer and with the completions' usage."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from minillm.api import LLM
from minillm.runtime.engine import Output
from minillm.runtime.generate import TextStream
from minillm.serve.fields import CHAT_FIELDS, REFUSED_WHEN, TEXT_FIELDS
from minillm.serve.openai_protocol import Reply, answer_text, cut_char, output_events
from minillm.serve.server import BackgroundServer, create_app

MODEL = "smollm2"
HELLO = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 3, "temperature": 0}
TEXT = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def servers(smollm2):
    llm = LLM(*smollm2)
    strict, lenient = (BackgroundServer(create_app(llm, model_name=MODEL, num_blocks=32, lenient=flag))
                       for flag in (False, True))
    with httpx.Client(base_url=strict.url, timeout=60) as a, httpx.Client(base_url=lenient.url, timeout=60) as b:
        yield llm, a, b
    strict.stop()
    lenient.stop()


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


def test_unknown_fields_are_refused_as_openai_does_and_logged_with_lenient(servers, caplog):
    _, strict, lenient = servers
    for path, body in (("/v1/chat/completions", HELLO), ("/v1/completions", TEXT)):
        message = refused(strict.post(path, json={**body, "not_an_openai_field": 1}), "not_an_openai_field")
        assert message == "Unrecognized request argument supplied: 'not_an_openai_field'"
        with caplog.at_level(logging.WARNING, logger="minillm.serve"):
            assert lenient.post(path, json={**body, "not_an_openai_field": 1}).status_code == 200
        assert "not_an_openai_field" in caplog.text
    refused(strict.post("/v1/completions", json={**TEXT, "messages": []}), "messages")  # chat's field, not here
    refused(strict.post("/v1/completions", json={**TEXT, "top_logprobs": 2}), "top_logprobs")


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "suffix", " The end."), ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "functions", [WEATHER["function"]]), ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "store", True), ("/v1/chat/completions", "service_tier", "flex"),
    ("/v1/chat/completions", "reasoning_effort", "extreme"), ("/v1/chat/completions", "prediction",
                                                           {"type": "content", "content": "Hello"}),
    ("/v1/chat/completions", "web_search_options", {}), ("/v1/chat/completions", "verbosity", "low")])
def test_a_field_the_server_does_not_do_is_a_400_naming_it(servers, path, field, value):
    _, strict, lenient = servers
    base = HELLO if "chat" in path else TEXT
    refused(strict.post(path, json={**base, field: value}), field)
    refused(lenient.post(path, json={**base, field: value}), field)  # lenient is for unknown fields only


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "suffix", ""), ("/v1/completions", "echo", False), ("/v1/chat/completions", "logit_bias", {}),
    ("/v1/chat/completions", "modalities", ["text"]), ("/v1/chat/completions", "store", False),
    ("/v1/chat/completions", "service_tier", "auto"), ("/v1/chat/completions", "user", "alice"),
    ("/v1/chat/completions", "metadata", {"run": "1"}), ("/v1/chat/completions", "audio", None),
    ("/v1/completions", "echo", True), ("/v1/completions", "logprobs", 2), ("/v1/completions", "logit_bias", {"504": 1}),
    ("/v1/chat/completions", "logit_bias", {"504": -100})])  # served since issue 52 (test_server_completions.py)
def test_the_values_that_ask_for_nothing_more_are_answered(servers, path, field, value):
    _, strict, _ = servers
    assert strict.post(path, json={**(HELLO if "chat" in path else TEXT), field: value}).status_code == 200


def test_the_table_refuses_by_value_only_fields_it_knows():
    assert set(REFUSED_WHEN) <= set(CHAT_FIELDS) | set(TEXT_FIELDS)
    assert "suffix" not in CHAT_FIELDS and "messages" not in TEXT_FIELDS and "top_logprobs" not in TEXT_FIELDS


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "file-1"}}])
def test_image_audio_and_file_parts_are_refused_naming_the_part(servers, part):
    _, strict, _ = servers
    content = [{"type": "text", "text": "What is this?"}, part]
    message = refused(strict.post("/v1/chat/completions", json={**HELLO, "messages": [
        {"role": "user", "content": content}]}), "messages")
    assert "messages[0].content[1]" in message and part["type"] in message


def test_top_logprobs_needs_logprobs(servers):
    _, strict, _ = servers
    assert "logprobs: true" in refused(strict.post("/v1/chat/completions", json={**HELLO, "top_logprobs": 2}),
                                       "top_logprobs")
    r = strict.post("/v1/chat/completions", json={**HELLO, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def test_a_json_schema_needs_its_name_and_not_its_schema(servers):
    _, strict, _ = servers
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    for name in (None, "", "has space", "x" * 65):
        fmt = {"type": "json_schema", "json_schema": {"schema": schema, **({"name": name} if name is not None else {})}}
        refused(strict.post("/v1/chat/completions", json={**HELLO, "response_format": fmt}),
                "response_format.json_schema.name")
    r = strict.post("/v1/chat/completions", json={**HELLO, "max_tokens": 24, "response_format": {
        "type": "json_schema", "json_schema": {"name": "anything"}}})
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]
    if answer["finish_reason"] == "stop":  # any JSON object (as json_object); a cut one is only a prefix
        assert isinstance(json.loads(answer["message"]["content"]), dict)
    else:
        assert answer["message"]["content"].lstrip().startswith("{")


def test_parallel_tool_calls_false_keeps_one_call(servers):
    _, strict, _ = servers
    two = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    weather = [{"type": "function", "function": {"name": "get_weather"}}]  # the tools offered
    both = Reply(True, MODEL, 5, tools=weather).choice(two, "stop")["message"]["tool_calls"]
    one = Reply(True, MODEL, 5, tools=weather, one_call=True).choice(two, "stop")
    assert len(both) == 2 and one["finish_reason"] == "tool_calls"
    assert [c["function"] for c in one["message"]["tool_calls"]] == [both[0]["function"]]  # ids are random
    body = {**HELLO, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40,
            "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    r = strict.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["tool_calls"]) == 1
    refused(strict.post("/v1/chat/completions", json={**body, "parallel_tool_calls": "no"}), "parallel_tool_calls")


def test_an_answer_cut_inside_a_character_drops_it_instead_of_ending_in_u_fffd(smollm2):
    """The real decoder's end: 日 is two tokens (e6 97 | a5); max_tokens 1 stops after the first, and
    the decoder's flush turns its two bytes into U+FFFD. The answer drops them, whole or streamed."""
    _, tok = smollm2
    first, second = tok.encode("日")
    assert tok.token_bytes(first) == b"\xe6\x97" and cut_char(b"\xe6\x97") and not cut_char("日".encode())
    text, finish = TextStream(tok, 3, 1, 100, []).push(first)
    assert (text, finish) == ("\ufffd", "length")  # what the engine sends at the end
    assert answer_text(Reply(True, MODEL, 3), Output(0, first, text, True, finish), tok) == ""
    events = output_events(Output(0, first, text, True, finish), Reply(True, MODEL, 3), tok, logprobs=False)
    assert "\\ufffd" not in "".join(events) and '"finish_reason": "length"' in events[-1]
    stream = TextStream(tok, 3, 2, 100, [])
    whole = [stream.push(first), stream.push(second)]
    reply = Reply(True, MODEL, 3)
    assert "".join(answer_text(reply, Output(0, t, s, f is not None, f), tok) for t, (s, f) in zip((first, second), whole)) == "日"
    model_fffd = tok.encode("\ufffd")  # a U+FFFD the model writes whole is its text, and stays
    assert answer_text(Reply(True, MODEL, 3), Output(0, model_fffd[-1], "\ufffd", True, "length"), tok) == "\ufffd"


def test_tokenize_and_detokenize_in_vllms_shapes(servers):
    llm, strict, _ = servers
    text = "Once upon a time, 日本."
    r = strict.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == llm.tokenizer.encode(text, add_special_tokens=True) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == strict.get("/v1/models").json()["data"][0]["max_model_len"]
    assert len(r["token_strs"]) == r["count"] and r["token_strs"][0] == "Once"
    assert strict.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": text}
    chat = strict.post("/tokenize", json={"messages": HELLO["messages"]}).json()
    usage = strict.post("/v1/chat/completions", json=HELLO).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"] and chat["token_strs"] is None
    assert strict.post("/tokenize", json={"model": "gpt-4o", "prompt": "hi"}).json()["error"]["code"] == "model_not_found"
    refused(strict.post("/detokenize", json={"tokens": [1, -1]}), "tokens")
    refused(strict.post("/tokenize", json={"prompt": "hi", "truncate": 3}), "truncate")
    refused(strict.post("/tokenize", json={"messages": HELLO["messages"], "add_generation_prompt": False}),
            "add_generation_prompt")
    refused(strict.post("/tokenize", json={}), "prompt")
