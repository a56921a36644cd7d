"""Structured outputs through the server and the engine: response_format on /v1/chat/completions and
/v1/completions, the openai client's parse() with a pydantic model, streamed and not, constrained and
free requests in one batch, and a 400 naming what is wrong with a bad format."""

import json
import threading

import jsonschema
import openai
import pydantic
import pytest

from minillm.api import load
from minillm.runtime.engine import Engine
from minillm.runtime.generate import generate
from minillm.runtime.sampling import SamplingParams
from minillm.serve.server import BackgroundServer, create_app

MODEL = "smollm2"
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                        "y": {"type": "integer", "minimum": -99, "maximum": 99}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


@pytest.fixture(scope="module")
def llm():
    return load(device="cpu")


@pytest.fixture(scope="module")
def client(llm):
    background = BackgroundServer(create_app(llm, model_name=MODEL, num_blocks=128))
    yield openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    background.stop()


def ask(text):
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model(client):
    """The openai client's parse(): it sends the model's JSON schema and parses the answer back."""
    done = client.chat.completions.parse(model=MODEL, messages=ask("Name a city and its country."),
                                         response_format=City, max_tokens=60, temperature=1.0, seed=4)
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.name and done.choices[0].finish_reason == "stop"


def test_json_schema_streamed_and_whole(client):
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=ask("Give a point."), response_format=FORMAT, max_tokens=40,
                      temperature=1.0, seed=1, n=2)
        if stream:
            texts = ["", ""]
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
        else:
            texts = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
        for text in texts:  # each of the n choices has its own constraint
            jsonschema.validate(json.loads(text), POINT)


def test_json_object_on_completions(client):
    """OpenAI's completions take no response_format; vLLM's do, and clients send it as extra_body."""
    done = client.completions.create(model=MODEL, prompt="JSON: {\"a\": 1}\nJSON:", max_tokens=60,
                                     temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert done.choices[0].finish_reason == "stop" and isinstance(json.loads(done.choices[0].text), dict)


def test_constrained_and_free_requests_share_a_batch(client, llm):
    """Free greedy answers sent together with constrained ones equal offline generation: the masks
    touch their own rows only."""
    questions = ["Name a fruit.", "Say hello.", "Name a colour.", "What is 2 + 2?"]
    free, constrained = {}, {}

    def one(q, i):
        if i % 2:
            r = client.chat.completions.create(model=MODEL, messages=ask(q), max_tokens=8, temperature=0)
            free[q] = r.choices[0].message.content
        else:
            r = client.chat.completions.create(model=MODEL, messages=ask(q + " As a point."), max_tokens=40,
                                               temperature=0, response_format=FORMAT)
            constrained[q] = r.choices[0].message.content

    threads = [threading.Thread(target=one, args=(q, i)) for i, q in enumerate(questions * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q, text in free.items():
        assert text == generate(llm.model, llm.tokenizer, llm.encode_chat(ask(q)), max_new_tokens=8).text
    for text in constrained.values():
        jsonschema.validate(json.loads(text), POINT)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "xml"}, "response_format must be"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "json_schema.name must be"),  # spec: required
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "date"}}}, "date"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}, "missing")])
def test_bad_response_formats_are_400s_naming_the_problem(client, fmt, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=4, response_format=fmt)
    body = err.value.body
    assert body["param"].startswith("response_format") and words in body["message"], body


def test_engine_gives_each_choice_its_own_constraint(llm):
    engine = Engine(llm.model, llm.tokenizer, num_blocks=64)
    ids = llm.encode_chat(ask("Give a point."))
    out = engine.generate([ids, ids], [SamplingParams(temperature=1.0, seed=s) for s in (0, 1)], 40,
                          response_format=FORMAT)
    for r in out:
        jsonschema.validate(json.loads(r["text"]), POINT)
    with pytest.raises(ValueError, match="date"):  # refused at add_request, for this request only
        engine.add_request(ids, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "date"}}})
    assert not engine.has_unfinished()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 30}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 30}}}}}
TOOLS = {t["function"]["name"]: t["function"] for t in (WEATHER, CLOCK)}


def valid_call(call) -> bool:
    function = TOOLS[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), function["parameters"])
    return call.id.startswith("call_") and call.type == "function"


def test_required_tool_call_round_trip(client):
    """Two tools, tool_choice="required": a valid call, whole and streamed; then the tool's result
    goes back and the conversation continues."""
    chat = ask("What is the weather in Paris?")
    done = client.chat.completions.create(model=MODEL, messages=chat, tools=[WEATHER, CLOCK], tool_choice="required",
                                          max_tokens=60, temperature=0)
    message, finish = done.choices[0].message, done.choices[0].finish_reason
    assert finish == "tool_calls" and message.tool_calls and all(valid_call(c) for c in message.tool_calls)
    with client.chat.completions.stream(model=MODEL, messages=chat, tools=[WEATHER, CLOCK], tool_choice="required",
                                        max_tokens=60, temperature=0) as stream:  # the SDK joins the fragments
        calls = stream.get_final_completion().choices[0].message.tool_calls
    assert calls and all(valid_call(c) for c in calls)
    assert [c.function.arguments for c in calls] == [c.function.arguments for c in message.tool_calls]
    follow = chat + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 degrees, light rain"}]
    answer = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER, CLOCK], max_tokens=30,
                                            temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


def test_a_named_tool_choice_calls_that_function(client):
    done = client.chat.completions.create(model=MODEL, messages=ask("What time is it in Tokyo?"), tools=[WEATHER, CLOCK],
                                          tool_choice={"type": "function", "function": {"name": "get_time"}},
                                          max_tokens=60, temperature=0)
    (call,) = done.choices[0].message.tool_calls
    assert call.function.name == "get_time" and valid_call(call)


def test_without_tool_choice_the_answer_is_text_or_calls(client):
    """auto: nothing is forced; whatever came back is either content or well-formed calls."""
    done = client.chat.completions.create(model=MODEL, messages=ask("Hello!"), tools=[WEATHER], max_tokens=20,
                                          temperature=0)
    message = done.choices[0].message
    assert message.content or all(valid_call(c) for c in message.tool_calls)


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "64 letters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                      "arguments": "[1]"}}]}]},
     "messages", "tool_calls")])
def test_bad_tools_are_400s_naming_the_field(client, extra, param, words):
    body = {"model": MODEL, "messages": ask("hi"), "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/chat/completions", body=body, cast_to=object)
    assert err.value.body["param"] == param and words in err.value.body["message"], err.value.body


def test_tools_on_text_completions_are_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"tools": [WEATHER]})
    assert err.value.body["param"] == "tools"


OPEN_WEATHER = {"type": "function", "function": {  # as users write tools: the object left open
    "name": "get_weather", "parameters": {"type": "object", "required": ["city", "unit"],
                                          "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}}}


def no_repeats(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


@pytest.mark.parametrize("sampling", [{"temperature": 0, "n": 1}, {"temperature": 1.0, "seed": 5, "n": 4}],
                         ids=["greedy", "sampled"])
def test_a_forced_call_on_an_open_schema_ends(client, sampling):
    """Issue 47's case, as a user meets it: the openai client, a function whose parameters leave the object
    open, tool_choice="required". Before the arguments were closed, the embedded model went on after the
    last argument (copying the schema, repeating one key) until max_tokens, and got no call. Now each
    choice is one call of exactly the declared arguments, no key twice."""
    done = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"),
                                          tools=[OPEN_WEATHER], tool_choice="required", max_tokens=100, **sampling)
    assert len(done.choices) == sampling["n"]
    for choice in done.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments, object_pairs_hook=no_repeats)
        assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"}
        jsonschema.validate(arguments, OPEN_WEATHER["function"]["parameters"])


def test_a_forced_call_cut_by_max_tokens_says_length(client):
    """Cut before it closes, a forced call is no call: finish_reason "length", no tool_calls, and the text
    written so far in the content, so the caller sees how far it got."""
    done = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"),
                                          tools=[OPEN_WEATHER], tool_choice="required", max_tokens=8, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>\n{")
