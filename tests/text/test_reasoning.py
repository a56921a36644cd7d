"""Thinking: minillm/text/reasoning.py (notebook 10), chat_template_kwargs (appendix A2's
validate_template_kwargs) and LLM.chat's reasoning, with Qwen3.5's real chat template.

The parser's rule on the cases issue 47 lists (a prompt that opens <think>, an answer that opens it,
enable_thinking=false, a <tool_call> before </think>, an answer cut while thinking), its stream held to
its own whole-answer split on generated texts cut anywhere, and LLM.chat on the embedded model with
Qwen3.5's template (data/llama-cpp-vocab/templates/Qwen3.5-4B.jinja, from llama.cpp's models/templates).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.runtime.generate import collect
from minillm.runtime.llm import LLM
from minillm.runtime.sampling import SamplingParams
from minillm.text.chat_template import render_chat, validate_template_kwargs
from minillm.text.reasoning import ReasoningStream, opens_thinking, split_reasoning, template_thinks
from support import QWEN35_TEMPLATE, with_chat_template

QWEN35 = QWEN35_TEMPLATE
CALL = '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'
CASES = [  # (prompt left <think> open, the answer's text, reasoning, content)
    (True, "The user wants a capital.\n</think>\n\nParis.", "The user wants a capital.", "Paris."),
    (False, "<think>\nFrance: Paris.\n</think>\n\nParis.", "France: Paris.", "Paris."),
    (False, "\n<think>x</think>y", "x", "y"),
    (False, "Paris.", None, "Paris."),  # enable_thinking=false: the prompt closed it
    (True, "Look it up.\n" + CALL, "Look it up.", CALL),  # a call before </think> is the answer's
    (True, "Paris is the capital, but let", "Paris is the capital, but let", ""),  # cut while thinking
    (True, "\n\n</think>\n\nHi", None, "Hi"),  # an empty reasoning
    (False, "  <b>Paris</b> ", None, "  <b>Paris</b> "),  # no reasoning: the text as it is
    (False, "<thin", None, "<thin"),  # looked like a <think> until the end
    (True, "a </thinking> b", "a </thinking> b", ""),  # not the marker
]


@pytest.mark.parametrize("thinking, text, reasoning, content", CASES)
def test_the_rule_on_each_case(thinking, text, reasoning, content):
    assert split_reasoning(text, thinking) == (reasoning, content)


PIECES = st.sampled_from(["<think>", "</think>", "<tool_call>", "<", "</", "think>", "\n", " ", "a", "b c"])


@settings(max_examples=400, deadline=None)
@given(st.lists(PIECES, max_size=12).map("".join), st.booleans(), st.lists(st.integers(0, 80), max_size=8))
def test_streamed_pieces_join_to_the_whole_split(text, thinking, cuts):
    stream, pieces, start = ReasoningStream(thinking), [], 0
    for cut in sorted(c % (len(text) + 1) for c in cuts) + [len(text)]:
        pieces.append(stream.feed(text[start:cut]))
        start = cut
    pieces.append(stream.end())
    joined = "".join(r for r, _ in pieces) or None, "".join(c for _, c in pieces)
    assert joined == split_reasoning(text, thinking), text


def test_qwen35_template_opens_and_closes_thinking():
    chat = [{"role": "user", "content": "Capital of France?"}]
    assert template_thinks(QWEN35) and not template_thinks("{{ messages[0]['content'] }}") and not template_thinks(None)
    assert opens_thinking(render_chat(QWEN35, chat))  # Qwen3.5 ends the prompt with <think>\n
    closed = render_chat(QWEN35, chat, enable_thinking=False)
    assert closed.endswith("<think>\n\n</think>\n\n") and not opens_thinking(closed)


@pytest.mark.parametrize("kwargs, words", [
    ([1], "must be an object"), ({"messages": []}, "set from the request"), ({"not a name": 1}, "not a template variable"),
    ({"x": float("nan")}, "JSON values only"), ({"x": object()}, "JSON values only"),
    ({"x": "y" * 20_000}, "over the limit")])
def test_template_kwargs_are_checked_at_the_door(kwargs, words):
    with pytest.raises(ValueError, match=words):
        validate_template_kwargs(kwargs)
    assert validate_template_kwargs(None) == {} and validate_template_kwargs({"enable_thinking": False}) == {
        "enable_thinking": False}


@pytest.fixture(scope="module")
def thinking_llm(smollm2):
    """The embedded SmolLM2 (ChatML, as Qwen) behind Qwen3.5's template, which thinks."""
    return with_chat_template(smollm2, QWEN35)


def test_llm_chat_returns_the_reasoning_apart(thinking_llm, smollm2):
    """Thinking on (Qwen3.5's default): the prompt opens <think>; SmolLM2 never closes it, so its whole
    answer is reasoning. enable_thinking=false: the prompt closes it, and the answer is all content. Each
    against the raw text the same prompt generates."""
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0)
    for kwargs, thinks in (({}, True), ({"enable_thinking": False}, False)):
        ids = thinking_llm.encode_chat(chat, **kwargs)
        raw = collect(thinking_llm._steps(ids, params, max_new_tokens=24)).text
        answer = thinking_llm.chat(chat, params, chat_template_kwargs=kwargs or None, max_new_tokens=24)
        assert (answer.reasoning, answer.text) == split_reasoning(raw, thinks)
        assert (answer.reasoning is not None) == thinks and (answer.text == raw) == (not thinks), (raw, answer)
    plain = LLM(*smollm2).chat(chat, params, max_new_tokens=8)  # SmolLM2's own template: no parser
    assert plain.reasoning is None
    with pytest.raises(ValueError, match="chat_template_kwargs.tools is set from the request"):
        thinking_llm.chat(chat, chat_template_kwargs={"tools": []})
