"""Thinking through the server (notebook 18's Reply and reasoning_events, notebook 10's parser): the openai
client, whole and streamed answers, `reasoning` and `reasoning_content` (the same text), chat_template_kwargs
per request and the server's defaults, reasoning_effort.

The model is the embedded SmolLM2 (ChatML, as Qwen) behind Qwen3.5's real chat template
(data/llama-cpp-vocab/templates/Qwen3.5-4B.jinja), which thinks: its prompt ends in an open <think>, and
SmolLM2 never writes </think>, so with thinking on its whole answer is reasoning; enable_thinking=false
closes the <think> in the prompt and the answer is all content. Each answer is held to LLM.chat's on the
same request, and to the raw text the prompt generates.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from minillm.runtime.sampling import SamplingParams
from minillm.serve.server import BackgroundServer, create_app
from support import QWEN35_TEMPLATE, with_chat_template

MODEL, TOKENS = "smollm2", 24
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinking_llm(smollm2):
    return with_chat_template(smollm2, QWEN35_TEMPLATE)


def client_for(app):
    background = BackgroundServer(app)
    return background, openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(thinking_llm):
    background, client = client_for(create_app(thinking_llm, model_name=MODEL, num_blocks=64))
    yield client
    background.stop()


def whole(client, **kwargs):
    done = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=TOKENS, temperature=0, **kwargs)
    message = done.choices[0].message
    return message, (message.model_extra or {})


def streamed(client, **kwargs) -> tuple[str, str, str]:
    reasoning, reasoning_content, content = [], [], []
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=TOKENS, temperature=0,
                                                stream=True, **kwargs):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            extra = delta.model_extra or {}
            reasoning.append(extra.get("reasoning") or "")
            reasoning_content.append(extra.get("reasoning_content") or "")
            content.append(delta.content or "")
    return "".join(reasoning), "".join(reasoning_content), "".join(content)


@pytest.mark.parametrize("template_kwargs, thinks", [(None, True), ({"enable_thinking": False}, False)],
                         ids=["thinking", "enable_thinking false"])
def test_whole_and_streamed_answers_split_as_llm_chat_does(client, thinking_llm, template_kwargs, thinks):
    expected = thinking_llm.chat(ASK, SamplingParams(temperature=0), chat_template_kwargs=template_kwargs,
                                 max_new_tokens=TOKENS)
    assert (expected.reasoning is not None) == thinks  # the case is what it says
    body = {"extra_body": {"chat_template_kwargs": template_kwargs}} if template_kwargs else {}
    message, extra = whole(client, **body)
    assert extra["reasoning"] == extra["reasoning_content"] == expected.reasoning
    assert (message.content or "") == expected.text
    assert streamed(client, **body) == (expected.reasoning or "", expected.reasoning or "", expected.text)


def test_the_servers_default_kwargs_and_a_request_over_them(thinking_llm):
    """--default-chat-template-kwargs: thinking off for every chat unless the request turns it back on."""
    background, client = client_for(create_app(thinking_llm, model_name=MODEL, num_blocks=64,
                                               chat_template_kwargs={"enable_thinking": False}))
    try:
        assert whole(client)[1]["reasoning"] is None
        assert whole(client, extra_body={"chat_template_kwargs": {"enable_thinking": True}})[1]["reasoning"]
        for kwargs in ({}, {"enable_thinking": True}):  # /tokenize renders the prompt the same way
            body = {"messages": ASK, **({"chat_template_kwargs": kwargs} if kwargs else {})}
            ids = httpx.post(background.url + "/tokenize", json=body, timeout=60).json()["tokens"]
            assert ids == thinking_llm.encode_chat(ASK, **{"enable_thinking": False, **kwargs})
    finally:
        background.stop()
    with pytest.raises(ValueError, match="default chat_template_kwargs.messages is set from the request"):
        create_app(thinking_llm, chat_template_kwargs={"messages": []})


@pytest.mark.parametrize("kwargs, param, words", [
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "set from the request"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "must be one of none, minimal, low, medium, high")])
def test_bad_template_variables_are_400s_naming_them(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        whole(client, extra_body=kwargs)
    assert err.value.body["param"] == param and words in err.value.body["message"]


def test_reasoning_effort_reaches_the_template(client):
    """A value OpenAI allows is passed on as the template's variable (Qwen3.5's template ignores it: same answer)."""
    assert whole(client, reasoning_effort="low")[1]["reasoning"] == whole(client)[1]["reasoning"]


def test_a_template_that_does_not_think_adds_no_field(llm):
    background, client = client_for(create_app(llm, model_name=MODEL, num_blocks=64))
    try:
        message, extra = whole(client)
        assert "reasoning" not in extra and "reasoning_content" not in extra and message.content
    finally:
        background.stop()
