"""The benchmark's peers and the machine they ran on (plumbing, not a lesson).

Each peer is a runner with minillm's signature (`minillm_runner`), run(prompt ids, n) -> (seconds,
n generated ids): greedy, exactly n tokens (end-of-sequence does not stop it), so `measure` times
every side the same way: decode tok/s = (n - 1) / (t(n) - t(1)).

- transformers: its public greedy `generate` (also with prompt lookup, for the speculative section).
- llama.cpp: llama-cpp-python on the same GGUF file, the same threads, its own greedy argmax over the
  logits it returns. An optional extra: `pip install llama-cpp-python` builds llama.cpp from source
  (4-10 minutes on 2 cores; LLAMA_CPP_INSTALL says how to build it where AMX is advertised but
  forbidden). Absent, its rows are listed under "skipped" with the reason. llama.cpp's own llama-bench
  and llama-server, without Python in the loop, are in minillm/bench/native.py.
"""

from __future__ import annotations

import ctypes
import getpass
import multiprocessing
import os
import platform
import random
import re
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from minillm.runtime.generate import generate
from minillm.speed.cpu_kernel import cpu_flags

LLAMA_CPP_INSTALL = ('pip install llama-cpp-python (builds llama.cpp, 4-10 minutes; where AMX is advertised but '
                     'forbidden, the native build crashes: set CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON '
                     '-DGGML_FMA=ON -DGGML_F16C=ON", plus -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON on AVX-512 CPUs)')


def minillm_runner(model, tokenizer, **generate_kwargs):
    """minillm's greedy generate of exactly n tokens (generate_kwargs: e.g. a hybrid's cache_factory)."""
    def run(prompt: list[int], n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = generate(model, tokenizer, prompt, max_new_tokens=n, eos_token_ids=(), **generate_kwargs)
        return time.perf_counter() - t0, out.token_ids
    return run


def measure(run, prompts: dict[int, list[int]], tokens: int | None, repeats: int) -> dict:
    """{"ttft_s": {L: best seconds for 1 token}, "generate_s", "decode_tok_s", "decode_ids"} for one side.

    Decode uses the shortest prompt (generate_s: its best time for `tokens`); tokens=None skips it
    (prefill only)."""
    run(prompts[min(prompts)][:4], 2)  # warm-up (and torch.compile's first compile)
    ttft = {L: min(run(p, 1)[0] for _ in range(repeats)) for L, p in prompts.items()}
    result = {"ttft_s": ttft, "generate_s": None, "decode_tok_s": None, "decode_ids": None}
    if tokens:
        runs = [run(prompts[min(prompts)], tokens) for _ in range(repeats)]
        seconds, ids = min(runs, key=lambda r: r[0])
        result["generate_s"] = seconds
        result["decode_tok_s"] = (tokens - 1) / max(seconds - ttft[min(prompts)], 1e-9)
        result["decode_ids"] = ids
    return result


def transformers_runner(hf, **generate_kwargs):
    """transformers' greedy generate of exactly n tokens (generate_kwargs: e.g. prompt_lookup_num_tokens)."""
    def run(prompt: list[int], n: int) -> tuple[float, list[int]]:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0,
                              **generate_kwargs)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()
    return run


class IdsOnly:
    """The tokenizer stand-in the generation loop accepts: ids in, no text out (random weights say nothing)."""

    special_ids = frozenset()
    eos_token_ids = ()

    def token_bytes(self, token_id: int) -> bytes:
        return b""


def prompt_ids(n: int, vocab: int) -> list[int]:
    """n seeded random ids (seed n, as cli.prompt_ids for a vocab without text), the same for both sides."""
    rng = random.Random(n)
    return [rng.randrange(3, vocab) for _ in range(n)]


def leading_agreement(ours: list[int], theirs: list[int]) -> int:
    """How many leading tokens are equal."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def fresh_first_generate(side: str, build, build_args: tuple, prompt: list[int], tokens: int,
                         generate_kwargs: dict | None = None) -> float:
    """Seconds of `side`'s ("minillm" or "transformers") first generate call, in a new Python process:
    build(*build_args) -> (minillm's model, transformers' model) there, then one timed call. build and
    generate_kwargs' values must be importable by name (a spawned process unpickles them)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        threads = torch.get_num_threads()
        return pool.submit(_first_generate, side, build, build_args, threads, prompt, tokens,
                           generate_kwargs or {}).result()


def _first_generate(side, build, build_args, threads, prompt, tokens, generate_kwargs) -> float:  # in the fresh process
    torch.set_num_threads(threads)
    ours, hf = build(*build_args)
    run = minillm_runner(ours, IdsOnly(), **generate_kwargs) if side == "minillm" else transformers_runner(hf, eos_token_id=None)
    return run(prompt, tokens)[0]



def single_request_rows(section: str, sides: dict, first: dict, prompts: dict[int, list[int]], tokens: int,
                        repeats: int, row) -> dict:
    """One request at a time, minillm beside transformers (the qwen3_5 and moe sections): each side's
    first generate (`first`: seconds from fresh_first_generate) and the same call warm, time to first
    token and prefill at each prompt length, decode tok/s, greedy agreement and distinct tokens.
    Returns (transformers' measure(), minillm's), for rows of other variants beside the same run."""
    theirs, mine = (measure(sides[side], prompts, tokens, repeats) for side in ("transformers", "minillm"))
    row(section, "readable", "first generate", "s", first["minillm"], first["transformers"], n=tokens)
    row(section, "readable", "generate", "s", mine["generate_s"], theirs["generate_s"], n=tokens)
    for L in sorted(prompts):
        row(section, "readable", "time to first token", "ms", mine["ttft_s"][L] * 1e3, theirs["ttft_s"][L] * 1e3, n=L)
        row(section, "readable", "prefill", "tok/s", L / mine["ttft_s"][L], L / theirs["ttft_s"][L], n=L)
    row(section, "readable", "decode", "tok/s", mine["decode_tok_s"], theirs["decode_tok_s"], n=tokens)
    a, b = mine["decode_ids"], theirs["decode_ids"]
    row(section, "readable", "greedy agreement", "tokens", leading_agreement(a, b), len(b), n=tokens)
    row(section, "readable", "distinct tokens", "tokens", len(set(a)), len(set(b)), n=tokens)
    return theirs, mine

def require_llama_cpp():
    """The llama_cpp module, imported on use (an optional peer, not a requirement); ImportError naming the
    install if absent."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(f"llama-cpp-python is not installed ({e}): {LLAMA_CPP_INSTALL}") from None
    return llama_cpp


def llamacpp_runner(gguf: Path, threads: int, context: int):
    """llama.cpp's greedy decoding of exactly n tokens on `gguf`; ImportError (naming the install) if absent."""
    llama_cpp = require_llama_cpp()
    Llama, llama_get_logits = llama_cpp.Llama, llama_cpp.llama_get_logits
    llm = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=context,
                logits_all=False, verbose=False)
    vocab = llm.n_vocab()

    def run(prompt: list[int], n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        llm.reset()  # the KV cache is written again from position 0
        llm.eval(prompt)
        out = []
        while True:
            logits = np.ctypeslib.as_array(llama_get_logits(llm.ctx), shape=(vocab,))  # the last position's
            out.append(int(np.argmax(logits)))
            if len(out) == n:
                return time.perf_counter() - t0, out
            llm.eval(out[-1:])
    return run


def llamacpp_quantize(source: Path, out: Path, qtype: str, threads: int) -> Path:
    """llama.cpp's own quantization (llama_model_quantize) of GGUF `source` to `qtype` ("Q8_0", "Q4_1", ...)
    at `out`; ImportError (naming the install) if llama-cpp-python is absent."""
    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}"), threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {qtype}")
    return out


def compile_cache_per_kernels() -> None:
    """One torch.compile cache per CPU kernel set (AVX512, AVX2, ...), unless the user chose one with
    TORCHINDUCTOR_CACHE_DIR: torch 2.13 reuses kernels compiled under one ATEN_CPU_CAPABILITY under
    another, and they then return NaN (seen: a cache filled with AVX512 kernels, read with
    ATEN_CPU_CAPABILITY=avx2). Call it before the first compile. Importing minillm already sets the
    variable to torch's default (inductor writes it on import), so that value counts as unset."""
    default = str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{torch.backends.cpu.get_cpu_capability().lower()}"


def machine() -> dict:
    """The CPU's model, its cores, its SIMD flags (avx*, amx*, fma, f16c) and the platform."""
    cpu, info = platform.processor() or platform.machine(), Path("/proc/cpuinfo")
    if info.exists() and (m := re.search(r"^model name\s*:\s*(.+)$", info.read_text(), re.M)):
        cpu = m.group(1).strip()
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    return {"cpu": cpu, "cores": os.cpu_count(), "simd": flags, "torch_kernels": torch.backends.cpu.get_cpu_capability(),
            "platform": platform.platform()}
