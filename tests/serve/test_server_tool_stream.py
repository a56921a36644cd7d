"""Streaming with tools (issue 52, point 7; minillm/serve/tool_stream.py, notebook 18's "Streaming tool
calls"): text streams as it comes until a call can begin, a call's arguments stream as fragments in
delta.tool_calls, and the finish is "tool_calls".

First the stream on its own, fed hand-written answers cut at every place and at random places: what it
sends joins to what the whole answer's parser (minillm/text/tool_calls.parse_tool_calls) makes of the
text, content and calls alike, except where a stream cannot take back what it sent (a block cut before
its closing tag). Then through the server and the official openai client, its stream helpers
accumulating the chunks: a required call whose arguments arrive in more than one fragment and equal the
whole answer's, a plain answer whose text arrives before its end, n = 2 choices with their own calls.
"""

from __future__ import annotations

import json
import random
import time

import openai
import pytest

from minillm.api import LLM
from minillm.serve.server import BackgroundServer, create_app
from minillm.serve.tool_stream import OPEN_TAG, ToolCallStream, held_back, json_token, normalized
from minillm.text.tool_calls import parse_tool_calls

MODEL = "smollm2"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWERS = [
    "Hello there, how are you?  \n",
    CALL,
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Par\\u00eds","n":[1,2.50,1e3,true,null,-0]}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>',
    'Sure.\n<tool_call>\n{"name": "f"}\n</tool_call>\nDone <b>bold</b> <tool',
    "x <tool_call> not json </tool_call> y",
    'I think <tool_call>{"name": "f", "arguments": {"a": "b"}}</tool_call>',
    "a < b and <tool_cal",
    '<tool_call>\n{"name": "é", "arguments": {"s": "日本 \\"q\\" \\\\ \\n", "deep": {"x": [{"y": {}}]}}}\n</tool_call>',
    'A\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nB\n',
    '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',
]


def streamed(text: str, cuts: list[int], one_call: bool = False) -> tuple[str, list[dict], str, int]:
    """(content, calls as {name, arguments}, finish_reason, argument fragments) of `text` fed in pieces."""
    stream, content, calls, fragments = ToolCallStream(one_call), "", {}, 0

    def take(sent: str, deltas: list[dict]) -> None:
        nonlocal content, fragments
        content += sent
        for d in deltas:
            if "id" in d:
                assert d["id"].startswith("call_") and d["type"] == "function" and d["index"] == len(calls)
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
            fragments += bool(d["function"]["arguments"])

    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        take(*stream.feed(text[start:end]))
    *rest, finish = stream.end("stop")
    take(*rest)
    return content, [calls[k] for k in sorted(calls)], finish, fragments


def whole(text: str, one_call: bool = False) -> tuple[str | None, list[dict], str]:
    content, calls = parse_tool_calls(text)
    calls = calls[:1] if one_call else calls
    return content, [{k: c["function"][k] for k in ("name", "arguments")} for c in calls], "tool_calls" if calls else "stop"


@pytest.mark.parametrize("text", ANSWERS, ids=range(len(ANSWERS)))
def test_the_stream_joins_to_the_whole_answer_wherever_the_text_is_cut(text):
    want_content, want_calls, want_finish = whole(text)
    rng = random.Random(0)
    cuts = [list(range(1, len(text))), []] + [sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
                                               for _ in range(200)]
    for cut in cuts:
        content, calls, finish, _ = streamed(text, cut)
        assert (content or None, calls, finish) == (want_content or None, want_calls, want_finish), cut


def test_arguments_stream_in_fragments_and_only_the_first_call_with_parallel_tool_calls_false():
    text = ANSWERS[2]
    *_, fragments = streamed(text, list(range(1, len(text))))
    assert fragments > 10  # one per token of the arguments, character by character
    content, calls, finish, _ = streamed(text, list(range(1, len(text))), one_call=True)
    assert (content or None, calls, finish) == whole(text, one_call=True) and len(calls) == 1


def test_a_call_cut_before_its_closing_tag_keeps_what_was_sent():
    """The one difference from the whole answer: a stream cannot take back a call it began to send."""
    text = CALL[:-len("\n</tool_call>")]
    content, calls, finish, _ = streamed(text, list(range(1, len(text))))
    assert whole(text) == (text, [], "stop")  # the whole answer's parser needs the closing tag
    assert (content, calls, finish) == ("", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}], "stop")


def test_only_what_could_begin_the_tag_is_held_back():
    assert [held_back(t, OPEN_TAG) for t in ("I think <tool", "a < b", "done.<", "<tool_call", "x")] == [5, 0, 1, 10, 0]
    stream = ToolCallStream()
    assert stream.feed("The answer is <") == ("The answer is", [])  # the space waits for more content too
    assert stream.feed("b>") == (" <b>", [])


@pytest.mark.parametrize("value", [{"city": "Paris"}, {"a": [1, 2.5, 1e300, -0.0, True, None, "é\n\"\\"]},
                                   {"nested": {"x": [[], {}, [{"y": "日本"}]]}}, [], "text", 12, {"😀": 1}])
def test_the_rewritten_tokens_join_to_json_dumps(value):
    compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    pos, tokens = 0, []
    while (found := json_token(compact + " ", pos)) is not None:  # a trailing space ends a last number
        token, pos = found
        tokens.append(normalized(token))
    assert "".join(tokens) == json.dumps(value)


# ---------------------------------------------------------------- through the server and the openai client


@pytest.fixture(scope="module")
def client(smollm2):
    background = BackgroundServer(create_app(LLM(*smollm2), model_name=MODEL, num_blocks=128))
    yield openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    background.stop()


def ask(text: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "tools": [WEATHER], "max_tokens": 60,
            "temperature": 0, **extra}


def test_a_required_call_streams_its_arguments_in_fragments_equal_to_the_whole_answer(client):
    kwargs = ask("What is the weather in Paris?", tool_choice="required")
    done = client.chat.completions.create(**kwargs)
    fragments = []
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
            elif event.type == "content.delta" and event.delta:
                pytest.fail(f"content {event.delta!r} in a required call")
        final = stream.get_final_completion()
    assert len(fragments) > 1
    (want,) = done.choices[0].message.tool_calls
    (got,) = final.choices[0].message.tool_calls
    assert (got.function.name, got.function.arguments) == (want.function.name, want.function.arguments)
    assert "".join(fragments) == want.function.arguments and json.loads(want.function.arguments)["city"]
    assert got.id.startswith("call_") and got.type == "function"
    assert final.choices[0].finish_reason == done.choices[0].finish_reason == "tool_calls"
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    calls = [d for c in chunks for d in c.delta.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in calls[1:])


def test_a_plain_answer_with_tools_offered_streams_before_its_end(client):
    kwargs = ask("Write a haiku about the sea.")
    done = client.chat.completions.create(**kwargs)
    start, arrivals, text = time.monotonic(), [], ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - start)
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].finish_reason:
            ended = time.monotonic() - start
    assert not done.choices[0].message.tool_calls and text == done.choices[0].message.content
    assert len(arrivals) > 2 and arrivals[0] < ended  # the first text came before the end, not with it
    assert len(set(arrivals)) > 1  # in several deliveries, not one at the end


def test_n_choices_stream_their_own_calls(client):
    kwargs = ask("What is the weather in Paris?", tool_choice="required", n=2, temperature=1.0, seed=3)
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert [c.index for c in final.choices] == [0, 1]
    for choice in final.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
        assert choice.finish_reason == "tool_calls"
