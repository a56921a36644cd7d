"""llama.cpp's own programs as the benchmark's peers (plumbing): llama-bench and llama-server.

llama-cpp-python (bench_peers) reaches llama.cpp through Python: a ctypes call and numpy's argmax
over the logits for every token. llama.cpp's own C++ tools, on the same GGUF file with the same
threads, are the reference with no Python in the loop. tools/build_llama_cpp.py builds both from
the llama.cpp the pinned llama-cpp-python sdist vendors (`make llama-cpp`, 5-10 minutes on 2
cores) into .venv/llama-cpp/bin/. Each is found as $LLAMA_BENCH / $LLAMA_SERVER (a path; set but
not an executable file, the peer is skipped, naming it), else on PATH, else in that folder. Absent,
its rows are listed under "skipped" with the reason and the command that builds it.

- llama-bench (decode --peers llama.cpp): `-p L1,L2.. -n 0` times prefill of each prompt length
  from an empty cache, and `-p 0 -n N -d P` times N tokens generated one at a time after P prompt
  tokens are in the cache (the decode section's prompt P and --tokens N); both with `-t` threads,
  `-r` --repeats, `-o json`, after llama-bench's own warm-up run. Each test's best run (the highest
  of its samples_ts) is reported, as the other sides report their best of --repeats; avg_ts, the
  mean, is parsed too.
- llama-server (serve --peers llama.cpp): started on a free local port with `-np` slots (as many as
  requests, the most that can run at once), continuous batching, the same threads, a context for
  each slot that holds its longest request; waited for on /health, then sent the serve section's
  requests by bench_serve; stopped afterwards whatever happens (LlamaServer, a context manager).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import torch

BUILT = Path(__file__).resolve().parents[2] / ".venv" / "llama-cpp" / "bin"  # tools/build_llama_cpp.py's output
BUILD = "build it with `make llama-cpp` (tools/build_llama_cpp.py, 5-10 minutes)"
ENV = {"llama-bench": "LLAMA_BENCH", "llama-server": "LLAMA_SERVER"}
BENCH_ROW = "llama.cpp native (llama-bench)"


def find_tool(name: str) -> Path:
    """llama.cpp's `name` ("llama-bench", "llama-server"): $LLAMA_BENCH / $LLAMA_SERVER, else PATH, else
    BUILT. FileNotFoundError naming where it looked and how to build it."""
    var = ENV[name]
    if os.environ.get(var):
        path = Path(os.environ[var]).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise FileNotFoundError(f"{name}: ${var} is {os.environ[var]}, not an executable file; "
                                f"unset ${var}, or point it at {name}, or {BUILD}")
    found = shutil.which(name)
    if found:
        return Path(found)
    if os.access(BUILT / name, os.X_OK):
        return BUILT / name
    raise FileNotFoundError(f"{name} is not set in ${var}, not on PATH and not in {BUILT}: {BUILD}")


def llama_bench_tests(text: str) -> list[dict]:
    """llama-bench -o json's output: a list with one object per test (n_prompt, n_gen, n_depth, n_threads,
    avg_ts, samples_ts, ...)."""
    tests = json.loads(text)
    if not isinstance(tests, list) or not all(isinstance(t, dict) and t.get("samples_ts") for t in tests):
        raise ValueError(f"llama-bench's JSON is not a list of tests with samples_ts: {text[:200]!r}")
    return tests


def pick_tok_s(tests: list[dict], n_prompt: int, n_gen: int, n_depth: int) -> dict:
    """{"best", "avg"} tok/s of the one test with these sizes (ValueError if there is not exactly one)."""
    found = [t for t in tests if (t["n_prompt"], t["n_gen"], t["n_depth"]) == (n_prompt, n_gen, n_depth)]
    if len(found) != 1:
        raise ValueError(f"llama-bench gave {len(found)} tests of {n_prompt} prompt and {n_gen} generated "
                         f"tokens at depth {n_depth}, not 1")
    return {"best": max(found[0]["samples_ts"]), "avg": found[0]["avg_ts"]}


def run_llama_bench(binary: Path, gguf: Path, threads: int, sizes: list[str], timeout: float = 3600) -> list[dict]:
    """One llama-bench run on `gguf` with `threads` and `sizes` (its -p/-n/-d/-r flags): its tests.
    RuntimeError with the command and its stderr's end if it fails."""
    command = [str(binary), "-m", str(gguf), "-t", str(threads), *sizes, "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}: {done.stderr.strip()[-600:]}")
    return llama_bench_tests(done.stdout)


def llama_bench(binary: Path, gguf: Path, threads: int, lengths: list[int], tokens: int | None,
                repeats: int) -> dict:
    """llama-bench's {"prefill": {L: {"best", "avg"} tok/s}, "decode": {"best", "avg"} tok/s or None}: prefill
    of each prompt length, and decode of `tokens` after the shortest prompt (tokens None: prefill only)."""
    r = ["-r", str(repeats)]
    tests = run_llama_bench(binary, gguf, threads, ["-p", ",".join(map(str, lengths)), "-n", "0", *r])
    result = {"prefill": {L: pick_tok_s(tests, L, 0, 0) for L in lengths}, "decode": None}
    if tokens:
        tests = run_llama_bench(binary, gguf, threads, ["-p", "0", "-n", str(tokens), "-d", str(min(lengths)), *r])
        result["decode"] = pick_tok_s(tests, 0, tokens, min(lengths))
    return result


def llama_bench_rows(gguf: Path, args, row, skipped: dict, lengths: list[int], theirs: dict, decoded: dict) -> None:
    """decode --peers llama.cpp: llama-bench's prefill (and time to first token) at each prompt length and its
    decode, beside transformers (`theirs`: its measure()); "decode vs llama-bench" for each minillm variant
    (`decoded`: variant -> decode tok/s). Skipped, with the reason, without a GGUF or the binary."""
    if gguf.suffix != ".gguf":
        skipped["decode: llama-bench"] = f"skipped: llama-bench runs a .gguf file; the model is {gguf}"
        return
    try:
        got = llama_bench(find_tool("llama-bench"), gguf, torch.get_num_threads(), lengths, args.tokens, args.repeats)
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
        skipped["decode: llama-bench"] = f"skipped: {e}"
        return
    for L, tok_s in got["prefill"].items():
        row("prefill", BENCH_ROW, "time to first token", "ms", L / tok_s["best"] * 1e3, theirs["ttft_s"][L] * 1e3, n=L)
        row("prefill", BENCH_ROW, "prefill", "tok/s", tok_s["best"], L / theirs["ttft_s"][L], n=L)
    if got["decode"] is not None:
        decode = got["decode"]["best"]
        row("decode", BENCH_ROW, "decode", "tok/s", decode, theirs["decode_tok_s"], n=args.tokens)
        for variant, tok_s in decoded.items():
            row("decode", variant, "decode vs llama-bench", "tok/s", tok_s, decode, n=args.tokens)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server's `command` (made for a free local port) as a context manager that gives its url once
    /health answers 200; the process is stopped on exit, whatever happened (and if it never got ready)."""

    def __init__(self, command, timeout: float, host: str = "127.0.0.1"):
        self.host, self.port, self.timeout, self.process = host, free_port(host), timeout, None
        self.url = f"http://{host}:{self.port}"
        self.command = command(host, self.port)  # (host, port) -> the argument list

    def __enter__(self) -> str:
        self.log = tempfile.TemporaryFile()  # its output, shown if it fails
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:  # 503 while it loads the model
                    return
            except OSError:
                pass
            time.sleep(0.1)
        what = f"exited with {self.process.returncode}" if self.process.poll() is not None else \
            f"was not ready within {self.timeout:g} s"
        raise RuntimeError(f"{' '.join(self.command)} {what}: {self.output()[-800:]}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace").strip()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class LlamaServer(ServerProcess):
    """llama-server on `gguf`, `slots` sequences of `slot_context` tokens at once (continuous batching)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, slot_context: int,
                 timeout: float = 300.0, host: str = "127.0.0.1"):
        super().__init__(lambda host, port: [
            str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(slots * slot_context), "-cb", "--host", host, "--port", str(port), "--no-webui"], timeout, host)


def llama_server_binary(gguf: Path, skipped: dict) -> Path | None:
    """serve --peers llama.cpp: llama-server's path, or None with the reason under skipped["serve: llama-server"]."""
    if gguf.suffix != ".gguf":
        skipped["serve: llama-server"] = f"skipped: llama-server runs a .gguf file; the model is {gguf}"
        return None
    try:
        return find_tool("llama-server")
    except FileNotFoundError as e:
        skipped["serve: llama-server"] = f"skipped: {e}"
        return None
