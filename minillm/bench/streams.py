"""The benchmark's "streams" rows (plumbing, not a lesson): the server as chatting users meet it.

C requests at once (--concurrency, default 1 4 16), each its own chat (a user message of its own in
the model's chat template), streamed to exactly --tokens new tokens (128 by default; `ignore_eos`),
the prompt sent as token ids to /v1/completions. Each side is a server process started here, as an
operator starts it, and serves the bursts after one warm-up request:

- `python -m minillm serve` with each flag set asked for (--serving; default fast-int4, gguf and
  fast: `--fast --quantize int4`, `--quantize gguf` and `--fast`; fast-int4-compiled and fast-compiled
  add `--compile`);
- with --peers llama.cpp, llama.cpp's own `llama-server` (-np as many slots as the largest C, the
  same threads, the same GGUF file).

The clients run in a process of their own (minillm/bench/serve.py's `http_clients`). Per side and C:
output tokens per second over the burst (first request sent to last token), time to first token and
inter-token latency at p50; the "transformers" column holds llama-server's figure, and the ratio is
minillm's over it. Per side: the seconds from starting the process to its first answer of /health.
Beside them, each flag set's model decoding one of the chats in this process (`generate.stream`,
batch 1, after a warm-up) and the share of that speed its server keeps at C = 1.
"""

from __future__ import annotations

import sys
import time

import torch

from minillm.api import load
from minillm.bench.native import LlamaServer, ServerProcess, llama_server_binary
from minillm.bench.serve import SERVING_VARIANTS, Arrival, counted, http_clients, serving_metrics
from minillm.runtime.generate import stream
from minillm.text.tokenizer import Tokenizer

QUESTIONS = ["Tell me about the history of {}.", "Write a short story set in {}.", "What should a visitor see in {}?",
             "Describe the food of {}.", "Explain the economy of {}."]
PLACES = ["Paris", "Kyoto", "Lima", "Oslo", "Cairo", "Quebec", "Hanoi", "Nairobi"]


class MinillmServer(ServerProcess):
    """`python -m minillm serve` with `flags` on `gguf`, started, awaited and stopped as llama-server is
    (its /health answers 200 once the model is loaded and the server listens)."""

    def __init__(self, gguf, flags: list[str], threads: int, timeout: float = 600.0):
        super().__init__(lambda host, port: [
            "env", f"OMP_NUM_THREADS={threads}", sys.executable, "-m", "minillm", "serve", "--model", str(gguf),
            "--host", host, "--port", str(port), "--access-log", "off", *flags], timeout)


def chats(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    """n different chat prompts as token ids: a question about a place, in the model's chat template."""
    messages = [QUESTIONS[i % len(QUESTIONS)].format(PLACES[i % len(PLACES)]) for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": m}]) for m in messages]


def in_process_decode(flags: list[str], source, prompt: list[int], tokens: int) -> float:
    """Decode tokens per second of one chat on the flag set's model in this process, batch 1 (after a warm-up)."""
    quantize = flags[flags.index("--quantize") + 1] if "--quantize" in flags else None
    llm = load(source, quantize=quantize, fast="--fast" in flags, compile="--compile" in flags)
    for _ in stream(llm.model, llm.tokenizer, prompt[:8], max_new_tokens=2, eos_token_ids=()):
        pass
    times = [time.perf_counter() for _ in stream(llm.model, llm.tokenizer, prompt, max_new_tokens=tokens,
                                                 eos_token_ids=())]
    return (len(times) - 1) / (times[-1] - times[0])


def bursts(server: ServerProcess, workloads: dict[int, list[Arrival]]) -> tuple[float, dict[int, dict]]:
    """(seconds from the server's start to ready, each burst's metrics) for a server process not yet started."""
    t0 = time.perf_counter()
    with server as url:
        ready = time.perf_counter() - t0
        times = {c: http_clients(url, ws) for c, ws in workloads.items()}  # each after its own warm-up request
    metrics = {c: serving_metrics(ws, counted(ws, times[c]), slo_ttft=float("inf"), slo_tpot=float("inf"))
               for c, ws in workloads.items()}
    return ready, metrics


def streams_rows(source, args, row, skipped: dict) -> None:
    """Rows of the streams section for the GGUF file `source` (see the module docstring)."""
    native = llama_server_binary(source, skipped) if "llama.cpp" in args.peers else None
    concurrency = args.concurrency or [1, 4, 16]
    prompts = chats(load(source).tokenizer, max(concurrency))
    workloads = {c: [Arrival(0.0, p, args.tokens) for p in prompts[:c]] for c in concurrency}
    blank = {"throughput": None, "ttft_p50": None, "itl_p50": None}
    theirs_ready, theirs = None, {c: blank for c in concurrency}
    if native:
        room = max(len(p) for p in prompts) + args.tokens
        theirs_ready, theirs = bursts(LlamaServer(native, source, torch.get_num_threads(), max(concurrency),
                                                  -(-(room + 16) // 256) * 256), workloads)
    for variant in args.serving:
        ready, ours = bursts(MinillmServer(source, SERVING_VARIANTS[variant], torch.get_num_threads()), workloads)
        decode = in_process_decode(SERVING_VARIANTS[variant], source, prompts[0], args.tokens)
        row("streams", variant, "start to ready", "s", ready, theirs_ready)
        row("streams", variant, "in-process decode", "tok/s", decode, n=1)
        for c in concurrency:
            row("streams", variant, "output", "tok/s", ours[c]["throughput"], theirs[c]["throughput"], n=c)
            row("streams", variant, "time to first token p50", "ms", ours[c]["ttft_p50"] * 1e3,
                _ms(theirs[c]["ttft_p50"]), n=c)
            row("streams", variant, "inter-token p50", "ms", ours[c]["itl_p50"] * 1e3, _ms(theirs[c]["itl_p50"]), n=c)
        if 1 in concurrency:
            row("streams", variant, "served / in-process at 1", "x", ours[1]["throughput"] / decode, n=1)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3

