"""logit_bias (both endpoints) and /v1/completions' echo and logprobs (issue 52), through the openai client
and plain HTTP: the prompt's logprobs an echo returns equal minillm.runtime.generate.prompt_logprobs (checked
against transformers in notebook 10) within 1e-4, alternatives included; max_tokens 0 with echo scores the
prompt and writes nothing (lm-evaluation-harness's local-completions asks for that); n choices carry the same
prompt scores; logit_bias moves and forces the greedy first token; bad values are 400s naming their field."""

from __future__ import annotations

import httpx
import openai
import pytest

from minillm.api import LLM
from minillm.runtime.generate import prompt_logprobs
from minillm.serve.server import BackgroundServer, create_app

MODEL = "smollm2"
PROMPT = "The capital of France is Paris, and the capital of Italy is"
TOL = 1e-4


@pytest.fixture(scope="module")
def served(smollm2):
    llm = LLM(*smollm2)
    background = BackgroundServer(create_app(llm, model_name=MODEL, num_blocks=32))
    with httpx.Client(base_url=background.url, timeout=60) as http:
        yield llm, http, openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0)
    background.stop()


def token(llm: LLM, tid: int) -> str:
    return llm.tokenizer.token_bytes(tid).decode("utf-8", errors="replace")


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    return r.json()["error"]["message"]


def test_echo_logprobs_equal_the_reference_prompt_logprobs(served):
    llm, _, client = served
    ids = llm.tokenizer.encode(PROMPT)
    ref = prompt_logprobs(llm.model, ids, 3)
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=3)
    choice = answer.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(llm.tokenizer.decode(ids)) and len(choice.text) > len(llm.tokenizer.decode(ids))
    assert lp.tokens[:len(ids)] == [token(llm, t) for t in ids] and len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    worst = max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], ref.logprobs[1:]))
    assert worst < TOL, worst
    for got, want in zip(lp.top_logprobs[1:len(ids)], ref.top_logprobs[1:]):
        assert len(got) == 3  # a {token: logprob} map of the 3 most likely there
        assert all(abs(got[token(llm, t)] - v) < TOL for t, v in want)
    offsets = [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 2
    # the generated tokens' logprobs are those of the same request without echo
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=3)
    assert plain.choices[0].text == choice.text[len(llm.tokenizer.decode(ids)):]
    assert plain.choices[0].logprobs.tokens == lp.tokens[len(ids):]
    assert max(abs(a - b) for a, b in zip(plain.choices[0].logprobs.token_logprobs, lp.token_logprobs[len(ids):])) < TOL


def test_max_tokens_0_with_echo_scores_the_prompt_and_writes_nothing(served):
    llm, http, _ = served
    ids = llm.tokenizer.encode(PROMPT)
    ref = prompt_logprobs(llm.model, ids, 1)
    # lm-evaluation-harness's local-completions: token ids in a list of one, echo, logprobs 1
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [ids], "max_tokens": 0, "echo": True,
                                           "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["text"] == llm.tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], ref.logprobs[1:])) < TOL
    greedy = [abs(max(top.values()) - ref_top[0][1]) < TOL for top, ref_top in zip(lp["top_logprobs"][1:],
                                                                                    ref.top_logprobs[1:])]
    assert all(greedy)
    refused(http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0}), "max_tokens")


def test_every_choice_carries_the_prompt_scores(served):
    llm, http, _ = served
    ids = llm.tokenizer.encode(PROMPT)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 3, "seed": 5,
                                           "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 3
    heads = [c["logprobs"]["token_logprobs"][:len(ids)] for c in choices]
    assert heads[0] == heads[1] == heads[2] and heads[0][1] is not None
    assert all(c["logprobs"]["top_logprobs"][1] == {} for c in choices)  # logprobs 0: the chosen token's only


def test_echo_without_logprobs_returns_the_prompt_text_only(served):
    llm, http, _ = served
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                           "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(llm.tokenizer.decode(llm.tokenizer.encode(PROMPT))) and choice["logprobs"] is None


def test_logit_bias_moves_and_forces_the_greedy_first_token(served):
    llm, _, client = served
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    greedy = llm.tokenizer.encode(first.choices[0].logprobs.tokens[0], add_special_tokens=False)
    assert len(greedy) == 1
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1,
                                       logit_bias={str(greedy[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != first.choices[0].logprobs.tokens[0]
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    for answer in (client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                             logit_bias={str(forced): 100}),
                   client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=1, temperature=0, logit_bias={str(forced): 100})):
        text = answer.choices[0].text if hasattr(answer.choices[0], "text") else answer.choices[0].message.content
        assert text == token(llm, forced)


@pytest.mark.parametrize("bias, words", [({"abc": 5}, "token ids"), ({"1.5": 5}, "token ids"),
                                         ({"5": 101}, "101"), ({"5": "x"}, "logit_bias"), ({"-1": 5}, "-1"),
                                         ({"49152": 5}, "49152"), ([5], "logit_bias")])
def test_a_bad_logit_bias_is_a_400_naming_it(served, bias, words):
    llm, http, _ = served
    assert llm.model.config.vocab_size == 49152
    for path, base in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions",
                                                                 {"messages": [{"role": "user", "content": "Hi"}]})):
        message = refused(http.post(path, json={"model": MODEL, **base, "max_tokens": 1, "logit_bias": bias}),
                          "logit_bias")
        assert words in message, message


@pytest.mark.parametrize("extra, param", [({"logprobs": 6}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                                          ({"logprobs": True}, "logprobs"), ({"echo": "yes"}, "echo"),
                                          ({"echo": True, "stream": True}, "echo"),
                                          ({"logprobs": 2, "stream": True}, "logprobs"),
                                          ({"top_logprobs": 2}, "top_logprobs")])
def test_bad_echo_and_logprobs_are_400s_naming_them(served, extra, param):
    _, http, _ = served
    refused(http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, **extra}), param)
