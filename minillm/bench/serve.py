"""The benchmark's serve section (plumbing): requests that arrive over time, as a server sees them.

In the manner of vLLM's benchmark_serving: a seeded workload of requests whose arrival times
follow a Poisson process at --rate requests per second (or a burst: all at t = 0), with prompt
and output lengths drawn from ranges, and a share of the prompts beginning with one of two
shared system prompts (64 tokens: four full blocks a prefix cache can reuse). Each side serves
the same requests in the same order as they arrive, greedy, end-of-sequence off:

- minillm: the engine in-process (notebook 17, prefix caching on), stepped by this thread, each
  request added when it is due;
- transformers' continuous batching: `ContinuousBatchingManager` (its paged cache, its
  scheduler, its own thread), each request added when it is due, its token timestamps recorded;
- transformers' padded generate, as a static-batching server: whatever has arrived when the
  previous batch is done runs as one left-padded batch to its longest request; a token counts as
  delivered at the end of the step that made it (a logits processor reads the clock each step),
  the best a streaming static server could do.

Reported per side: output tokens/s over the whole run (first arrival to last token), time to
first token (arrival to first token) and inter-token latency (between consecutive tokens of a
request) at p50/p90/p99, and goodput: requests per second that met both latency limits
(--slo-ttft seconds to the first token, --slo-tpot seconds per later token, on average).

The Poisson workload also goes through minillm's OpenAI server (notebook 18) over HTTP: uvicorn
in a thread of this process, the clients in another process (one thread per request),
/v1/completions streamed with the prompt as token ids and `ignore_eos`; a token counts as
delivered when its chunk arrives (variant "http vs in-process": the other column holds the
in-process run). With --peers llama.cpp, llama.cpp's own llama-server (minillm/bench/native.py: -np as
many slots as requests, continuous batching, the same threads, on the same GGUF file) gets both
workloads the same way over HTTP, the same prompt ids, `ignore_eos` and max_tokens (its
/v1/completions honours both: each request makes exactly its tokens, `counted` checks it); minillm's
OpenAI server serves them too, with the fast path in float32 (variant "http vs llama-server") and
with int4 weights (variant "int4 http vs llama-server"), the counterpart of a Q4_1 file such as the
embedded SmolLM2's. Then chunked prefill (notebook 17): a workload of long prompts (16-1024 tokens,
Poisson at a quarter of --rate) on minillm's engine with --prefill-chunk prompt tokens per step,
against the same engine prefilling each prompt whole; the row's "transformers" column holds the
whole-prefill run (variant "chunked vs whole prefill").
"""

from __future__ import annotations

import http.client
import json
import math
import multiprocessing
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from minillm.api import LLM
from minillm.bench.engine import pool_blocks, transformers_padded_batch
from minillm.bench.native import LlamaServer, llama_server_binary
from minillm.runtime.engine import Engine
from minillm.speed.fast import FastCausalLM
from minillm.serve.server import BackgroundServer, create_app

SERVING_VARIANTS = {"fast-int4": ["--fast", "--quantize", "int4"], "gguf": ["--quantize", "gguf"],  # streams: serve's
                    "fast": ["--fast"], "readable": [], "fast-int8": ["--fast", "--quantize", "int8"],  # flags
                    "fast-int4-compiled": ["--fast", "--quantize", "int4", "--compile"],
                    "fast-compiled": ["--fast", "--compile"]}
SYSTEM_TOKENS, SHARED_SHARE = 64, 0.5  # two shared system prompts of 64 tokens, on half of the requests
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Arrival:
    at: float               # seconds after the start of the run
    prompt: list[int]
    max_new_tokens: int


def serving_workload(source: list[int], n: int, rate: float | None, seed: int = 0, prompt_range=(16, 256),
                     new_range=(16, 96)) -> list[Arrival]:
    """n requests cut from `source` ids; Poisson arrivals at `rate` per second, or all at 0 (rate None).

    A request's prompt length (drawn from prompt_range) includes its system prompt when it has one."""
    rng = random.Random(seed)
    systems = [source[:SYSTEM_TOKENS], source[SYSTEM_TOKENS:2 * SYSTEM_TOKENS]]
    at, out = 0.0, []
    for _ in range(n):
        length, new = rng.randint(*prompt_range), rng.randint(*new_range)
        prefix = rng.choice(systems) if rng.random() < SHARED_SHARE and length > SYSTEM_TOKENS else []
        start = rng.randrange(2 * SYSTEM_TOKENS, len(source) - length)
        out.append(Arrival(at, prefix + source[start:start + length - len(prefix)], new))
        at += rng.expovariate(rate) if rate else 0.0
    return out


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank percentile: the smallest value with at least p% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def serving_metrics(workload: list[Arrival], times: list[list[float]], slo_ttft: float, slo_tpot: float) -> dict:
    """Throughput, latency percentiles and goodput from each request's token times (seconds from the start)."""
    ttft = [t[0] - w.at for w, t in zip(workload, times)]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0 for t in times]
    span = max(t[-1] for t in times) - min(w.at for w in workload)
    good = sum(f <= slo_ttft and p <= slo_tpot for f, p in zip(ttft, tpot))
    metrics = {"throughput": sum(map(len, times)) / span, "goodput": good / span, "met_slo": good}
    for p in PERCENTILES:
        metrics[f"ttft_p{p}"], metrics[f"itl_p{p}"] = percentile(ttft, p), percentile(itl or [0.0], p)
    return metrics


def _wait_until(t0: float, at: float) -> None:
    time.sleep(max(0.0, t0 + at - time.perf_counter()))


def minillm_serving(model, tokenizer, workload: list[Arrival], prefill_chunk: int | None = None) -> list[list[float]]:
    """Each request's token times on minillm's engine, requests added as they arrive."""
    blocks = pool_blocks(len(w.prompt) + w.max_new_tokens for w in workload)  # room for all at once
    engine = Engine(model, tokenizer, num_blocks=blocks + 8, block_size=16, max_num_seqs=len(workload),
                    prefill_chunk=prefill_chunk)
    engine.add_request(workload[0].prompt[:8], None, 2, eos_token_ids=())  # warm-up, before the clock starts
    while engine.has_unfinished():
        engine.step()
    index, times, i, t0 = {}, defaultdict(list), 0, time.perf_counter()
    while i < len(workload) or engine.has_unfinished():
        while i < len(workload) and workload[i].at <= time.perf_counter() - t0:
            index[engine.add_request(workload[i].prompt, None, workload[i].max_new_tokens, eos_token_ids=())] = i
            i += 1
        if not engine.has_unfinished():
            _wait_until(t0, workload[i].at)
            continue
        for out in engine.step():
            if out.token_id is not None:
                times[index[out.request_id]].append(time.perf_counter() - t0)
    return [times[j] for j in range(len(workload))]


def _stream_completion(url: str, arrival: Arrival, t0: float, times: list[float]) -> None:
    """POST one streamed /v1/completions when it is due; append the time of each token as it arrives."""
    _wait_until(t0, arrival.at)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"prompt": arrival.prompt, "max_tokens": arrival.max_new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response, made = conn.getresponse(), None
    assert response.status == 200, response.read()
    for line in response:  # server-sent events: b"data: {...}\n"
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter() - t0)
            made = chunk["usage"]["completion_tokens"] if chunk.get("usage") else made
    conn.close()
    # a token that ends inside a UTF-8 character has no text of its own: it arrives with the next one
    times += times[-1:] * (made - len(times))


def _clients(url: str, workload: list[Arrival], out) -> None:
    """The clients' process: one thread per request, each posting when due; sends back the token times."""
    times, t0 = [[] for _ in workload], time.perf_counter()
    clients = [threading.Thread(target=_stream_completion, args=(url, w, t0, t), daemon=True)
               for w, t in zip(workload, times)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    out.send(times)


def http_serving(model, tokenizer, workload: list[Arrival]) -> list[list[float]]:
    """Each request's token times through minillm's OpenAI server (notebook 18) over HTTP: uvicorn in
    a thread of this process, the clients in a process of their own (their threads would otherwise
    compete with the engine's for this interpreter's lock), streamed, the prompt as token ids."""
    blocks = pool_blocks(len(w.prompt) + w.max_new_tokens for w in workload)
    app = create_app(LLM(model, tokenizer), num_blocks=blocks + 8, max_num_seqs=len(workload), prefill_chunk=None)
    server = BackgroundServer(app)  # prefills as the in-process engine does: only HTTP differs
    try:
        return http_clients(server.url, workload)
    finally:
        server.stop()


def http_clients(url: str, workload: list[Arrival]) -> list[list[float]]:
    """Each request's token times from the OpenAI server at `url`: one warm-up request, then the
    clients in a process of their own, each request posted when it is due."""
    _stream_completion(url, Arrival(0.0, workload[0].prompt[:8], 2), time.perf_counter(), [])  # warm-up
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    clients = context.Process(target=_clients, args=(url, workload, send), daemon=True)
    clients.start()
    send.close()  # the clients' copy is the only one left: recv() fails, not hangs, if they die
    times = receive.recv()
    clients.join()
    return times


def llama_server_serving(binary, gguf, workload: list[Arrival]) -> list[list[float]]:
    """Each request's token times through llama.cpp's llama-server on `gguf` (started and stopped here):
    a slot per request, each slot's context rounded up to 256 tokens over the longest request."""
    longest = max(len(w.prompt) + w.max_new_tokens for w in workload)
    with LlamaServer(binary, gguf, torch.get_num_threads(), len(workload), -(-(longest + 16) // 256) * 256) as url:
        return http_clients(url, workload)


def transformers_continuous(hf, workload: list[Arrival]) -> list[list[float]]:
    """Each request's token times on transformers' ContinuousBatchingManager, requests added as they arrive."""
    # imported on use: transformers is the peer, installed for tests and benchmarks only (requirements-dev.txt)
    from transformers import ContinuousBatchingConfig, GenerationConfig

    pages = pool_blocks((len(w.prompt) + w.max_new_tokens for w in workload), page=256)
    manager = hf.init_continuous_batching(
        GenerationConfig(do_sample=False, max_new_tokens=max(w.max_new_tokens for w in workload), eos_token_id=-1,
                         pad_token_id=0),
        ContinuousBatchingConfig(page_size=256, num_blocks=pages + 4, max_batch_tokens=2048))
    manager.start()
    try:
        manager.add_request(workload[0].prompt[:8], request_id="warm-up", max_new_tokens=2)
        while manager.get_result(request_id="warm-up", timeout=600) is None:
            pass
        results, i, t0 = {}, 0, time.perf_counter()
        while len(results) < len(workload):
            while i < len(workload) and workload[i].at <= time.perf_counter() - t0:
                manager.add_request(workload[i].prompt, request_id=str(i), max_new_tokens=workload[i].max_new_tokens,
                                    record_timestamps=True, eos_token_id=-1)
                i += 1
            due = t0 + workload[i].at - time.perf_counter() if i < len(workload) else 1.0
            out = manager.get_result(timeout=min(max(due, 0.001), 1.0))
            if out is not None and out.is_finished():
                assert out.error is None, out.error
                results[int(out.request_id)] = [s - t0 for s in out.timestamps]
    finally:
        manager.stop(block=True)
        hf.destroy_cached_continuous_batching_manager()
    return [results[j] for j in range(len(workload))]


def transformers_static(hf, workload: list[Arrival], pad_id: int = 0) -> list[list[float]]:
    """Each request's token times on transformers' padded generate, as a static-batching server."""
    # imported on use: transformers is the peer, installed for tests and benchmarks only (requirements-dev.txt)
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):  # called once per step, when its tokens' logits are ready
        def __call__(self, input_ids, scores):
            steps.append(time.perf_counter() - t0)
            return scores

    times, i, t0 = [None] * len(workload), 0, time.perf_counter()
    while i < len(workload):
        _wait_until(t0, workload[i].at)
        batch, steps = [j for j in range(i, len(workload)) if workload[j].at <= time.perf_counter() - t0], []
        transformers_padded_batch(hf, [(workload[j].prompt, workload[j].max_new_tokens) for j in batch], pad_id,
                                  logits_processor=LogitsProcessorList([Clock()]))
        for j in batch:
            times[j] = steps[:workload[j].max_new_tokens]
        i = batch[-1] + 1
    return times


SIDES = {"vs continuous batch": transformers_continuous, "vs padded generate": transformers_static}
METRICS = [("throughput", "tok/s", 1), ("goodput", "req/s", 1)] + [
    (f"{kind}_p{p}", "ms", 1e3) for kind in ("ttft", "itl") for p in PERCENTILES]


def counted(workload: list[Arrival], times: list[list[float]]) -> list[list[float]]:
    """The token times, once each request is seen to have made exactly its max_new_tokens."""
    made = [len(t) for t in times]
    asked = [w.max_new_tokens for w in workload]
    assert made == asked, f"tokens made {made}, asked for {asked}"
    return times


def add_serve_flags(add, d, positive) -> None:
    """The serve section's flags, for bench.add_common (d: the default, or argparse.SUPPRESS; positive: a type)."""
    add("--rate", type=positive("--rate", float), default=d(2.0), help="serve: Poisson arrivals per second (default 2)")
    add("--serve-requests", type=positive("--serve-requests"), default=d(48), help="serve: requests (default 48)")
    add("--concurrency", type=positive("--concurrency"), nargs="+", default=d(None),
        help="streams: requests at once, one burst each (default 1 4 16)")
    add("--serving", nargs="+", choices=list(SERVING_VARIANTS), default=d(["fast-int4", "gguf", "fast"]),
        help="streams: the server's flag sets: fast-int4 is `serve --fast --quantize int4`, gguf `--quantize gguf`, "
             "a -compiled one adds --compile (default fast-int4 gguf fast)")
    add("--slo-ttft", type=positive("--slo-ttft", float), default=d(2.0),
        help="serve: goodput's limit on the time to first token, seconds (default 2)")
    add("--slo-tpot", type=positive("--slo-tpot", float), default=d(0.25),
        help="serve: goodput's limit on the mean time per later token, seconds (default 0.25)")
    add("--prefill-chunk", type=positive("--prefill-chunk"), default=d(512),
        help="serve: the engine's prompt tokens per step on the long-prompt workload (default 512)")


def metric_rows(row, variant: str, label: str, ours: dict, theirs: dict, n: int) -> None:
    """One row per metric: `ours` in the minillm column, `theirs` in the other."""
    for key, unit, scale in METRICS:
        row("serve", variant, f"{label} {key.replace('_', ' ')}", unit, ours[key] * scale, theirs[key] * scale, n=n)


def chunked_rows(model, tokenizer, args, row, source: list[int], n: int) -> None:
    """Long prompts (16-1024 tokens, Poisson at a quarter of --rate): minillm's engine with
    --prefill-chunk against itself prefilling every prompt whole, on every metric."""
    ranges = {"prompt_range": (8, 96), "new_range": (4, 16)} if args.quick else {"prompt_range": (16, 1024)}
    workload = serving_workload(source, n, args.rate / 4, seed=n, **ranges)
    whole, chunked = (serving_metrics(workload, counted(workload, minillm_serving(model, tokenizer, workload, chunk)),
                                      args.slo_ttft, args.slo_tpot) for chunk in (None, args.prefill_chunk))
    metric_rows(row, "chunked vs whole prefill", "long prompts", chunked, whole, n)


def serve_rows(sides, args, row, source: list[int], skipped: dict) -> None:
    """Rows of the serve section: a Poisson workload at --rate and a burst, minillm's fast engine
    against each of transformers' two ways on every metric; the Poisson one over HTTP too; with
    --peers llama.cpp, both over HTTP against llama-server; then chunked prefill on long prompts.
    source: the ids prompts are cut from."""
    n = 8 if args.quick else args.serve_requests
    ranges = {"prompt_range": (8, 48), "new_range": (4, 16)} if args.quick else {}
    model = FastCausalLM(sides.model).eval()
    native = llama_server_binary(sides.source, skipped) if "llama.cpp" in args.peers else None
    int4 = FastCausalLM(sides.model, quantize="int4", group_size=args.group_size).eval() if native else None
    metrics = lambda workload, times: serving_metrics(workload, counted(workload, times), args.slo_ttft, args.slo_tpot)
    for label, rate in ((f"poisson {args.rate:g}/s", args.rate), ("burst", None)):
        workload = serving_workload(source, n, rate, seed=n, **ranges)
        ours = metrics(workload, minillm_serving(model, sides.tokenizer, workload))
        for peer, serve in SIDES.items():
            metric_rows(row, peer, label, ours, metrics(workload, serve(sides.hf, workload)), n)
        if rate is not None or native:  # the same requests through the OpenAI server, over HTTP
            http = metrics(workload, http_serving(model, sides.tokenizer, workload))
        if rate is not None:
            metric_rows(row, "http vs in-process", label, http, ours, n)
        if native:  # llama.cpp's own server, against minillm's in float32 and in int4
            theirs = metrics(workload, llama_server_serving(native, sides.source, workload))
            metric_rows(row, "http vs llama-server", label, http, theirs, n)
            metric_rows(row, "int4 http vs llama-server", label,
                        metrics(workload, http_serving(int4, sides.tokenizer, workload)), theirs, n)
    chunked_rows(model, sides.tokenizer, args, row, source, n)
