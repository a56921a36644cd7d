"""Every body the server returns, held to OpenAI's own OpenAPI spec (issue 52): the schemas of the
endpoints served, extracted from github.com/openai/openai-openapi into data/openai-openapi/schemas.json
(its README names the commit), and validated with jsonschema (draft 2020-12, as OpenAPI 3.1 writes
them). Whole answers, every chunk of streams, n > 1, logprobs, tool calls, structured outputs, text
completions, the model list and one model, and error bodies of each status. The request side too:
every request field of the spec is one the server's field table knows (supported or refused by
name), and the bodies these tests send are valid requests by the spec."""

from __future__ import annotations

import copy
import json

import httpx
import jsonschema
import openai
import pytest
from referencing import Registry
from referencing.jsonschema import DRAFT202012
from support import DATA

from minillm.api import LLM
from minillm.serve.fields import CHAT_FIELDS, TEXT_FIELDS
from minillm.serve.server import BackgroundServer, create_app

MODEL = "smollm2"


def with_null(schema):
    """OpenAPI 3.0's `nullable: true`, which the spec still writes in places, as JSON Schema says it:
    null is one more allowed value (in `type` and `enum`, or as an `anyOf` branch beside a `$ref`)."""
    if isinstance(schema, list):
        return [with_null(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {k: with_null(v) for k, v in schema.items()}
    if schema.pop("nullable", False) is not True:
        return schema
    if "enum" in schema and None not in schema["enum"]:
        schema["enum"] = [*schema["enum"], None]
    if isinstance(schema.get("type"), str):
        schema["type"] = [schema["type"], "null"]
        return schema
    return {"anyOf": [schema, {"type": "null"}]}


SPEC = with_null(json.loads((DATA / "openai-openapi" / "schemas.json").read_text(encoding="utf-8")))


def completion_chunk(schemas: dict) -> dict:
    """The spec has no schema for a /v1/completions stream chunk: it says a chunk is the completion
    object, whose finish_reason may not be null, while OpenAI's own streams send `finish_reason: null`
    on every chunk before a choice's last. The whole answer's schema with that one difference."""
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    reason["type"], reason["enum"] = [reason["type"], "null"], [*reason["enum"], None]
    return chunk


def echo_answer(schemas: dict) -> dict:
    """The spec types a completion's `token_logprobs` as numbers and `top_logprobs` as objects, while
    OpenAI's own echo answers send null for the first prompt token (nothing predicts it), as this server
    does: the whole answer's schema with null allowed there, and nothing else changed."""
    answer = copy.deepcopy(schemas["CreateCompletionResponse"])
    logprobs = answer["properties"]["choices"]["items"]["properties"]["logprobs"]["anyOf"][0]["properties"]
    for name in ("token_logprobs", "top_logprobs"):
        logprobs[name]["items"] = {"anyOf": [logprobs[name]["items"], {"type": "null"}]}
    return answer


SPEC["components"]["schemas"]["CompletionStreamChunk"] = completion_chunk(SPEC["components"]["schemas"])
SPEC["components"]["schemas"]["CompletionEchoResponse"] = echo_answer(SPEC["components"]["schemas"])
REGISTRY = Registry().with_resource("urn:openai", DRAFT202012.create_resource(SPEC))


def validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{name}"}, registry=REGISTRY)


def violations(name: str, body) -> list[str]:
    """Each way `body` breaks the spec's schema `name`: the path inside the body and jsonschema's message."""
    return [f"{name} at /{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
            for e in validator(name).iter_errors(body)]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
HELLO = [{"role": "user", "content": "Say hello."}]
CHATS = {  # whole answers and streams of each of these; stream_options is added for streams
    "plain": {"messages": HELLO, "max_tokens": 6, "temperature": 0},
    "n=2": {"messages": HELLO, "max_tokens": 4, "n": 2, "seed": 3},
    "logprobs": {"messages": HELLO, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    "tool call": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40, "temperature": 0,
                  "tools": [WEATHER], "tool_choice": "required"},
    "tools offered": {"messages": HELLO, "max_tokens": 6, "temperature": 0, "tools": [WEATHER]},
    "json_schema": {"messages": HELLO, "max_tokens": 12, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {
            "x": {"type": "integer"}}, "required": ["x"]}}}},
}
TEXTS = {
    "plain": {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0},
    "n=2 of best_of=3": {"prompt": "Once upon a time", "max_tokens": 4, "n": 2, "best_of": 3, "seed": 1},
    "token ids": {"prompt": [9707, 11, 1090], "max_tokens": 3, "temperature": 0},
    "logprobs": {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "logprobs": 2},
    "logit_bias": {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "logit_bias": {"504": -100}},
    "echo, logprobs, n=2": {"prompt": "Once upon a time", "max_tokens": 3, "n": 2, "seed": 1, "echo": True,
                            "logprobs": 3},
    "echo, max_tokens 0": {"prompt": [[9707, 11, 1090]], "max_tokens": 0, "temperature": 0, "echo": True, "logprobs": 1},
}
NOT_STREAMED = ("best_of", "echo", "logprobs")  # best_of > n, echo and completions' logprobs: whole answers only
ERRORS = [  # (method, path, body, status)
    ("POST", "/v1/chat/completions", {"messages": []}, 400),
    ("POST", "/v1/chat/completions", {"messages": HELLO, "temperature": 9}, 400),
    ("POST", "/v1/chat/completions", {"messages": HELLO, "not_an_openai_field": 1}, 400),
    ("POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": HELLO}, 404),
    ("POST", "/v1/completions", {"prompt": "hi", "suffix": "end"}, 400),
    ("GET", "/v1/models/gpt-4o", None, 404),
    ("GET", "/v1/nowhere", None, 404),
    ("GET", "/v1/chat/completions", None, 405),
]


@pytest.fixture(scope="module")
def live(smollm2):
    background = BackgroundServer(create_app(LLM(*smollm2), model_name=MODEL, num_blocks=32))
    with httpx.Client(base_url=background.url, timeout=60) as client:
        yield client
    background.stop()


def events(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """A stream's events as JSON, in order, after checking its SSE framing: `data: ` lines, each
    followed by a blank line, ending in `data: [DONE]`."""
    r = client.post(path, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    blocks = r.text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]", r.text[-200:]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks[:-1])
    return [json.loads(b[len("data: "):]) for b in blocks[:-2]]


def answers(client: httpx.Client) -> list[tuple[str, str, object]]:
    """(what, schema name, body) for every kind of body the server returns."""
    out = []
    for path, cases, whole, chunk in (("/v1/chat/completions", CHATS, "CreateChatCompletionResponse",
                                       "CreateChatCompletionStreamResponse"),
                                      ("/v1/completions", TEXTS, "CreateCompletionResponse", "CompletionStreamChunk")):
        for what, body in cases.items():
            r = client.post(path, json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
            out.append((f"{path} {what}", "CompletionEchoResponse" if body.get("echo") else whole, r.json()))
            if chunk == "CreateChatCompletionStreamResponse" or not set(NOT_STREAMED) & set(body):
                stream = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
                out += [(f"{path} {what}, stream chunk {i}", chunk, e) for i, e in enumerate(events(client, path, stream))]
    out.append(("GET /v1/models", "ListModelsResponse", client.get("/v1/models").json()))
    out.append(("GET /v1/models/{id}", "Model", client.get(f"/v1/models/{MODEL}").json()))
    for method, path, body, status in ERRORS:
        r = client.request(method, path, json=body)
        assert r.status_code == status, (path, body, r.text)
        out.append((f"{method} {path} {body} -> {status}", "ErrorResponse", r.json()))
    return out


def test_every_body_the_server_returns_is_valid_by_openais_spec(live):
    bodies = answers(live)
    broken = [f"{what}: {v}" for what, name, body in bodies for v in violations(name, body)]
    assert len(bodies) > 60 and not broken, "\n".join(broken[:40])
    kinds = {name for _, name, _ in bodies}
    assert len(kinds) == 8  # each response schema of the endpoints served was used
    chunks = [b for what, name, b in bodies if name == "CreateChatCompletionStreamResponse"]
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    assert any(c["choices"] and c["choices"][0].get("logprobs") for c in chunks)
    whole = dict((what, body) for what, _, body in bodies)
    assert whole["/v1/chat/completions tool call"]["choices"][0]["finish_reason"] == "tool_calls"
    assert whole["/v1/chat/completions plain"]["choices"][0]["message"]["refusal"] is None
    assert whole["/v1/chat/completions logprobs"]["choices"][0]["logprobs"]["refusal"] is None
    echoed = whole["/v1/completions echo, logprobs, n=2"]["choices"]
    assert [c["logprobs"]["token_logprobs"][0] for c in echoed] == [None, None]
    assert violations("CreateCompletionResponse", whole["/v1/completions echo, max_tokens 0"])  # the one difference
    assert not violations("CreateCompletionResponse", whole["/v1/completions logprobs"])


def test_the_check_catches_what_the_spec_requires():
    """The validator is not vacuous: an answer without `message.refusal`, with a finish_reason outside
    the enum, or a model without `owned_by` breaks the spec (what issue 52 measured before the fix)."""
    answer = {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi", "refusal": None}, "logprobs": None,
         "finish_reason": "stop"}]}
    assert violations("CreateChatCompletionResponse", answer) == []
    del answer["choices"][0]["message"]["refusal"]
    assert violations("CreateChatCompletionResponse", answer)
    answer["choices"][0]["message"]["refusal"] = None
    answer["choices"][0]["finish_reason"] = "shutdown"
    assert violations("CreateChatCompletionResponse", answer)
    assert violations("Model", {"id": MODEL, "object": "model", "created": 0})


def test_the_request_bodies_sent_here_are_valid_by_the_spec():
    for name, cases in (("CreateChatCompletionRequest", CHATS), ("CreateCompletionRequest", TEXTS)):
        for what, body in cases.items():
            assert violations(name, {"model": MODEL, **body}) == [], what


def spec_fields(name: str) -> set[str]:
    """The request fields the spec lists for one endpoint (its allOf parts merged)."""
    schema, names = SPEC["components"]["schemas"][name], set()
    for part in schema.get("allOf", [schema]):
        names |= spec_fields(part["$ref"].split("/")[-1]) if "$ref" in part else set(part.get("properties", {}))
    return names


def test_every_request_field_of_the_spec_is_in_the_servers_field_table():
    """The table (minillm/serve/fields.py) says of each field: supported, or refused by name. A field
    the spec adds later fails here until the table says what the server does with it."""
    assert spec_fields("CreateChatCompletionRequest") <= set(CHAT_FIELDS)
    assert spec_fields("CreateCompletionRequest") <= set(TEXT_FIELDS)


def test_the_openai_client_retrieves_the_model(live):
    client = openai.OpenAI(base_url=str(live.base_url) + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.models.retrieve("gpt-4o")
