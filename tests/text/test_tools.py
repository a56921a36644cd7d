"""Tool calls (minillm/text/tool_calls.py): checks, the forced-call format, messages for templates with and
without tools, and parsing answers into OpenAI's tool_calls."""

import json

import pytest

from minillm.api import LLM
from minillm.text.chat_template import render_chat
from minillm.text.constrained import Constraints
from minillm.text.grammar import DFA, schema_pattern
from minillm.text.tool_calls import CLOSE, OPEN, call_format, validate_tools, parse_tool_calls, template_messages

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}}}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any arguments object


def test_parse_tool_calls():
    text = ('Let me check. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "now"}</tool_call><tool_call>not json</tool_call>')
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["add", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2} and calls[1]["function"]["arguments"] == "{}"
    assert len({c["id"] for c in calls}) == 2 and content == "Let me check. <tool_call>not json</tool_call>"
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_call_format_forces_an_allowed_call(smollm2):
    model, tok = smollm2
    tools, choice = validate_tools([ADD, NOW], "required")
    fmt = call_format(tools, choice)
    dfa = DFA(schema_pattern(fmt["schema"]))
    good = json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})
    assert dfa.accepts(dfa.read(good.encode()))
    assert not dfa.accepts(dfa.read(json.dumps({"name": "sub", "arguments": {"a": 1, "b": 2}}).encode()))
    assert not dfa.accepts(dfa.read(json.dumps({"name": "add", "arguments": {"a": 100, "b": 2}}).encode()))
    named = call_format(tools, {"type": "function", "function": {"name": "now"}})
    assert named["schema"]["properties"]["name"] == {"const": "now"}
    assert call_format(tools, "auto") is None and call_format(tools, "none") is None
    for backend in Constraints.BACKENDS:  # both read the frame and the JSON, token by token
        c = Constraints(tok, model.config.vocab_size, backend).for_format(fmt)
        for token in tok.encode(OPEN + good + CLOSE):
            assert c.mask()[token], backend
            c.advance(token)
        assert c.mask()[tok.eos_token_ids[0]]


def test_messages_for_a_template_without_tools():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    out = template_messages(messages, [ADD], template_has_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and '"name": "add"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": OPEN + '{"name": "add", "arguments": {"a": 1, "b": 2}}' + CLOSE}
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}


def test_messages_for_a_template_with_tools():
    """A template that renders tools gets them, and the arguments of earlier calls as objects (as
    Qwen's template writes them with tojson)."""
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "{% for c in m.tool_calls or [] %}{{ c.arguments | tojson }}{% endfor %}{{ m.content }};{% endfor %}")
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    messages = template_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                                       "tool_calls": calls}], [ADD], True)
    assert render_chat(template, messages, add_generation_prompt=False, tools=[ADD]) == '[add]hi;{"a": 1};'


def fn(**function) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize("tools, choice, path, words", [
    ([], "auto", "tools", "non-empty list"), ("add", None, "tools", "non-empty list"),
    ([fn(name="a b")], None, "tools[0].function.name", "64 letters"),
    ([fn(name=123)], "required", "tools[0].function.name", "got 123"),  # str(123) matched the pattern
    ([ADD, ADD], None, "tools[1].function.name", "same name as tools[0]"),
    ([ADD, fn(name="f", parameters=[])], None, "tools[1].function.parameters", "JSON schema"),
    ([fn(name="f", description=5)], None, "tools[0].function.description", "must be a string"),
    ([ADD, "add"], None, "tools[1]", "'type': 'function'"), ([{"type": "function", "function": "add"}], None,
                                                              "tools[0].function", "must be an object"),
    ([fn(name="f", description="\ud800")], None, "tools[0].function.description", "lone surrogate"),
    ([fn(name="f", parameters={"properties": {"x": {"description": "\udfff"}}})], None,
     "tools[0].function.parameters.properties.x.description", "lone surrogate"),
    ([ADD], "sometimes", "tool_choice", "tool_choice must be"), ([ADD], ["add"], "tool_choice", "got ['add']"),
    ([ADD], 5, "tool_choice", "got 5"), ([ADD], {"function": {"name": "add"}}, "tool_choice.type", "'function'"),
    ([ADD], {"type": "function", "function": "add"}, "tool_choice.function", "must be an object"),
    ([ADD], {"type": "function"}, "tool_choice.function", "got None"),
    ([ADD], {"type": "function", "function": {}}, "tool_choice.function.name", "got None"),
    ([ADD], {"type": "function", "function": {"name": 5}}, "tool_choice.function.name", "got 5"),
    ([ADD], {"type": "function", "function": {"name": "x"}}, "tool_choice.function.name", "['add']"),
    (None, "required", "tool_choice", "needs tools"), (None, {"type": "function"}, "tool_choice", "needs tools")])
def test_check_tools_names_the_path_of_the_problem(tools, choice, path, words):
    """Each message starts with the path of the value at fault (the server's `param`), then says what is wrong."""
    with pytest.raises(ValueError) as err:
        validate_tools(tools, choice)
    assert str(err.value).split(" ", 1)[0] == path and words in str(err.value), str(err.value)


def test_check_tools_takes_openai_shapes():
    described = fn(name="now", description="The time now", parameters=None)  # null: no parameters, as absent
    assert validate_tools([ADD, described], None) == ([ADD, described], "auto")
    named = {"type": "function", "function": {"name": "now"}}
    assert validate_tools([ADD, NOW], named) == ([ADD, NOW], named)
    assert validate_tools(None, None) == ([], "none") and validate_tools(None, "none") == ([], "none")


def test_llm_chat_with_tools(smollm2):
    """LLM.chat(tools=..., tool_choice="required"): a forced call, parsed into tool_calls; then the
    result goes back in a tool message and the answer is text."""
    llm = LLM(*smollm2)
    chat = [{"role": "user", "content": "What is 2 plus 3?"}]
    done = llm.chat(chat, tools=[ADD, NOW], tool_choice="required", max_new_tokens=40)
    (call,) = done.tool_calls
    assert call["function"]["name"] in ("add", "now") and done.text == "" and done.finish_reason == "stop"
    json.loads(call["function"]["arguments"])
    chat += [{"role": "assistant", "content": None, "tool_calls": done.tool_calls},
             {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    answer = llm.chat(chat, tools=[ADD, NOW], tool_choice="none", max_new_tokens=20)
    assert answer.text and answer.tool_calls == []
    with pytest.raises(ValueError, match="cannot be combined"):
        llm.chat(chat, tools=[ADD], tool_choice="required", response_format={"type": "json_object"})
