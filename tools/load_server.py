"""A bounded load test of the OpenAI-compatible server, on loopback only.

    .venv/bin/python tools/load_server.py                     # starts its own server (embedded SmolLM2)
    .venv/bin/python tools/load_server.py --requests 32 --max-tokens 48
    .venv/bin/python tools/load_server.py --url http://127.0.0.1:8000/v1   # a running `minillm serve`

Sends N concurrent streaming chat requests with the official openai client and reports time to
first token and total latency (p50/p90/max), aggregate tokens/s, and how many requests completed
or got an error. Every request must end one way or the other: nothing may be lost. Bounded in
count and time (each request has a timeout); only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Tell me a fact about the moon.",
             "What is 12 times 7?", "Write one sentence about the sea.", "Say hello in Spanish."]


def start_server(max_in_flight: int):
    """The embedded model behind minillm's server on a free 127.0.0.1 port, in a background thread."""
    from minillm.api import load
    from minillm.serve.server import BackgroundServer, create_app

    return BackgroundServer(create_app(load(device="cpu"), num_blocks=1024, max_in_flight=max_in_flight))


def one_request(client, model: str, k: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, chunks = None, 0
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
        tokens = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                chunks += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        return {"ok": True, "ttft": (first or end) - start, "total": end - start, "tokens": tokens}
    except Exception as exc:  # any client-side failure is counted, never lost
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "total": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server's base URL on 127.0.0.1 (default: start one)")
    parser.add_argument("--model", default="minillm")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    args = parser.parse_args(argv)
    from openai import OpenAI

    server = None if args.url else start_server(max_in_flight=args.requests)
    url = args.url or server.url + "/v1"
    if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("load_server: only loopback addresses are allowed")
    client = OpenAI(base_url=url, api_key="none", timeout=args.timeout, max_retries=0)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.requests) as pool:
        results = list(pool.map(lambda k: one_request(client, args.model, k, args.max_tokens), range(args.requests)))
    wall = time.perf_counter() - t0
    if server is not None:
        server.stop()
    ok = [r for r in results if r["ok"]]
    print(f"{args.requests} concurrent streaming requests, max_tokens {args.max_tokens}: "
          f"{len(ok)} completed, {len(results) - len(ok)} errors, {wall:.1f} s wall")
    for r in results:
        if not r["ok"]:
            print("  error:", r["error"])
    if ok:
        def pct(values, q):
            values = sorted(values)
            return values[min(len(values) - 1, int(q * len(values)))]
        for key, label in (("ttft", "time to first token"), ("total", "total latency")):
            values = [r[key] for r in ok]
            print(f"  {label:20} p50 {pct(values, 0.5):6.2f} s  p90 {pct(values, 0.9):6.2f} s  "
                  f"max {max(values):6.2f} s  mean {statistics.mean(values):6.2f} s")
        tokens = sum(r["tokens"] for r in ok)
        print(f"  {tokens} tokens generated, {tokens / wall:.1f} tokens/s aggregate")
    return 0 if len(ok) == args.requests else 1  # any error fails the run


if __name__ == "__main__":
    sys.exit(main())
