"""A soak test of the OpenAI-compatible server: one server process, thousands of mixed requests.

    .venv/bin/python tools/soak_server.py                            # 2,000 requests, embedded SmolLM2
    .venv/bin/python tools/soak_server.py --requests 300 --workers 8  # a quick one
    .venv/bin/python tools/soak_server.py --model path/to/model.gguf --max-tokens 8

Starts `python -m minillm serve` on a free 127.0.0.1 port (loopback only) with three API keys and
per-key limits, and sends, from worker threads: chat and text completions, whole and streamed,
requests for n choices, clients that hang up at a random point of a stream, bad input (broken JSON,
values out of range, an unknown model, a lone surrogate), wrong keys, and bursts from one key past
its concurrency limit. Each request knows what it should get; the report counts

    completed             answered as asked (200, a well-formed answer or stream)
    rejected as expected  the 4xx it should get: 400/404/413 for bad input, 401 for a wrong key,
                          429 with Retry-After for a burst past its key's limit; hang-ups by plan
    failed                anything else (a 5xx, a malformed answer, a lost request, a timeout)

and the latency percentiles, the server's resident memory (VmRSS) at the start (after a warm-up),
the middle and the end, whether every KV block and in-flight slot came back, and whether the access
log has one line per request. Bounded: --requests in all, no new request after --max-seconds, a
timeout per request. Exit status 0 only with no unexpected failure and RSS growth under 5% from the
middle to the end. At the end the server gets SIGTERM and must exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

KEYS = ["sk-soak-key-one", "sk-soak-key-two", "sk-soak-burst-key"]
QUESTIONS = ["What is the capital of France?", "Name a fruit.", "What is 2 + 2?", "Say hello.", "Name a colour.",
             "Write a haiku about rain.", "What is water made of?", "Count to five."]
MIX = {"chat": 28, "stream": 18, "completion": 10, "n": 8, "hangup": 12, "bad": 12, "wrong_key": 6, "burst": 2}
BURST = 16  # requests at once from the burst key, whose limit is --per-key-concurrency (12)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_server(args, port: int, workdir: Path) -> subprocess.Popen:
    (workdir / "keys.txt").write_text("\n".join(KEYS) + "\n")
    cmd = [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--api-key-file", str(workdir / "keys.txt"),
           "--max-concurrent-per-key", str(args.per_key_concurrency), "--tokens-per-minute", "10000000",
           "--request-timeout", "120", "--shutdown-grace", "10", "--access-log", str(workdir / "access.log"),
           "--num-blocks", "512", "--max-in-flight", "256", "--served-model-name", "soak"] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(workdir / "server.err", "w"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"soak: the server exited with {proc.returncode}: {(workdir / 'server.err').read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("soak: the server did not start within 300 s")


# ---------------------------------------------------------------- one request of each kind


def chat_body(rng: random.Random, max_tokens: int, **extra) -> dict:
    body = {"model": "soak", "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
            "max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 99)}
    return {**body, **extra}


def bad_body(rng: random.Random) -> tuple[bytes, set[int]]:
    good = chat_body(rng, 4)
    cases = [(b"{not json", {400}), (json.dumps({**good, "temperature": 5}).encode(), {400}),
             (json.dumps({**good, "model": "gpt-4o"}).encode(), {404}), (json.dumps({**good, "n": 0}).encode(), {400}),
             (json.dumps({**good, "messages": []}).encode(), {400}), (json.dumps({**good, "max_tokens": 10**6}).encode(), {400}),
             (b'{"model": "soak", "messages": [{"role": "user", "content": "\\ud800"}]}', {400}),
             (b"[" * 100_000 + b"]" * 100_000, {400}), (json.dumps({**good, "x": "a" * (2 << 20)}).encode(), {413})]
    return rng.choice(cases)


def check_whole(r: httpx.Response, n: int = 1, chat: bool = True) -> str | None:
    if r.status_code != 200:
        return f"status {r.status_code}: {r.text[:200]}"
    answer = r.json()
    if len(answer["choices"]) != n or sorted(c["index"] for c in answer["choices"]) != list(range(n)):
        return f"{len(answer['choices'])} choices, expected {n}"
    if any(c["finish_reason"] not in ("stop", "length") for c in answer["choices"]):
        return f"finish reasons {[c['finish_reason'] for c in answer['choices']]}"
    if not chat and any(not isinstance(c["text"], str) for c in answer["choices"]):
        return "a choice without text"
    return None


def read_stream(r: httpx.Response, stop_after: int | None = None) -> tuple[str | None, float | None]:
    """(problem or None, seconds to the first text) of a stream; `stop_after` events: hang up there."""
    start, first, finishes, done = time.perf_counter(), None, 0, False
    if r.status_code != 200:
        return f"status {r.status_code}: {r.read()[:200]!r}", None
    for k, line in enumerate(r.iter_lines()):
        if stop_after is not None and k >= stop_after:
            return None, first
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return f"error event {chunk['error']}", first
        for c in chunk["choices"]:
            if first is None and (c.get("delta", {}).get("content") or c.get("text")):
                first = time.perf_counter() - start
            finishes += c["finish_reason"] is not None
    if stop_after is not None:
        return None, first  # the stream ended before the planned hang-up: fine
    return (None if done and finishes == 1 else f"done={done}, {finishes} finishes"), first


class Soak:
    def __init__(self, args, url: str):
        self.args, self.url = args, url
        self.results: list[dict] = []
        self.sent = 0  # HTTP requests sent to /v1: one access-log line each
        self.lock = threading.Lock()

    def record(self, kind: str, outcome: str, latency: float, ttft: float | None = None, detail: str = "") -> None:
        with self.lock:
            self.results.append({"kind": kind, "outcome": outcome, "latency": latency, "ttft": ttft, "detail": detail})

    def post(self, client: httpx.Client, path: str, key: str, body, stream: bool = False):
        with self.lock:
            self.sent += 1
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = client.build_request("POST", self.url + path, content=data, headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        return client.send(request, stream=stream)

    def run_job(self, client: httpx.Client, kind: str, rng: random.Random, key: str) -> None:
        start, t = time.perf_counter(), self.args.max_tokens
        try:
            if kind in ("chat", "n", "completion"):
                n = rng.randint(2, 3) if kind == "n" else 1
                body = chat_body(rng, t, n=n) if kind != "completion" else {
                    "model": "soak", "prompt": rng.choice(QUESTIONS), "max_tokens": rng.randint(1, t), "temperature": 0}
                path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
                problem = check_whole(self.post(client, path, key, body), n, kind != "completion")
                self.record(kind, "failed" if problem else "completed", time.perf_counter() - start, detail=problem or "")
            elif kind in ("stream", "hangup"):
                stop_after = rng.randint(0, 4) if kind == "hangup" else None
                body = chat_body(rng, t if kind == "stream" else 4 * t, stream=True,
                                 stream_options={"include_usage": True})
                r = self.post(client, "/v1/chat/completions", key, body, stream=True)
                try:
                    problem, ttft = read_stream(r, stop_after)
                finally:
                    r.close()  # a hang-up: the connection closes mid-stream
                outcome = "failed" if problem else ("expected" if kind == "hangup" else "completed")
                self.record(kind, outcome, time.perf_counter() - start, ttft, problem or "")
            elif kind == "bad":
                body, allowed = bad_body(rng)
                r = self.post(client, "/v1/chat/completions", key, body)
                ok = r.status_code in allowed and set(r.json().get("error", {})) == {"message", "type", "param", "code"}
                self.record(kind, "expected" if ok else "failed", time.perf_counter() - start,
                            detail="" if ok else f"status {r.status_code}: {r.text[:200]}")
            elif kind == "wrong_key":
                r = self.post(client, "/v1/chat/completions", "sk-soak-wrong-key", chat_body(rng, t))
                ok = r.status_code == 401
                self.record(kind, "expected" if ok else "failed", time.perf_counter() - start,
                            detail="" if ok else f"status {r.status_code}")
            else:
                self.burst(rng)
        except Exception as exc:  # a lost or malformed answer (or a bug here): counted, never dropped
            self.record(kind, "failed", time.perf_counter() - start, detail=f"{type(exc).__name__}: {exc}")

    def burst(self, rng: random.Random) -> None:
        """BURST requests at once from the burst key: each gets its answer or a 429 with Retry-After."""
        def one(seed: int) -> None:
            start = time.perf_counter()
            with httpx.Client(timeout=self.args.timeout) as c:
                r = self.post(c, "/v1/chat/completions", KEYS[2], chat_body(random.Random(seed), self.args.max_tokens))
            latency = time.perf_counter() - start
            if r.status_code == 429 and r.headers.get("retry-after"):
                self.record("burst", "expected", latency)
            else:
                problem = check_whole(r)
                self.record("burst", "failed" if problem else "completed", latency, detail=problem or "")
        threads = [threading.Thread(target=one, args=(rng.randint(0, 10**9),)) for _ in range(BURST)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()


def plan(total: int, rng: random.Random) -> list[str]:
    """Job kinds in a random order, until they add up to `total` requests (a burst is BURST requests)."""
    kinds, count = [], 0
    while count < total:
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        kinds.append(kind)
        count += BURST if kind == "burst" else 1
    return kinds


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return f"p50 {q[49] * 1000:.0f} ms, p90 {q[89] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms, max {max(values) * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="HTTP requests in all (default: 2000)")
    parser.add_argument("--workers", type=int, default=12, help="client threads (default: 12)")
    parser.add_argument("--max-tokens", type=int, default=6, help="largest max_tokens asked for (default: 6)")
    parser.add_argument("--max-seconds", type=float, default=1200, help="no new request after this (default: 1200)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per request (default: 180)")
    parser.add_argument("--per-key-concurrency", type=int, default=12, help="the server's limit per key (default: 12)")
    parser.add_argument("--model", help="the model to serve (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.workers <= args.per_key_concurrency < BURST:  # two ordinary keys: each stays at half its limit
        raise SystemExit(f"soak: need --workers <= --per-key-concurrency < {BURST} (the burst)")
    rng = random.Random(args.seed)
    kinds = plan(args.requests, rng)
    workdir = Path(tempfile.mkdtemp(prefix="minillm-soak-"))
    port = free_port()
    proc = start_server(args, port, workdir)
    soak = Soak(args, f"http://127.0.0.1:{port}")
    with httpx.Client(timeout=args.timeout) as warm:  # warm-up: allocator and caches settle before "start"
        for k in range(20):
            soak.post(warm, "/v1/chat/completions", KEYS[0], chat_body(random.Random(k), args.max_tokens))
    rss = {"start": rss_mib(proc.pid)}
    jobs = iter(enumerate(kinds))
    t0 = time.monotonic()

    def worker(w: int) -> None:
        key = KEYS[w % 2]  # half the workers per ordinary key: never over its limit, hang-ups lingering included
        with httpx.Client(timeout=args.timeout) as client:
            while time.monotonic() - t0 < args.max_seconds:
                with soak.lock:
                    job = next(jobs, None)
                if job is None:
                    return
                soak.run_job(client, job[1], random.Random(args.seed * 1_000_003 + job[0]), key)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(args.workers)]
    for th in threads:
        th.start()
    while any(th.is_alive() for th in threads):
        time.sleep(0.5)
        if "middle" not in rss and len(soak.results) >= args.requests // 2:
            rss["middle"] = rss_mib(proc.pid)
    wall = time.monotonic() - t0
    health = httpx.get(soak.url + "/health").json()
    rss["end"] = rss_mib(proc.pid)
    rss.setdefault("middle", rss["end"])
    proc.send_signal(signal.SIGTERM)
    exit_status = proc.wait(timeout=60)
    return report(soak, args, rss, health, wall, exit_status, workdir)


def report(soak: Soak, args, rss: dict, health: dict, wall: float, exit_status: int, workdir: Path) -> int:
    results = soak.results
    by = {o: [r for r in results if r["outcome"] == o] for o in ("completed", "expected", "failed")}
    log_lines = len((workdir / "access.log").read_text().splitlines())
    growth = (rss["end"] - rss["middle"]) / rss["middle"]
    idle = health["in_flight"] == 0 and health["running"] == 0 and health["waiting"] == 0
    print(f"soak: {len(results)} requests in {wall:.0f} s ({args.workers} clients, max_tokens <= {args.max_tokens}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    print(f"  completed {len(by['completed'])}, rejected as expected {len(by['expected'])}, "
          f"failed {len(by['failed'])}")
    for kind in MIX:
        mine = [r for r in results if r["kind"] == kind]
        counts = {o: sum(r["outcome"] == o for r in mine) for o in by}
        print(f"    {kind:11} {len(mine):5}: {counts['completed']} completed, {counts['expected']} as expected, "
              f"{counts['failed']} failed")
    print(f"  latency of completed requests: {percentiles([r['latency'] for r in by['completed']])}")
    print(f"  time to first token (streams): {percentiles([r['ttft'] for r in by['completed'] if r['ttft']])}")
    print(f"  server RSS: start {rss['start']:.0f} MiB, middle {rss['middle']:.0f} MiB, end {rss['end']:.0f} MiB "
          f"({growth:+.1%} middle -> end)")
    print(f"  after the run: {health}; access log {log_lines} lines for {soak.sent} requests sent; "
          f"exit status after SIGTERM {exit_status}")
    for r in by["failed"][:10]:
        print(f"  failed {r['kind']}: {r['detail']}")
    ok = not by["failed"] and growth < 0.05 and idle and exit_status == 0 and log_lines == soak.sent
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
