"""The OpenAI-compatible server, live on 127.0.0.1, through the official openai client: answers equal
offline generation (streamed or not, one or 16 at once), seeds reproduce, bad input gets OpenAI
error JSON with the right status, and a client that hangs up mid-stream frees its blocks."""

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from minillm.api import load
from minillm.runtime.generate import generate
from minillm.serve.server import BackgroundServer, create_app

MODEL = "smollm2"
QUESTIONS = ["What is the capital of France?", "Name a fruit.", "What is 2 + 2?", "Say hello.", "Name a colour.",
             "What is the sun?", "Name a dog breed.", "Count to three.", "Name a planet.", "What is water?",
             "Name an ocean.", "What is a cat?", "Name a tree.", "Say goodbye.", "Name a month.", "What is rain?"]


def messages(q):
    return [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def llm():
    return load(device="cpu")


@pytest.fixture(scope="module")
def server(llm):
    app = create_app(llm, model_name=MODEL, num_blocks=128, max_in_flight=20)
    background = BackgroundServer(app)
    yield app, background.url
    background.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(llm):
    """Greedy answers of 8 tokens, one at a time without the server."""
    return {q: generate(llm.model, llm.tokenizer, llm.encode_chat(messages(q)), max_new_tokens=8) for q in QUESTIONS}


def chat(client, q, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages(q), max_tokens=8, temperature=0, **kw)


def post(base, path, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server[1] + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"


def test_chat_equals_offline_greedy_with_usage(client, offline):
    q = QUESTIONS[0]
    r = chat(client, q)
    assert r.choices[0].message.content == offline[q].text
    assert r.choices[0].finish_reason == offline[q].finish_reason
    assert r.usage.completion_tokens == len(offline[q].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    r2 = client.chat.completions.create(model=MODEL, messages=messages(q), max_completion_tokens=8, temperature=0)
    assert r2.choices[0].message.content == offline[q].text


def test_streaming_equals_offline_and_ends_with_done(server, client, offline, llm):
    q = QUESTIONS[0]
    chunks = list(chat(client, q, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline[q].text
    assert chunks[-1].usage.completion_tokens == len(offline[q].token_ids)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [offline[q].finish_reason]
    body = {"model": MODEL, "messages": messages(q), "max_tokens": 3, "temperature": 0, "stream": True}
    req = urllib.request.Request(server[1] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.read().decode().split("\n\n") if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_completions_endpoint_equals_offline(client, llm):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    ref = generate(llm.model, llm.tokenizer, llm.tokenizer.encode(prompt), max_new_tokens=6)
    assert r.choices[0].text == ref.text
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt)) and r.usage.completion_tokens == len(ref.token_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == ref.text


def test_completions_take_token_ids_and_ignore_eos(server, client, llm):
    """A prompt of token ids (OpenAI's API allows it) is the same prompt as its text; ignore_eos
    (vLLM's extension) writes all max_tokens past the end of sequence, which greedy reaches first."""
    ids = llm.encode_chat(messages("What is 2 + 2?"))
    ref = generate(llm.model, llm.tokenizer, ids, max_new_tokens=60)
    assert ref.finish_reason == "stop" and len(ref.token_ids) < 60
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=60, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, "stop")
    assert r.usage.prompt_tokens == len(ids)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    past = generate(llm.model, llm.tokenizer, ids, max_new_tokens=60, eos_token_ids=())
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (past.text, "length", 60)
    for bad, param in [([1, "a"], "prompt"), ([10**9], "prompt"), ({"ignore_eos": "yes"}, "ignore_eos")]:
        body = {"model": MODEL, "prompt": bad} if isinstance(bad, list) else {"model": MODEL, "prompt": "hi", **bad}
        got, err = post(server[1], "/v1/completions", body)
        assert (got, err["error"]["param"]) == (400, param), err


def test_logprobs_equal_offline(client, offline):
    q = QUESTIONS[0]
    r = chat(client, q, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [t.logprob for t in content] == pytest.approx(offline[q].logprobs, abs=1e-4)
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)


def test_seed_reproduces_a_sampled_answer(client, llm):
    q = "Write a word."
    kw = dict(model=MODEL, messages=messages(q), max_tokens=8, temperature=1.0, top_p=0.95)
    a, b = (client.chat.completions.create(seed=7, **kw).choices[0].message.content for _ in range(2))
    assert a == b
    from minillm.runtime.sampling import SamplingParams
    ref = generate(llm.model, llm.tokenizer, llm.encode_chat(messages(q)), max_new_tokens=8,
                   params=SamplingParams(temperature=1.0, top_p=0.95, seed=7))
    assert a == ref.text


def test_sixteen_concurrent_requests_equal_offline(server, client, offline):
    app, _ = server
    results = {}
    steps = app.state.bridge.steps
    threads = [threading.Thread(target=lambda q=q: results.__setitem__(q, chat(client, q))) for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 16
    for q in QUESTIONS:
        assert results[q].choices[0].message.content == offline[q].text, q
    assert app.state.bridge.steps - steps < 16 * 8  # they shared forward steps


def test_planted_bug_is_caught(client, llm, offline):
    """A server that dropped the last prompt token (the template's "\\n" after "assistant") would give
    different text: the comparison the tests rely on catches it."""
    q = QUESTIONS[0]
    planted = generate(llm.model, llm.tokenizer, llm.encode_chat(messages(q))[:-1], max_new_tokens=8)
    assert chat(client, q).choices[0].message.content == offline[q].text != planted.text


BAD = {
    "malformed json": (b"{nope", 400, None),
    "unknown model": ({"model": "gpt-4o", "messages": messages("hi")}, 404, "model"),
    "missing messages": ({"model": MODEL}, 400, "messages"),
    "empty messages": ({"model": MODEL, "messages": []}, 400, "messages"),
    "prompt too long": ({"model": MODEL, "messages": messages("hi " * 2100)}, 400, "messages"),
    "max_tokens 0": ({"model": MODEL, "messages": messages("hi"), "max_tokens": 0}, 400, "max_tokens"),
    "beyond context": ({"model": MODEL, "messages": messages("hi"), "max_tokens": 2040}, 400, "max_tokens"),
    "temperature": ({"model": MODEL, "messages": messages("hi"), "temperature": -0.5}, 400, "temperature"),
    "top_p": ({"model": MODEL, "messages": messages("hi"), "top_p": 1.5}, 400, "top_p"),
    "n": ({"model": MODEL, "messages": messages("hi"), "n": 17}, 400, "n"),
    "best_of on chat": ({"model": MODEL, "messages": messages("hi"), "best_of": 2}, 400, "best_of"),
    "body size": (json.dumps({"model": MODEL, "messages": messages("a" * (1 << 20))}).encode(), 413, None),
    "empty prompt": (None, 400, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_openai_error_json(server, case):
    body, status, param = BAD[case]
    path = "/v1/completions" if case == "empty prompt" else "/v1/chat/completions"
    got, err = post(server[1], path, {"model": MODEL, "prompt": ""} if body is None else body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param
    if case in ("prompt too long", "beyond context"):  # both numbers in the message
        assert "2048" in err["error"]["message"] and "tokens" in err["error"]["message"]


def test_client_errors_through_openai_client(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages("hi"))
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=messages("hi"), temperature=9 * -1)


def test_past_the_concurrency_limit_gets_429(llm):
    background = BackgroundServer(create_app(llm, model_name=MODEL, num_blocks=64, max_in_flight=1))
    try:
        c = openai.OpenAI(base_url=f"{background.url}/v1", api_key="unused", max_retries=0)
        held = c.chat.completions.create(model=MODEL, messages=messages("hi"), max_tokens=200, temperature=0,
                                         stream=True)
        next(iter(held))  # the first request is in flight
        with pytest.raises(openai.RateLimitError):
            c.chat.completions.create(model=MODEL, messages=messages("hi"), max_tokens=2)
        held.close()
    finally:
        background.stop()


def test_disconnect_mid_stream_frees_blocks(server, client):
    app, base = server
    engine = app.state.bridge.engine
    manager, aborted = engine.manager, engine.finish_reasons["abort"]
    long_answer = messages("Write a very long essay about the history of Rome, with many chapters.")  # 500 tokens
    stream = client.chat.completions.create(model=MODEL, messages=long_answer, max_tokens=500, temperature=0, stream=True)
    for _, _chunk in zip(range(3), stream):
        pass
    assert manager.num_free_blocks < manager.num_blocks  # it holds blocks while streaming
    stream.close()
    deadline = time.time() + 20
    while time.time() < deadline and manager.num_free_blocks != manager.num_blocks:
        time.sleep(0.05)
    assert manager.num_free_blocks == manager.num_blocks
    assert engine.finish_reasons["abort"] == aborted + 1 and not engine.sequences  # aborted, not run to 500 tokens


def test_cli_serve_binds_localhost_by_default():
    from minillm.__main__ import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.command, args.host, args.port) == ("serve", "127.0.0.1", 8000)
