"""/metrics held to what Prometheus expects (issue 52, point 6), on a live server on 127.0.0.1.

`lint` is a promtool-style check written out here (promtool itself is a Go binary this machine does
not have): the page parses with prometheus-client's strict parser; every family has one HELP and one
TYPE, before its samples, and no family appears twice; names are snake_case under `minillm_`; a
counter's samples end in `_total` and nothing else does; a time is in `_seconds`, a fraction in
`_ratio`, and nothing is a since-start `_rate`; a histogram's buckets rise with `le` up to `+Inf`,
whose count is `_count`, next to a `_sum`; no `_created` series. A planted page with one fault of
each kind shows the check finds them. Then the metrics themselves: a tool-call answer counts as
`tool_calls` (the finish_reason the client saw), the queue time of a request that waited for a batch
slot, the KV cache's usage fraction, the prefix cache's two counters, and a latency histogram that
counts generations only.
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minillm.serve.server import BackgroundServer, create_app
from support import serving, slow_steps

MODEL = "smollm2"
HI = [{"role": "user", "content": "Write a word."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAME = re.compile(r"minillm_[a-z0-9]+(_[a-z0-9]+)*")
LABEL = re.compile(r"[a-z][a-z0-9_]*")


@pytest.fixture(scope="module")
def server(llm):
    with serving(create_app(llm, model_name=MODEL, num_blocks=128)) as running:
        yield running


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def scrape(url: str) -> str:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def values(text: str) -> dict:
    """{(sample name, labels): value} of a page."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def lint(text: str) -> list[str]:
    """What a strict reader of Prometheus' text format would complain about (see the module docstring)."""
    problems = []
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as error:
        return [f"the strict parser refuses the page: {error}"]
    comments = Counter((kind, name) for kind, name in re.findall(r"^# (HELP|TYPE) (\S+)", text, re.M))
    typed = [name for kind, name in re.findall(r"^# (HELP|TYPE) (\S+)", text, re.M) if kind == "TYPE"]
    problems += [f"{name}: {n} TYPE lines" for name, n in Counter(typed).items() if n > 1]
    for name in dict.fromkeys(typed):
        if comments[("HELP", name)] != 1:
            problems.append(f"{name}: {comments[('HELP', name)]} HELP lines")
        if not re.search(rf"^# HELP {name} .*\n# TYPE {name} ", text, re.M):
            problems.append(f"{name}: HELP does not come right before TYPE")
    seen = Counter(f.name for f in families)
    problems += [f"{name}: {n} families of one name" for name, n in seen.items() if n > 1]
    for family in families:
        name, kind, samples = family.name, family.type, family.samples
        if kind in ("unknown", "untyped"):
            problems.append(f"{name}: no TYPE")
        if not family.documentation.strip():
            problems.append(f"{name}: empty HELP")
        if not NAME.fullmatch(name):
            problems.append(f"{name}: not a snake_case minillm_ name")
        if name.endswith("_created") or any(s.name.endswith("_created") for s in samples):
            problems.append(f"{name}: a _created series")
        if name.endswith("_rate"):
            problems.append(f"{name}: a since-start ratio named _rate (export the counters)")
        timed = any(word in name.split("_") for word in ("time", "latency", "duration", "seconds"))
        if timed and not name.endswith("_seconds"):
            problems.append(f"{name}: a time not in _seconds")
        if kind == "counter" and not all(s.name == name + "_total" for s in samples):
            problems.append(f"{name}: a counter sample without _total")
        if kind != "counter" and (name.endswith("_total") or any(s.name.endswith("_total") for s in samples)):
            problems.append(f"{name}: a {kind} named _total")
        if kind == "gauge" and any(word in name for word in ("fraction", "usage", "share")) and not name.endswith("_ratio"):
            problems.append(f"{name}: a fraction not in _ratio")
        for s in samples:
            problems += [f"{s.name}: label {label!r} not snake_case" for label in s.labels if not LABEL.fullmatch(label)]
        if kind == "histogram":
            problems += histogram_problems(name, samples)
    return problems


def histogram_problems(name: str, samples) -> list[str]:
    """Per label set (le aside): buckets rising with le, the last +Inf, its count equal to _count; a _sum."""
    series: dict[tuple, dict] = {}
    for s in samples:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        entry = series.setdefault(key, {"buckets": []})
        if s.name == name + "_bucket":
            entry["buckets"].append((float(s.labels["le"]), s.value))
        else:
            entry[s.name.removeprefix(name)] = s.value
    problems = []
    for key, entry in series.items():
        buckets = entry["buckets"]
        if not buckets or buckets[-1][0] != math.inf:
            problems.append(f"{name}{key}: no +Inf bucket last")
            continue
        if [b for b, _ in buckets] != sorted(b for b, _ in buckets) or any(
                a[1] > b[1] for a, b in zip(buckets, buckets[1:])):
            problems.append(f"{name}{key}: buckets do not rise with le")
        if entry.get("_count") != buckets[-1][1]:
            problems.append(f"{name}{key}: +Inf bucket {buckets[-1][1]} != _count {entry.get('_count')}")
        if "_sum" not in entry:
            problems.append(f"{name}{key}: no _sum")
    return problems


def test_the_metrics_page_passes_a_promtool_style_check(server):
    app, url = server
    client = client_for(url)
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0)
    list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0, stream=True))
    client.completions.create(model=MODEL, prompt="The sea is", max_tokens=3)
    client.models.list()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=-1)
    text = scrape(url)
    assert lint(text) == []
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"minillm_queue_time_seconds", "minillm_kv_cache_usage_ratio", "minillm_prefix_cache_hits",
            "minillm_prefix_cache_queries", "minillm_choices_finished"} <= names
    assert "_created" not in text and "minillm_prefix_cache_hit_rate" not in text


PLANTED = """\
# HELP minillm_good_total A counter
# TYPE minillm_good_total counter
minillm_good_total 1
minillm_good_created 1.7e9
# TYPE minillm_nohelp gauge
minillm_nohelp 1
# HELP minillm_hit_rate A since-start ratio
# TYPE minillm_hit_rate gauge
minillm_hit_rate 0.5
# HELP minillm_wait_time_ms A time in milliseconds
# TYPE minillm_wait_time_ms gauge
minillm_wait_time_ms 12
# HELP minillm_cache_usage A fraction
# TYPE minillm_cache_usage gauge
minillm_cache_usage 0.3
# HELP minillm_lat_seconds A histogram whose +Inf bucket is not its count
# TYPE minillm_lat_seconds histogram
minillm_lat_seconds_bucket{le="0.1"} 2
minillm_lat_seconds_bucket{le="+Inf"} 3
minillm_lat_seconds_count 4
minillm_lat_seconds_sum 1.5
# HELP minillm_twice A gauge declared twice
# TYPE minillm_twice gauge
minillm_twice 1
# HELP minillm_twice A gauge declared twice
# TYPE minillm_twice gauge
minillm_twice 2
"""


def test_the_check_finds_each_planted_fault():
    problems = "\n".join(lint(PLANTED))
    for fault in ("minillm_good_created: a _created series", "minillm_nohelp: 0 HELP lines", "minillm_hit_rate: a since-start",
                  "minillm_wait_time_ms: a time not in _seconds", "minillm_cache_usage: a fraction not in _ratio",
                  "+Inf bucket 3 != _count 4", "minillm_twice: 2 TYPE lines"):
        assert fault in problems, fault
    assert lint("minillm_x{le=}") and "strict parser" in lint("minillm_x{le=}")[0]


def test_a_tool_call_counts_as_tool_calls_whole_and_streamed(server):
    app, url = server
    client = client_for(url)
    before = values(scrape(url))
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                  tool_choice="required", max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion()
    after = values(scrape(url))
    moved = lambda reason: (after.get(("minillm_choices_finished_total", (("reason", reason),)), 0)
                            - before.get(("minillm_choices_finished_total", (("reason", reason),)), 0))
    assert whole.choices[0].finish_reason == streamed.choices[0].finish_reason == "tool_calls"
    assert moved("tool_calls") == 2 and moved("stop") == 0


def test_the_latency_histogram_counts_generations_only(server):
    app, url = server
    client = client_for(url)
    count = lambda: values(scrape(url))[("minillm_request_latency_seconds_count", ())]
    before = count()
    for _ in range(3):
        client.models.list()
    httpx.post(url + "/tokenize", json={"prompt": "hello"})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=-1)
    assert count() == before
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0)
    assert count() == before + 1


def test_kv_usage_ratio_and_prefix_cache_counters(server):
    app, url = server
    client = client_for(url)
    long = [{"role": "user", "content": "Tell me about the sea. " * 8}]  # several full blocks of 16 tokens
    before = values(scrape(url))
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=2, temperature=0)
    after = values(scrape(url))
    moved = lambda name: after[(name, ())] - before[(name, ())]
    assert moved("minillm_prefix_cache_hits_total") > 0  # the second request found the first one's blocks
    assert 0 < moved("minillm_prefix_cache_hits_total") <= moved("minillm_prefix_cache_queries_total")
    manager = app.state.bridge.engine.manager
    used = after[("minillm_kv_blocks_used", ())]
    assert after[("minillm_kv_cache_usage_ratio", ())] == pytest.approx(used / manager.num_blocks)
    assert 0 <= after[("minillm_kv_cache_usage_ratio", ())] <= 1


def test_a_request_that_waits_for_a_batch_slot_shows_its_queue_time(llm, monkeypatch):
    """One sequence at a time, each step slowed to 50 ms: a request sent while a stream of 20 tokens
    holds the slot waits for the rest of that stream, at least 19 steps, so one queue time is > 0.5 s
    (and the stream's own, admitted at once, is not)."""
    app = create_app(llm, model_name=MODEL, num_blocks=64, max_num_seqs=1)
    slow_steps(app, monkeypatch, 0.05)
    background = BackgroundServer(app)
    try:
        client = client_for(background.url)
        stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        next(iter(stream))  # the stream holds the one slot now
        waited = threading.Thread(target=client.chat.completions.create,
                                  kwargs=dict(model=MODEL, messages=HI, max_tokens=2, temperature=0))
        waited.start()
        list(stream)
        waited.join(timeout=120)
        page = values(scrape(background.url))
    finally:
        background.stop()
    assert page[("minillm_queue_time_seconds_count", ())] == 2
    assert page[("minillm_queue_time_seconds_bucket", (("le", "0.5"),))] == 1  # the other one waited longer
    assert page[("minillm_queue_time_seconds_sum", ())] < page[("minillm_time_to_first_token_seconds_sum", ())]
