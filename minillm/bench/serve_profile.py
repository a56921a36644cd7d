"""Where a served step's time goes (plumbing, not a lesson): the OpenAI server profiled while it streams.

    python -m minillm.bench.serve_profile [--concurrency 1 16] [--tokens 128] [--out FILE]

Starts the server as `serve` does (notebook 18: the engine stepping on this, the main, thread; uvicorn
in a thread of its own) on the embedded SmolLM2 with `--fast --quantize int4`, streams C chats at once
(minillm/bench/streams.py's, exactly --tokens tokens each, `ignore_eos`) from a client process after a
warm-up request, and runs cProfile on both threads. Each C runs twice: as the server is now ("after"),
and as it was before issue 53 ("before": the engine on a thread of its own, every layer in torch calls).

Reported per run, in ms per engine step (cProfile's cumulative times, so each includes what it calls):
the step, and in it the scheduler, the block tables and packed view, the forward, sampling (less the
recording of the token), recording it (the incremental detokenizer and the constraint), and the hand-off
of the Outputs to the event loop; on the HTTP thread, the SSE events' JSON and the rest of the thread's
active time (uvicorn, asyncio, the response stream). cProfile slows Python code (each call is counted),
so the Python phases read larger than they are and the C++ ones do not: the split, not the sum, is
the finding; the streams section of `python -m minillm.bench` times the server without a profiler.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import threading
import time
from pathlib import Path

import torch
import uvicorn

from minillm.api import load
from minillm.bench.native import free_port
from minillm.bench.peers import machine
from minillm.bench.serve import Arrival, http_clients, serving_metrics
from minillm.bench.streams import chats
from minillm.cache.packed import packed_layout
from minillm.runtime.engine import Scheduler, advance, sample_batch
from minillm.serve.ops import GracefulServer
from minillm.serve.openai_protocol import output_events
from minillm.serve.server import create_app, deliver, step_here, step_or_fail
from minillm.speed.fast import FastCausalLM

# phase -> the function whose cumulative time it is, on the engine thread
ENGINE_PHASES = {"step": step_or_fail, "schedule": Scheduler.schedule, "block tables and packed view": packed_layout,
                 "forward": FastCausalLM.forward, "sample": sample_batch, "record the token (detokenize)": advance,
                 "hand-off to the event loop": deliver}
WAITING = ("poll", "select", "wait", "acquire", "sleep")  # built-ins in which a thread waits, not works


def cumulative(stats: pstats.Stats, function) -> float:
    """Seconds spent in `function` and what it called (cProfile's cumulative time)."""
    code = function.__code__
    row = stats.stats.get((code.co_filename, code.co_firstlineno, code.co_name))
    return 0.0 if row is None else row[3]


def active_seconds(stats: pstats.Stats) -> float:
    """A thread's working time: every function's own time but the waiting built-ins'."""
    return sum(row[2] for (_, _, name), row in stats.stats.items() if not any(w in name for w in WAITING))


def profile_run(llm, workload: list[Arrival], before: bool) -> dict:
    """One profiled burst (after a warm-up request) through a fresh app on llm; the phases in ms per step."""
    app = create_app(llm, max_num_seqs=len(workload))
    bridge, profilers = app.state.bridge, {"engine": cProfile.Profile(), "http": cProfile.Profile()}
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = GracefulServer(config, app.state.drain)
    url = f"http://127.0.0.1:{config.port}"
    http = threading.Thread(target=lambda: profilers["http"].runcall(server.run), name="minillm-http")
    bridge.here = not before  # before: lifespan starts the engine's own thread, profiled inside it
    if before:
        loop = bridge._loop
        bridge._loop = lambda: profilers["engine"].runcall(loop)
    result = {}

    def clients():  # the warm-up, then the measured burst; then the server stops
        while not server.started:
            time.sleep(0.02)
        http_clients(url, [Arrival(0.0, workload[0].prompt, 2)])
        steps = bridge.steps
        times = http_clients(url, workload)
        result.update(steps=bridge.steps - steps, tokens_per_s=serving_metrics(workload, times, 1.0, 1.0)["throughput"])
        server.should_exit = True

    client = threading.Thread(target=clients)
    client.start()
    http.start()
    if before:
        http.join()
    else:
        profilers["engine"].runcall(step_here, bridge, http)
    client.join()
    engine, web = (pstats.Stats(profilers[k]) for k in ("engine", "http"))
    per_step = 1e3 / max(result["steps"], 1)  # the warm-up's few steps are in the profile too: a small excess
    phases = {name: cumulative(engine, where) * per_step for name, where in ENGINE_PHASES.items()}
    phases["sample"] -= phases["record the token (detokenize)"]  # sample_batch calls advance
    sse = cumulative(web, output_events)
    phases["HTTP thread: SSE events"] = sse * per_step
    phases["HTTP thread: the rest"] = (active_seconds(web) - sse) * per_step
    return {"setup": "before" if before else "after", "concurrency": len(workload), "steps": result["steps"],
            "tokens_per_s": result["tokens_per_s"], "ms_per_step": phases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench.serve_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", help="also write the JSON to this file")
    args = parser.parse_args(argv)
    llm = load(quantize="int4", fast=True)
    prompts, runs = chats(llm.tokenizer, max(args.concurrency)), []
    parts = [layer.one_call for layer in llm.model.layers]
    for before in (True, False):
        for layer, part in zip(llm.model.layers, parts):
            layer.one_call = None if before else part  # before: every layer in torch calls
        for c in args.concurrency:
            runs.append(profile_run(llm, [Arrival(0.0, p, args.tokens) for p in prompts[:c]], before))
    text = json.dumps({"machine": machine(), "model": "SmolLM2-135M-Instruct (embedded), --fast --quantize int4",
                       "threads": torch.get_num_threads(), "tokens": args.tokens, "runs": runs}, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
