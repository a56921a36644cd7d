"""One bad request must never harm another (issue 17): each case of the adversarial probe,
reproduced against a live server on 127.0.0.1 with httpx, or in-process on the engine.

Timing cases slow the engine down on purpose (a step that sleeps) instead of waiting for a
4,000-token prefill: what is tested is that the event loop never waits for a step."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time

import httpx
import pytest

from minillm.api import LLM, load
from minillm.runtime.engine import Engine
from minillm.runtime.sampling import SamplingParams
from minillm.serve.server import BackgroundServer, create_app
from support import slow_steps, wait_until

MODEL = "smollm2"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm():
    return load(device="cpu")


@pytest.fixture
def live(llm, request):
    """A fresh server per test (its in-flight count and engine start clean); params via indirect marks."""
    kwargs = getattr(request, "param", {})
    app = create_app(llm, model_name=MODEL, num_blocks=64, **kwargs)
    background = BackgroundServer(app)
    with httpx.Client(base_url=background.url, timeout=60) as client:
        yield app, client
    background.stop()


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2,
                                                     "temperature": 0, **body})


# ---------------------------------------------------------------- 1. the in-flight count


@pytest.mark.parametrize("live", [{"max_in_flight": 4}], indirect=True)
def test_a_storm_of_rejected_requests_leaves_the_server_open(live):
    app, client = live
    for seed in (2**64, -2**64, 2**70) * 10:  # once leaked a slot each: 126 locked the server out
        r = chat(client, seed=seed)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    assert client.get("/health").json()["in_flight"] == 0
    assert chat(client).status_code == 200


@pytest.mark.parametrize("live", [{"max_in_flight": 3}], indirect=True)
def test_a_burst_is_admitted_only_up_to_the_limit(live, monkeypatch):
    app, client = live
    slow_steps(app, monkeypatch, 0.2)

    async def burst():
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=60) as c:
            body = {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0}
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(12)))

    codes = sorted(r.status_code for r in asyncio.run(burst()))
    assert codes.count(200) <= 3 and set(codes) <= {200, 429} and 429 in codes
    assert wait_until(lambda: client.get("/health").json()["in_flight"] == 0)


# ---------------------------------------------------------------- 2. a poisoned request fails alone


def test_a_failing_request_fails_alone_next_to_three_healthy_ones(llm, monkeypatch):
    import minillm.runtime.engine as engine_module

    real_sample = engine_module.sample

    def sample(logits, params, *args, **kwargs):  # what NaN logits did to torch.multinomial
        if params.temperature == 0.123:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real_sample(logits, params, *args, **kwargs)

    monkeypatch.setattr(engine_module, "sample", sample)
    engine = Engine(llm.model, llm.tokenizer, num_blocks=64)
    prompt = llm.encode_chat(HI)
    params = [SamplingParams(temperature=0.7, seed=k) for k in range(3)] + [SamplingParams(temperature=0.123)]
    out = engine.generate([prompt] * 4, params=params, max_new_tokens=4, eos_token_ids=())
    assert [r["finish_reason"] for r in out] == ["length", "length", "length", "error"]
    assert "probability tensor" in out[3]["error"] and all(len(r["token_ids"]) == 4 for r in out[:3])


@pytest.mark.parametrize("body", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 2, "top_p": 1e-300},
                                  {"presence_penalty": 2, "frequency_penalty": -2, "temperature": 1e-6}], ids=str)
def test_extreme_valid_sampling_values_answer(live, body):
    app, client = live
    r = chat(client, **body, seed=1)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- 3. the event loop never waits for a step


def test_health_answers_while_a_long_step_runs(live, monkeypatch):
    app, client = live
    slow_steps(app, monkeypatch, 3.0)  # as long as a 2,000-token prefill on 2 cores
    worker = threading.Thread(target=chat, args=(client,), daemon=True)
    worker.start()
    assert wait_until(lambda: app.state.bridge.steps > 0 or app.state.bridge.engine.has_unfinished())
    time.sleep(0.2)  # inside the first slow step now
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 200
        times.append(time.perf_counter() - t0)
    assert max(times) < 0.1, times
    worker.join()


def test_a_slow_chat_template_does_not_freeze_the_server(llm):
    """The template renders off the event loop, within its time limit, and the request gets a 400."""
    tokenizer = copy.copy(llm.tokenizer)
    tokenizer.chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    background = BackgroundServer(create_app(LLM(llm.model, tokenizer), model_name=MODEL))
    try:
        with httpx.Client(base_url=background.url, timeout=30) as client:
            result = {}
            worker = threading.Thread(target=lambda: result.update(r=chat(client)), daemon=True)
            worker.start()
            time.sleep(0.5)  # rendering now
            t0 = time.perf_counter()
            assert client.get("/health").status_code == 200
            assert time.perf_counter() - t0 < 0.1
            worker.join()
            assert result["r"].status_code == 400 and "ran for more than" in result["r"].json()["error"]["message"]
    finally:
        background.stop()


# ---------------------------------------------------------------- 4. a non-streaming client that hangs up


def test_a_non_streaming_hang_up_frees_its_blocks(live, monkeypatch):
    app, client = live
    slow_steps(app, monkeypatch, 0.05)  # 500 tokens would take 25 s
    with pytest.raises(httpx.TimeoutException):
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 500}, timeout=1.0)
    engine = app.state.bridge.engine
    assert wait_until(lambda: not engine.has_unfinished(), timeout=5.0)
    assert engine.manager.num_free_blocks == engine.manager.num_blocks and engine.finish_reasons["abort"] == 1
    assert client.get("/health").json()["in_flight"] == 0


# ---------------------------------------------------------------- 5. 400s, not plain-text 500s


NESTED = b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
BAD_400 = {
    "JSON nested 5,000 deep": ("/v1/chat/completions", NESTED, None),
    "text part is a number": ("/v1/chat/completions",
                              {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    "text part is null": ("/v1/chat/completions",
                          {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages"),
    "lone surrogate in a prompt": ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    "lone surrogate in a message": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]},
                                    "messages[0].content"),
    "seed 2**64": ("/v1/chat/completions", {"messages": HI, "seed": 2**64}, "seed"),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    "stream 'no'": ("/v1/chat/completions", {"messages": HI, "stream": "no"}, "stream"),
    "logprobs 'yes'": ("/v1/chat/completions", {"messages": HI, "logprobs": "yes"}, "logprobs"),
    "top_logprobs true": ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": True},
                          "top_logprobs"),
    "logprobs 6 on completions": ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    "temperature 1e308": ("/v1/chat/completions", {"messages": HI, "temperature": 1e308}, "temperature"),
    "frequency_penalty -3": ("/v1/chat/completions", {"messages": HI, "frequency_penalty": -3}, "frequency_penalty"),
    "presence_penalty 1e39": ("/v1/chat/completions", {"messages": HI, "presence_penalty": 1e39}, "presence_penalty"),
    "prompt too long on completions": ("/v1/completions", {"prompt": "hi " * 2100}, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD_400))
def test_bad_input_is_a_400_with_openai_json(live, case):
    app, client = live
    path, body, param = BAD_400[case]
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL, "max_tokens": 2, **body}).encode()
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert chat(client).status_code == 200  # and the next request is served


def test_an_unexpected_error_is_a_json_500_and_the_server_goes_on(live, monkeypatch):
    app, client = live
    import minillm.serve.server as server_module

    def broken(*args, **kwargs):
        raise KeyError("planted")

    monkeypatch.setattr(server_module, "parse_completion", broken)
    r = chat(client)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error" and "KeyError" in r.text
    monkeypatch.undo()
    assert chat(client).status_code == 200
