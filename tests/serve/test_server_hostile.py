"""Hostile requests (issue 51), each case of the probe kept as a test with the bad input in its name:
`tool_choice` and `tools` of every shape, lone surrogates in any string of a request, JSON that parses
but breaks what comes after, bodies that are not `application/json` (415), and the surface a server
with API keys shows (no schema pages, no CORS headers). Live servers on 127.0.0.1, through the openai
client, or httpx where the body must be bytes the client would not send (a lone surrogate)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from minillm.serve.server import BackgroundServer, create_app
from support import serving

MODEL = "smollm2"
KEY = "sk-hostile-test-0123"
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server(llm):
    with serving(create_app(llm, model_name=MODEL, num_blocks=16)) as running:
        yield running


@pytest.fixture(scope="module")
def url(server):
    return server[1]


@pytest.fixture(scope="module")
def keyed(llm):
    """A server with an API key: only /health and /metrics answer without it."""
    background = BackgroundServer(create_app(llm, model_name=MODEL, num_blocks=16, api_keys=[KEY]))
    yield background.url
    background.stop()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def refused(client, **body) -> dict:
    """The error body of a chat request the openai client sends as it is, which must be a 400."""
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/chat/completions", body={"model": MODEL, "messages": HI, "max_tokens": 2, **body},
                    cast_to=object)
    return err.value.body


def post(url: str, body, path: str = "/v1/chat/completions", **headers) -> httpx.Response:
    """POST `body` as JSON bytes (json.dumps escapes a lone surrogate as \\ud800, as a hostile client may)."""
    data = body if isinstance(body, bytes) else json.dumps({"model": MODEL, "max_tokens": 2, **body}).encode()
    return httpx.post(url + path, content=data, headers={"Content-Type": "application/json", **headers}, timeout=60)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---------------------------------------------------------------- 1. tool_choice and tools of every shape


def test_tool_choice_function_as_string_is_400_naming_tool_choice_function(client):
    error = refused(client, tools=[WEATHER], tool_choice={"type": "function", "function": "get_weather"})
    assert error["param"] == "tool_choice.function" and "must be an object" in error["message"]


def test_tool_choice_as_list_is_400_naming_tool_choice(client):
    error = refused(client, tools=[WEATHER], tool_choice=["get_weather"])
    assert error["param"] == "tool_choice" and "got ['get_weather']" in error["message"]


def test_tool_choice_as_number_is_400_naming_tool_choice(client):
    assert refused(client, tools=[WEATHER], tool_choice=5)["param"] == "tool_choice"


@pytest.mark.parametrize("choice, param, words", [
    ({"type": "function"}, "tool_choice.function", "got None"),
    ({"type": "function", "function": {}}, "tool_choice.function.name", "got None"),
    ({"type": "function", "function": {"name": 5}}, "tool_choice.function.name", "got 5"),
    ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name", "got 'nope'"),
    ({"type": "function", "function": ["get_weather"]}, "tool_choice.function", "must be an object"),
    ({"function": {"name": "get_weather"}}, "tool_choice.type", "must be 'function'"),
    ({"type": "tool", "function": {"name": "get_weather"}}, "tool_choice.type", "got 'tool'"),
    ("sometimes", "tool_choice", "none, auto, required"), (True, "tool_choice", "got True"),
    (1e308, "tool_choice", "got 1e+308")],
    ids=["function_missing", "function_without_name", "name_a_number", "name_of_no_tool", "function_a_list",
         "type_missing", "type_not_function", "unknown_string", "true", "1e308"])
def test_tool_choice_of_every_shape_is_400_naming_its_path(client, choice, param, words):
    error = refused(client, tools=[WEATHER], tool_choice=choice)
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("function, param", [
    ({"name": 123}, "tools[1].function.name"), ({"name": "f", "description": 5}, "tools[1].function.description"),
    ({"name": "f", "parameters": []}, "tools[1].function.parameters"), ({"name": ""}, "tools[1].function.name"),
    ({"name": "f" * 65}, "tools[1].function.name"), ("f", "tools[1].function"),
    ({"name": "get_weather"}, "tools[1].function.name")],
    ids=["name_a_number", "description_a_number", "parameters_a_list", "name_empty", "name_of_65_letters",
         "function_a_string", "name_twice"])
def test_a_bad_second_tool_is_400_naming_its_path(client, function, param):
    error = refused(client, tools=[WEATHER, {"type": "function", "function": function}], tool_choice="required")
    assert error["param"] == param, error


def test_tool_parameters_the_grammar_cannot_compile_are_400_naming_tools_not_response_format(client):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    error = refused(client, tools=[bad], tool_choice="required")
    assert error["param"] == "tools" and error["message"].startswith("tools:"), error


def test_tool_choice_on_text_completions_is_400_naming_tool_choice(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"tool_choice": "auto"})
    assert err.value.body["param"] == "tool_choice"


# ---------------------------------------------------------------- 2. lone surrogates, in any string


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
     "tools[0].function.description"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f\udfff"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "\ud800"}}}}}]},
     "tools[0].function.parameters.properties.city.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"\ud800": {}}}}}]},
     "tools[0].function.parameters.properties['\\ud800']"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "\ud800"}}},
     "tool_choice.function.name"),
    ({"model": "smollm2\udc00"}, "model"), ({"stop": ["ok", "\ud800"]}, "stop[1]"),
    ({"messages": [{"role": "user\ud800", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": '{"x": "\ud800"}'}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "\ud800", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"stream_options": {"\ud800": True}}, "stream_options['\\ud800']"), ({"user": "\ud800"}, "user")],
    ids=["tool_description", "tool_name", "tool_parameter_description", "tool_parameter_key", "tool_choice_name",
         "model", "stop", "message_role", "message_text_part", "tool_call_arguments", "response_format_name",
         "stream_options_key", "unread_field_user"])
def test_a_lone_surrogate_anywhere_is_400_naming_its_path(url, body, param):
    error = error_of(post(url, {"messages": HI, **body}))
    assert error["param"] == param and "lone surrogate" in error["message"], error


def test_a_lone_surrogate_in_a_prompt_is_400_naming_prompt(url):
    error = error_of(post(url, {"prompt": ["\ud800"]}, "/v1/completions"))
    assert error["param"] == "prompt[0]" and "lone surrogate" in error["message"]


# ---------------------------------------------------------------- 3. JSON that parses, then breaks what follows


def test_an_integer_of_5000_digits_is_400_not_500(url):
    body = b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}"
    error = error_of(post(url, body))
    assert "not valid JSON" in error["message"] and "4300 digits" in error["message"]


def test_a_value_nested_65_deep_is_400_naming_its_path(url):
    deep = 0
    for _ in range(65):
        deep = [deep]
    error = error_of(post(url, {"messages": HI, "n": deep}))
    assert error["param"].startswith("n[0][0]") and "nested more than 64 levels" in error["message"]


def test_a_value_nested_900_deep_is_400_not_a_recursion_error(url):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"[" * 900 + b"]" * 900 + b"}"
    error = error_of(post(url, body))
    assert error["param"].startswith("seed[0]")


def test_tool_call_arguments_nested_100000_deep_are_400_naming_messages(url):
    call = {"type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    error = error_of(post(url, {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}))
    assert error["param"] == "messages" and "tool_calls" in error["message"]


def test_model_as_number_is_400_naming_model(client):
    error = refused(client, model=5)
    assert error["param"] == "model" and "must be a string" in error["message"]


def test_model_as_2mb_string_is_404_with_a_short_message(url):
    error = error_of(post(url, {"messages": HI, "model": "x" * 900_000}), 404)
    assert error["code"] == "model_not_found" and len(error["message"]) < 300


def test_a_2mb_value_is_named_not_echoed(url):
    error = error_of(post(url, {"messages": HI, "n": "x" * 900_000}))
    assert error["param"] == "n" and len(error["message"]) < 200 and "(900,002 characters)" in error["message"]


def test_stream_options_include_usage_as_string_is_400_naming_its_path(client):
    assert refused(client, stream_options={"include_usage": "yes"})["param"] == "stream_options.include_usage"


# ---------------------------------------------------------------- 4. the Content-Type of a POST (415)


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                          "application/jsonx", "text/json"],
                         ids=["text_plain", "missing", "form", "multipart", "json_in_latin1", "jsonx", "text_json"])
def test_a_body_not_sent_as_application_json_is_415_naming_content_type(url, content_type):
    body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 2}).encode()
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(url + "/v1/chat/completions", content=body, headers=headers, timeout=60)
    error = error_of(r, 415)
    assert error["code"] == "unsupported_media_type" and "Content-Type: application/json" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_text_plain_post_never_reaches_the_engine(server):
    """The browser's "simple request": refused before the body is parsed, so no generation runs."""
    app, url = server
    steps = app.state.bridge.steps
    r = httpx.post(url + "/v1/completions", content=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 5}),
                   headers={"Content-Type": "text/plain"}, timeout=60)
    assert r.status_code == 415 and app.state.bridge.steps == steps


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8", 'application/json; charset="utf-8"'])
def test_a_body_sent_as_application_json_answers(url, content_type):
    body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 2}).encode()
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": content_type}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_text_plain_post_without_a_key_is_401_first(keyed):
    r = httpx.post(keyed + "/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"}, timeout=60)
    assert r.status_code == 401


# ---------------------------------------------------------------- 5. the surface: schema pages, CORS


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/redoc", "/docs/oauth2-redirect"])
def test_with_api_keys_the_schema_pages_are_off(keyed, path):
    for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.get(keyed + path, headers=headers).status_code == 404
    assert httpx.get(keyed + "/health").status_code == 200 and httpx.get(keyed + "/metrics").status_code == 200
    assert httpx.get(keyed + "/v1/models").status_code == 401


def test_without_api_keys_the_schema_pages_answer(url):
    assert httpx.get(url + "/openapi.json").json()["info"]["title"] == "minillm"
    assert httpx.get(url + "/docs").status_code == 200


def test_no_cors_headers_so_a_browser_never_sends_a_json_post_from_another_origin(url):
    origin = {"Origin": "https://evil.example"}
    preflight = httpx.options(url + "/v1/chat/completions", headers={**origin, "Access-Control-Request-Method": "POST",
                                                                       "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 405 and not any(h.startswith("access-control-") for h in preflight.headers)
    r = post(url, {"messages": HI}, Origin="https://evil.example")
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
