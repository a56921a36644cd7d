"""llama.cpp's own programs as peers (minillm/bench/native.py, tools/build_llama_cpp.py): llama-bench's
flags and JSON, llama-server started, sent the serve section's requests and stopped, and the skips.

Without a build (CI), fake executables written here stand in for both: they print llama-bench's real
JSON (FIELDS, copied from llama-bench 0.3.36's output; test_real_llama_bench checks it is still the
same) and speak llama-server's streamed /v1/completions. With `make llama-cpp` run, the real ones
are tested too; otherwise those tests are skipped, saying how to build them."""

import json
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minillm.bench import native, serve as bench_serve
from minillm.weights.embedded import embedded_gguf_path

ROOT = Path(__file__).resolve().parents[2]
# One test of `llama-bench -o json` (0.3.36's vendored llama.cpp, on SmolLM2's Q4_1 GGUF), as printed.
FIELDS = {
    "build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU",
    "model_filename": "model.gguf", "model_type": "llama 256M Q4_1", "model_size": 96576768,
    "model_n_params": 134515008, "n_batch": 2048, "n_ubatch": 512, "n_threads": 1, "cpu_mask": "0x0",
    "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": -1, "n_cpu_moe": 0,
    "split_mode": "layer", "main_gpu": 0, "no_kv_offload": False, "flash_attn": -1, "devices": "auto",
    "tensor_split": "0.00", "tensor_buft_overrides": "none", "load_mode": "auto", "lazy_mode": "auto",
    "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True, "fit_target": 0, "fit_min_ctx": 0,
    "n_prompt": 16, "n_gen": 0, "n_depth": 0, "test_time": "2026-12-05T19:52:18Z", "avg_ns": 259603256,
    "stddev_ns": 4406119, "avg_ts": 61.641387, "stddev_ts": 1.046195, "samples_ns": [262718812, 256487701],
    "samples_ts": [60.9016, 62.3812],
}

FAKE_BENCH = """
import json, sys
FIELDS = json.loads({fields!r})
argv = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps(argv) + "\\n")
flag = lambda name, default: argv[argv.index(name) + 1] if name in argv else default
repeats, threads = int(flag("-r", "5")), int(flag("-t", "2"))
tests = []
for depth in map(int, flag("-d", "0").split(",")):
    for p in [int(p) for p in flag("-p", "512").split(",") if int(p)]:
        tests.append(dict(n_prompt=p, n_gen=0, n_depth=depth, samples_ts=[100.0 + p + r for r in range(repeats)]))
    for n in [int(n) for n in flag("-n", "128").split(",") if int(n)]:
        tests.append(dict(n_prompt=0, n_gen=n, n_depth=depth, samples_ts=[20.0 + depth + r for r in range(repeats)]))
out = []
for t in tests:
    avg = sum(t["samples_ts"]) / len(t["samples_ts"])
    out.append(dict(FIELDS, n_threads=threads, model_filename=flag("-m", ""), avg_ts=avg, **t))
print(json.dumps(out, indent=2))
print("llama-bench: done", file=sys.stderr)
"""


def executable(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    log = tmp_path / "argv.jsonl"
    binary = executable(tmp_path / "llama-bench", FAKE_BENCH.format(fields=json.dumps(FIELDS), log=str(log)))
    monkeypatch.setenv("LLAMA_BENCH", str(binary))
    return log


def collect():
    rows = []

    def row(section, variant, metric, unit, ours, theirs=None, n=None, fraction=None):
        rows.append(dict(section=section, variant=variant, metric=metric, unit=unit, minillm=ours, transformers=theirs,
                         n=n))
    return rows, row


def test_llama_bench_flags_and_rows_with_a_fake_binary(fake_bench, tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    gguf, skipped = tmp_path / "model.gguf", {}
    rows, row = collect()
    theirs = {"ttft_s": {16: 0.5, 64: 1.0}, "decode_tok_s": 10.0}
    native.llama_bench_rows(gguf, SimpleNamespace(tokens=8, repeats=3), row, skipped, [16, 64], theirs,
                            {"fast": 15.0, "fast-int4": 40.0})
    assert skipped == {}
    calls = [json.loads(line) for line in fake_bench.read_text().splitlines()]
    assert calls == [["-m", str(gguf), "-t", "3", "-p", "16,64", "-n", "0", "-r", "3", "-o", "json"],
                     ["-m", str(gguf), "-t", "3", "-p", "0", "-n", "8", "-d", "16", "-r", "3", "-o", "json"]]
    got = {(r["section"], r["variant"], r["metric"], r["n"]): r for r in rows}
    bench = native.BENCH_ROW
    for L, their_ttft in theirs["ttft_s"].items():  # the best of the fake's samples: 100 + L + 2
        assert got["prefill", bench, "prefill", L]["minillm"] == 102.0 + L
        assert got["prefill", bench, "prefill", L]["transformers"] == L / their_ttft
        assert got["prefill", bench, "time to first token", L]["minillm"] == pytest.approx(L / (102.0 + L) * 1e3)
    assert got["decode", bench, "decode", 8]["minillm"] == 20.0 + 16 + 2  # tg 8 at depth 16, best of 3
    assert got["decode", bench, "decode", 8]["transformers"] == 10.0
    for variant, tok_s in {"fast": 15.0, "fast-int4": 40.0}.items():
        vs = got["decode", variant, "decode vs llama-bench", 8]
        assert (vs["minillm"], vs["transformers"], vs["unit"]) == (tok_s, 38.0, "tok/s")
    assert len(rows) == 2 * 2 + 1 + 2


def test_llama_bench_json_parser():
    tests = native.llama_bench_tests(json.dumps([FIELDS, dict(FIELDS, n_prompt=0, n_gen=4, n_depth=16,
                                                                 samples_ts=[30.5, 34.25], avg_ts=32.375)]))
    assert native.pick_tok_s(tests, 16, 0, 0) == {"best": 62.3812, "avg": 61.641387}
    assert native.pick_tok_s(tests, 0, 4, 16) == {"best": 34.25, "avg": 32.375}
    with pytest.raises(ValueError, match="gave 0 tests of 0 prompt and 4 generated tokens at depth 0"):
        native.pick_tok_s(tests, 0, 4, 0)
    with pytest.raises(ValueError, match="not a list of tests"):
        native.llama_bench_tests('{"n_prompt": 16}')


def test_absent_llama_bench_is_skipped_naming_it(tmp_path, monkeypatch):
    missing = tmp_path / "no-such-llama-bench"
    monkeypatch.setenv("LLAMA_BENCH", str(missing))
    skipped, (rows, row) = {}, collect()
    native.llama_bench_rows(tmp_path / "m.gguf", SimpleNamespace(tokens=8, repeats=1), row, skipped, [16], {}, {})
    assert rows == [] and list(skipped) == ["decode: llama-bench"]
    reason = skipped["decode: llama-bench"]
    assert reason.startswith("skipped:") and str(missing) in reason and "make llama-cpp" in reason
    # unset: PATH, then the build folder; neither has it
    monkeypatch.delenv("LLAMA_BENCH")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(native, "BUILT", tmp_path / "bin")
    with pytest.raises(FileNotFoundError, match=r"not on PATH and not in .*bin: build it with `make llama-cpp`"):
        native.find_tool("llama-bench")
    on_path = executable(tmp_path / "llama-bench", "print('[]')\n")
    assert native.find_tool("llama-bench") == on_path
    (tmp_path / "bin").mkdir()
    built = executable(tmp_path / "bin" / "llama-bench", "print('[]')\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin" / "nothing"))
    assert native.find_tool("llama-bench") == built
    monkeypatch.setenv("LLAMA_BENCH", str(on_path))  # the variable first
    assert native.find_tool("llama-bench") == on_path


def test_a_model_that_is_not_gguf_and_a_failing_binary_are_skipped(tmp_path, monkeypatch):
    skipped, (rows, row) = {}, collect()
    args = SimpleNamespace(tokens=8, repeats=1)
    native.llama_bench_rows(tmp_path / "tiny-llama", args, row, skipped, [16], {}, {})
    assert "runs a .gguf file" in skipped["decode: llama-bench"]
    failing = executable(tmp_path / "llama-bench", "import sys\nprint('error: unknown model', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setenv("LLAMA_BENCH", str(failing))
    native.llama_bench_rows(tmp_path / "m.gguf", args, row, skipped, [16], {}, {})
    assert "exited with 3: error: unknown model" in skipped["decode: llama-bench"] and rows == []


def real(name: str) -> Path:
    try:
        return native.find_tool(name)
    except FileNotFoundError as e:
        pytest.skip(f"llama.cpp's {name} is not built ({e})")


def test_real_llama_bench():
    """The real binary on the embedded GGUF: the flags are its own, its JSON parses and has FIELDS' keys."""
    binary = real("llama-bench")
    gguf = embedded_gguf_path()
    tests = native.run_llama_bench(binary, gguf, 1, ["-p", "8", "-n", "0", "-r", "1"])
    assert [set(t) for t in tests] == [set(FIELDS)]
    assert (tests[0]["n_prompt"], tests[0]["n_threads"], len(tests[0]["samples_ts"])) == (8, 1, 1)
    got = native.llama_bench(binary, gguf, 1, [8], 4, 2)
    assert got["prefill"][8]["best"] > 0 and got["decode"]["best"] >= got["decode"]["avg"] > 0


# ---------------------------------------------------------------- llama-server

FAKE_SERVER = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps(argv) + "\\n")
if {mode!r} == "crash":
    print("error: failed to load model"); sys.exit(1)
ready = time.monotonic() + 0.3

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def do_GET(self):
        status = 200 if self.path == "/health" and time.monotonic() > ready and {mode!r} != "never" else 503
        self.send_response(status); self.end_headers(); self.wfile.write(b"{{}}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/completions" and body["ignore_eos"] and body["stream"] and body["temperature"] == 0
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        for i in range(body["max_tokens"]):
            chunk = {{"choices": [{{"text": "" if i == 1 else "tok", "index": 0, "finish_reason": None}}]}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n"); self.wfile.flush()
        usage = {{"completion_tokens": body["max_tokens"], "prompt_tokens": len(body["prompt"])}}
        final = {{"choices": [{{"text": "", "index": 0, "finish_reason": "length"}}], "usage": usage}}
        self.wfile.write(b"data: " + json.dumps(final).encode() + b"\\n\\ndata: [DONE]\\n\\n")

ThreadingHTTPServer((argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])), Handler).serve_forever()
"""


def fake_server(tmp_path, mode="ok") -> tuple[Path, Path]:
    log = tmp_path / "server-argv.jsonl"
    return executable(tmp_path / "llama-server", FAKE_SERVER.format(log=str(log), mode=mode)), log


def test_llama_server_flags_requests_and_stop(tmp_path, monkeypatch):
    """The serve section's requests through a fake llama-server: each request's tokens all counted (one
    without text, as a token ending inside a UTF-8 character), the flags, and the process stopped."""
    binary, log = fake_server(tmp_path)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    workload = [bench_serve.Arrival(0.0, [5, 6, 7], 4), bench_serve.Arrival(0.05, list(range(3, 300)), 6),
                bench_serve.Arrival(0.1, [9] * 20, 3)]
    times = bench_serve.counted(workload, bench_serve.llama_server_serving(binary, tmp_path / "m.gguf", workload))
    assert all(t == sorted(t) and t[0] >= w.at for w, t in zip(workload, times))
    argv = json.loads(log.read_text())
    flag = lambda name: argv[argv.index(name) + 1]
    assert (flag("-m"), flag("-t"), flag("-tb"), flag("-np"), flag("-c")) == (str(tmp_path / "m.gguf"), "2", "2", "3",
                                                                             str(3 * 512))  # 297 + 6 + 16 -> 512
    assert "-cb" in argv and flag("--host") == "127.0.0.1"
    server = native.LlamaServer(binary, tmp_path / "m.gguf", 1, 1, 256)
    with server as url:
        assert url == f"http://127.0.0.1:{server.port}" and server.process.poll() is None
    assert server.process.poll() is not None  # stopped


def test_llama_server_is_stopped_when_it_fails(tmp_path):
    for mode in ("crash", "never", "ok"):
        (tmp_path / mode).mkdir()
    crash, _ = fake_server(tmp_path / "crash", "crash")
    with pytest.raises(RuntimeError, match="exited with 1: error: failed to load model"):
        with native.LlamaServer(crash, tmp_path / "m.gguf", 1, 1, 256):
            pass
    never, _ = fake_server(tmp_path / "never", "never")
    server = native.LlamaServer(never, tmp_path / "m.gguf", 1, 1, 256, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="was not ready within 1 s"):
        server.__enter__()
    assert server.process.poll() is not None and time.monotonic() - t0 < 30  # stopped, not left running
    ok, _ = fake_server(tmp_path / "ok")
    server = native.LlamaServer(ok, tmp_path / "m.gguf", 1, 1, 256)
    with pytest.raises(KeyError):
        with server:
            raise KeyError("a failure while it serves")
    assert server.process.poll() is not None


def test_absent_llama_server_is_skipped_naming_it(tmp_path, monkeypatch):
    missing = tmp_path / "no-such-llama-server"
    monkeypatch.setenv("LLAMA_SERVER", str(missing))
    skipped = {}
    assert native.llama_server_binary(tmp_path / "m.gguf", skipped) is None
    assert str(missing) in skipped["serve: llama-server"] and "make llama-cpp" in skipped["serve: llama-server"]
    assert native.llama_server_binary(tmp_path / "tiny-llama", skipped) is None
    assert "runs a .gguf file" in skipped["serve: llama-server"]


def test_real_llama_server_makes_exactly_the_tokens_asked():
    """The real llama-server on the embedded GGUF honours ignore_eos and max_tokens: counted() checks that
    each request made exactly its tokens (random prompts, greedy: end-of-sequence would come early)."""
    binary = real("llama-server")
    source = [(i * 7919) % 40000 + 3 for i in range(600)]
    workload = bench_serve.serving_workload(source, 3, None, prompt_range=(8, 40), new_range=(4, 12))
    times = bench_serve.counted(workload, bench_serve.llama_server_serving(binary, embedded_gguf_path(), workload))
    assert [len(t) for t in times] == [w.max_new_tokens for w in workload]


# ---------------------------------------------------------------- the build script

@pytest.fixture
def build_script(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import build_llama_cpp

    return build_llama_cpp


def test_build_flags_follow_the_cpu_and_never_turn_on_amx(build_script, tmp_path):
    avx512 = {"avx", "avx2", "bmi2", "fma", "f16c", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw",
              "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"}
    on = lambda flags: {o[len("-D"):-len("=ON")] for o in build_script.cmake_flags(flags) if o.endswith("=ON")}
    options = build_script.cmake_flags(avx512)
    assert {"-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"} <= set(options)
    assert {"GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX512", "GGML_AVX512_VNNI"} <= on(avx512)
    assert not any("AMX" in o for o in on(avx512))
    avx2 = {"avx", "avx2", "fma", "f16c", "avx512f"}  # AVX-512 F alone is not ggml's AVX512 (F, CD, VL, DQ, BW)
    assert "-DGGML_AVX512=OFF" in build_script.cmake_flags(avx2) and "-DGGML_BMI2=OFF" in build_script.cmake_flags(avx2)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert build_script.cpu_flags(cpuinfo) == {"fpu", "avx", "avx2", "amx_tile"}
    assert not build_script.built(tmp_path, options)  # nothing there: it builds
