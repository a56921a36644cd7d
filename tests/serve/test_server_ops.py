"""A server you can leave running (issue 24), through the official openai client on 127.0.0.1:
n choices, API keys, per-key limits with Retry-After, Prometheus metrics, the access log, request
timeouts and a graceful shutdown (in-process, and a real SIGTERM to `python -m minillm serve`).

Nothing here is timed: a limit or a shutdown is provoked by order (a stream held open, a step
slowed down on purpose), never by racing a clock."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minillm.serve import server as server_module
from minillm.serve.server import BackgroundServer, create_app
from minillm.serve.ops import APIKeys, KeyLimits, TokenBucket, key_id, read_keys
from support import serving, slow_steps, wait_until

MODEL = "smollm2"
KEY_A, KEY_B = "sk-test-alpha-0123", "sk-test-beta-4567"
HI = [{"role": "user", "content": "Write a word."}]


@pytest.fixture(scope="module")
def server(llm):
    with serving(create_app(llm, model_name=MODEL, num_blocks=128, api_keys=[KEY_A, KEY_B])) as running:
        yield running


def client_for(url: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return client_for(server[1])


def sampled(client, n=1, seed=7, **kw):
    return client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=1.0, top_p=0.95,
                                          seed=seed, n=n, **kw)


def metrics(url: str) -> dict:
    """The /metrics page parsed by prometheus-client's own parser: {(name, labels): value}."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ---------------------------------------------------------------- n choices


def test_n3_equals_three_seeded_requests_and_counts_the_prompt_once(client):
    three = sampled(client, n=3)
    alone = [sampled(client, seed=7 + i) for i in range(3)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in three.choices}) > 1
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert three.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_n_streamed_chunks_carry_their_index(client):
    whole = sampled(client, n=2)
    texts, finishes, usage = {0: "", 1: ""}, {0: [], 1: []}, None
    for chunk in sampled(client, n=2, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] += [c.finish_reason] if c.finish_reason else []
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert [finishes[0], finishes[1]] == [[c.finish_reason] for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_best_of_returns_one_of_the_generated_choices_and_counts_them_all(client):
    kw = dict(model=MODEL, prompt="The sea is", max_tokens=6, temperature=1.0, seed=3)
    three = client.completions.create(n=3, **kw)
    best = client.completions.create(n=1, best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text in [c.text for c in three.choices]
    assert best.usage.completion_tokens == three.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=2, best_of=1, **kw)


# ---------------------------------------------------------------- API keys


def test_every_v1_route_needs_a_valid_key_and_health_does_not(server):
    url = server[1]
    c = client_for(url, "sk-wrong-key-000")
    for call in (lambda: c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2),
                 lambda: c.completions.create(model=MODEL, prompt="Hi", max_tokens=2),
                 lambda: c.models.list()):
        with pytest.raises(openai.AuthenticationError) as info:
            call()
        error = info.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
        r = httpx.request(method, url + path, json={"model": MODEL, "messages": HI, "prompt": "Hi"})  # no header
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Basic {KEY_A}"},
                   json={"model": MODEL, "messages": HI})
    assert r.status_code == 401 and KEY_A not in r.text
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert [m.id for m in client_for(url, KEY_B).models.list().data] == [MODEL]


def test_keys_are_compared_whole_and_never_named():
    keys = APIKeys([KEY_A, KEY_B])
    assert keys.identify(f"Bearer {KEY_A}") == key_id(KEY_A) != key_id(KEY_B) == keys.identify(f"bearer  {KEY_B}")
    assert KEY_A not in key_id(KEY_A) and key_id(KEY_A).startswith("key-")
    for header in (None, "", "Bearer", f"Bearer {KEY_A[:-1]}", f"Bearer {KEY_A}x", f"Token {KEY_A}"):
        with pytest.raises(Exception, match="API key") as info:
            keys.identify(header)
        assert info.value.status == 401
    assert APIKeys().identify(None) == "anonymous"  # no keys configured: open


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# team A\n{KEY_A}\n\n  {KEY_B}  \n")
    assert read_keys(["sk-flag-key-9"], path, {"MINILLM_API_KEY": "sk-env-key-77"}) == \
        ["sk-flag-key-9", KEY_A, KEY_B, "sk-env-key-77"]
    for bad in ("short", "has space 123", "naïve-key-123"):
        with pytest.raises(ValueError, match="--api-key"):
            read_keys([bad], environ={})


# ---------------------------------------------------------------- per-key limits


def test_token_bucket_lets_a_request_start_out_of_debt_and_charges_as_it_goes():
    now = [0.0]
    bucket = TokenBucket(60, clock=lambda: now[0])  # one token a second, at most 60
    assert bucket.wait() == 0
    bucket.charge(90)  # a long request may overdraw: the level is now -30
    assert bucket.wait() == pytest.approx(30, abs=1e-6)
    now[0] = 29.0
    assert bucket.wait() == pytest.approx(1, abs=1e-6)
    now[0] = 1000.0
    assert bucket.wait() == 0 and bucket.level == 60  # refilled, capped at a minute's worth


def test_key_limits_count_each_key_apart_and_release_once():
    now = [0.0]
    limits = KeyLimits(max_concurrent=1, tokens_per_minute=60, clock=lambda: now[0])
    release = limits.enter("a")
    with pytest.raises(Exception) as info:
        limits.enter("a")
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
    release_b = limits.enter("b")  # another key is not affected
    release(), release()  # twice: counted once
    limits.charge("a", 100)
    with pytest.raises(Exception) as info:
        limits.enter("a")
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "40"}
    release_b()
    assert limits.running == {}  # no state left for keys with nothing in flight
    with pytest.raises(ValueError, match="tokens_per_minute"):
        KeyLimits(tokens_per_minute=0)


def test_a_key_past_its_tokens_per_minute_gets_429_with_retry_after(llm):
    background = BackgroundServer(create_app(llm, model_name=MODEL, num_blocks=64, api_keys=[KEY_A, KEY_B],
                                             tokens_per_minute=40))
    try:
        a, b = client_for(background.url, KEY_A), client_for(background.url, KEY_B)
        for _ in range(2):  # ~30 prompt tokens + 4 each: the second starts above zero and ends ~30 in debt
            a.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0)
        with pytest.raises(openai.RateLimitError) as info:
            a.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0)
        assert int(info.value.response.headers["retry-after"]) >= 10
        assert info.value.response.json()["error"]["code"] == "rate_limit_exceeded"
        assert b.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0).choices
    finally:
        background.stop()


def test_a_key_past_its_concurrent_requests_gets_429_and_others_are_served(llm, monkeypatch):
    app = create_app(llm, model_name=MODEL, num_blocks=64, api_keys=[KEY_A, KEY_B], max_concurrent_per_key=1)
    slow_steps(app, monkeypatch, 0.05)
    background = BackgroundServer(app)
    try:
        a, b = client_for(background.url, KEY_A), client_for(background.url, KEY_B)
        held = a.chat.completions.create(model=MODEL, messages=HI, max_tokens=300, temperature=0, stream=True)
        next(iter(held))  # key A has one request in flight
        with pytest.raises(openai.RateLimitError) as info:
            a.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"
        assert b.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0).choices
        held.close()
        assert wait_until(lambda: httpx.get(background.url + "/health").json()["in_flight"] == 0, timeout=30)
        assert a.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0).choices
    finally:
        background.stop()


# ---------------------------------------------------------------- metrics and the access log


def test_metrics_parse_and_move_as_requests_are_served(server, client):
    app, url = server
    ok = ("minillm_requests_total", (("path", "/v1/chat/completions"), ("status", "200")))
    denied = ("minillm_requests_total", (("path", "/v1/chat/completions"), ("status", "401")))
    before = metrics(url)
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0)
    with pytest.raises(openai.AuthenticationError):
        client_for(url, "sk-wrong-key-000").chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    after = metrics(url)
    moved = lambda name: after.get(name, 0) - before.get(name, 0)
    assert moved(ok) == 1 and moved(denied) == 1
    assert moved(("minillm_prompt_tokens_total", ())) == r.usage.prompt_tokens
    assert moved(("minillm_generation_tokens_total", ())) == r.usage.completion_tokens
    assert moved(("minillm_time_to_first_token_seconds_count", ())) == 1
    assert moved(("minillm_inter_token_latency_seconds_count", ())) == r.usage.completion_tokens - 1
    assert moved(("minillm_choices_finished_total", (("reason", r.choices[0].finish_reason),))) == 1
    total = app.state.bridge.engine.manager.num_blocks
    assert after[("minillm_kv_blocks_free", ())] + after[("minillm_kv_blocks_used", ())] == total
    for name in ("minillm_running_sequences", "minillm_waiting_sequences", "minillm_kv_cache_usage_ratio",
                 "minillm_preemptions_total", "minillm_requests_in_flight", "minillm_request_latency_seconds_count",
                 "minillm_queue_time_seconds_count", "minillm_prefix_cache_queries_total"):
        assert (name, ()) in after, name
    assert moved(("minillm_queue_time_seconds_count", ())) == 1 and moved(("minillm_request_latency_seconds_count", ())) == 1
    assert 0 < after[("minillm_prefix_cache_hits_total", ())] <= after[("minillm_prefix_cache_queries_total", ())]


def test_one_json_access_log_line_per_request_names_the_key_by_id(server, client, caplog):
    with caplog.at_level(logging.INFO, logger="minillm.access"):
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
        with pytest.raises(openai.AuthenticationError):
            client_for(server[1], "sk-wrong-key-000").models.list()
    lines = [json.loads(rec.message) for rec in caplog.records if rec.name == "minillm.access"]
    assert [(x["status"], x["key"]) for x in lines] == [(200, key_id(KEY_A)), (401, "-")]
    assert lines[0]["id"] == r.id and lines[0]["path"] == "/v1/chat/completions"
    assert (lines[0]["prompt_tokens"], lines[0]["completion_tokens"]) == (r.usage.prompt_tokens,
                                                                          r.usage.completion_tokens)
    assert lines[0]["finish_reasons"] == [r.choices[0].finish_reason]
    assert 0 < lines[0]["ttft_ms"] <= lines[0]["latency_ms"]
    assert KEY_A not in caplog.text and "sk-wrong" not in caplog.text


# ---------------------------------------------------------------- timeouts and shutdown


def test_a_request_past_its_timeout_ends_with_length(llm, monkeypatch):
    app = create_app(llm, model_name=MODEL, num_blocks=64, request_timeout=0.5)
    slow_steps(app, monkeypatch, 0.1)  # 100 tokens would take 10 s
    background = BackgroundServer(app)
    try:
        c = client_for(background.url)
        r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=100, temperature=0, n=2)
        assert [x.finish_reason for x in r.choices] == ["length", "length"] and r.usage.completion_tokens < 100
        chunks = list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=100, temperature=0,
                                           stream=True))
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["length"]
        manager = app.state.bridge.engine.manager
        assert wait_until(lambda: manager.num_free_blocks == manager.num_blocks, timeout=30)
    finally:
        background.stop()


def test_shutdown_lets_requests_finish_within_the_grace_then_ends_the_rest(llm, monkeypatch):
    """The requests cut by the shutdown end with finish_reason "length", the spec's word for an answer cut
    short (its enum has no "shutdown"): told apart from a finished one by their token count."""
    for grace in (60.0, 0.0):
        app = create_app(llm, model_name=MODEL, num_blocks=64, shutdown_grace=grace)
        slow_steps(app, monkeypatch, 0.1)  # 8 tokens: about a second; 300: half a minute
        background = BackgroundServer(app)
        c = client_for(background.url)
        tokens = 8 if grace else 300
        stream = iter(c.chat.completions.create(model=MODEL, messages=HI, max_tokens=tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        next(stream)  # in flight
        stopper = threading.Thread(target=background.stop)
        stopper.start()
        assert wait_until(lambda: app.state.gate.draining)
        chunks = list(stream)
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        stopper.join()
        assert finishes == ["length"], grace
        generated = chunks[-1].usage.completion_tokens
        assert generated == tokens if grace else generated < tokens // 2, (grace, generated)
        with pytest.raises(openai.APIConnectionError):  # the listening socket is closed
            c.models.list()


def test_a_draining_server_answers_503_on_an_open_connection(server):
    app, url = server
    app.state.gate.draining = True
    try:
        r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"},
                       json={"model": MODEL, "messages": HI, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down" and r.headers["retry-after"]
        assert httpx.get(url + "/health").json()["status"] == "draining"
    finally:
        app.state.gate.draining = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_under_load_drains_and_exits_0():
    """`python -m minillm serve` with four long streams in flight: SIGTERM, a one-second grace, and
    every stream ends either complete or cut, with finish_reason "length"; none is lost; exit status 0."""
    port = free_port()
    env = {**os.environ, "MINILLM_API_KEY": KEY_A, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--port", str(port), "--shutdown-grace", "1",
                             "--access-log", "off"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _up(url), timeout=120), proc.stdout.read().decode() if proc.poll() else "no start"
        c = client_for(url)
        streams = [iter(c.chat.completions.create(model="smollm2-135m-instruct", max_tokens=400, temperature=0,
                                                  messages=[{"role": "user", "content": f"Count from {k} to 500."}],
                                                  stream=True)) for k in range(4)]
        for s in streams:
            next(s)  # every stream is in flight
        results = [None] * 4

        def finish(k):
            try:
                results[k] = [ch.choices[0].finish_reason for ch in streams[k] if ch.choices and ch.choices[0].finish_reason]
            except Exception as exc:  # a lost request: the test fails below, naming it
                results[k] = exc
        readers = [threading.Thread(target=finish, args=(k,)) for k in range(4)]
        for r in readers:
            r.start()
        proc.send_signal(signal.SIGTERM)
        for r in readers:
            r.join(timeout=120)
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()[-2000:]
        assert all(isinstance(r, list) and len(r) == 1 and r[0] in ("stop", "length") for r in results), results
        assert ["length"] in results  # 400 tokens each do not fit in one second: cut by the shutdown
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_port_in_use_exits_non_zero():
    """uvicorn runs in a thread of `serve` (the engine steps on the main one): its failed bind must still end
    the process with status 1, as uvicorn on the main thread would, not 0."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "minillm", "serve", "--port", str(port), "--access-log", "off"],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "address already in use" in run.stderr, (run.returncode, run.stderr[-1000:])


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_steps_with_a_short_gil_switch_interval_and_restores_it(llm, monkeypatch):
    """The engine thread waits for the GIL behind the HTTP thread's Python; `serve` has CPython hand it over
    after GIL_SWITCH_S, not the default 5 ms, while it runs, and leaves the process's setting as it found it
    (here on a port in use: uvicorn fails at once, and serve ends with SystemExit(1))."""
    seen, before = [], sys.getswitchinterval()
    monkeypatch.setattr(server_module, "step_here", lambda bridge, http: seen.append(sys.getswitchinterval()) or http.join())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as exit_:
            server_module.serve(llm, port=taken.getsockname()[1], access_log=None)
    assert exit_.value.code == 1 and seen == [server_module.GIL_SWITCH_S] and server_module.GIL_SWITCH_S < before
    assert sys.getswitchinterval() == before
