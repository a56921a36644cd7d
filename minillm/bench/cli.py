"""`python -m minillm.bench`: minillm against transformers, same model, same machine, same run.

Plain plumbing (not exported from a notebook). Speed is a ratio measured side by side in one
process, never a timed test: absolute numbers on a shared machine mean little. Both sides get the
same prompts (the committed public-domain text, or seeded random ids when the vocab is too small),
greedy decoding, end-of-sequence disabled, and the same thread count.

    python -m minillm.bench                       # everything (= `all`), embedded SmolLM2 at fp32
    python -m minillm.bench all --quick           # the tiny fixture, seconds
    python -m minillm.bench decode --variants readable fast fast-int4 --tokens 128
    python -m minillm.bench prefill --prompt-lengths 128 1024
    python -m minillm.bench ceiling               # matrix-vector ceilings only
    python -m minillm.bench engine --requests 16 64
    python -m minillm.bench speculative             # int4 self-drafting and prompt lookup
    python -m minillm.bench lora                    # 4 LoRA adapters in one batch vs the base model
    python -m minillm.bench serve --rate 2          # requests arriving over time: latency and goodput
    python -m minillm.bench qwen3_5                 # a Qwen3.5-0.8B-shaped hybrid (random weights); not in `all`
    python -m minillm.bench moe                     # Qwen3-30B-A3B's MoE layers (random weights); not in `all`
    python -m minillm.bench user --peers llama.cpp  # one chat per side in a fresh process; not in `all`
    python -m minillm.bench --model Qwen/Qwen2.5-0.5B-Instruct --threads 2 --json --out bench.json

Variants (minillm side): readable (CausalLM), fast (FastCausalLM), readable-int8/-int4
(quant.quantize_model on a copy), fast-int8/-int4 (FastCausalLM(quantize=...)), and with
--compile fast-compiled / fast-int4-compiled. A variant or a ceiling that cannot be built (say a
packed kernel this torch lacks) is listed under "skipped" with the reason, never dropped silently.

How things are measured:
- load: seconds to load the weights, the best of two loads (the first pays one-off imports):
  minillm from_gguf/load_model, transformers from_pretrained; each variant's build time from the
  loaded model (minillm only).
- prefill: time to first token = the best of --repeats runs of each side's public generate with
  exactly 1 new token; prefill tok/s = prompt tokens / that time.
- decode (batch 1): (tokens - 1) / (t(tokens) - t(1 token)) on the same prompt, for both sides,
  so both include their own loop overhead; greedy agreement = leading tokens equal to transformers'.
  With --peers llama.cpp, llama-cpp-python on the same GGUF is timed the same way (bench_peers), and
  llama.cpp's own llama-bench gives its prefill and decode beside them (minillm/bench/native.py).
- memory: weight bytes (parameters, buffers and tensor attributes, shared storage counted once),
  transformers' get_memory_footprint(), and the process peak RSS at the end.
- ceiling: the time of F.linear with x (1, K) over every weight shape of the model (q, k, v, o,
  gate, up, down of each layer, distinct tensors, and the lm head) in the model dtype, and through
  quant.Int4Linear (group --group-size) / Int8Linear; as tokens/s. Each decode variant's tok/s is
  given as a fraction of its own ceiling (roofline.own_ceiling: its own matrices and kernels, in
  place, compiled if it is); a fraction over 1.05 is not reported (see "skipped").
- engine: the continuous-batching engine (readable and fast) against transformers' left-padded
  batch generate, useful generated tokens/s at each --requests count.
- paged: minillm/bench/paged.py (its docstring): one engine decode step of 16 sequences at 256,
  1024 and 4096 tokens of context, its attention gathered or read through the block tables.
- speculative: minillm/bench/speculative.py (its docstring): plain greedy decoding, the int4 drafter
  and prompt lookup on an open question and a copy-edit task, against transformers' greedy generate, its
  prompt lookup and assisted generation; acceptance, tokens per forward and equality with plain decoding.
- lora: minillm/bench/lora.py (its docstring): 16 requests on the base model, through a MultiLoRA
  model with no adapter used, and spread over 4 adapters in one batch; transformers + PEFT the same.
- serve: minillm/bench/serve.py (its docstring): --serve-requests requests arriving as a Poisson
  process at --rate per second and as a burst, against transformers' continuous batching and its
  padded generate; throughput, time to first token and inter-token latency, goodput.
- qwen3_5: minillm/bench/qwen3_5.py (its docstring), run only when named: a Qwen3.5-0.8B-shaped hybrid, random weights.
- moe: minillm/bench/moe.py (its docstring), run only when named: Qwen3-30B-A3B's MoE layers, random weights.

JSON schema (--json prints it, --out FILE writes it too):
    {"machine": {"cpu", "cores", "simd", "torch_kernels", "platform"}, "model", "dtype", "threads", "torch", "transformers",
     "args": {...the flags...}, "skipped": {variant: reason},
     "ceilings": {"float32"|"int8"|"int4": {"seconds", "tok_s"}},   # per token, all shapes
     "peak_rss_mib",
     "rows": [{"section": "load"|"prefill"|"decode"|"ceiling"|"memory"|"engine"|"paged"|"speculative"|"lora"|"serve"|"tp"
               (in this order), or "qwen3_5", "moe", "user" or "streams" alone (their metrics: minillm/bench/
               qwen3_5.py, moe.py, user.py, streams.py),
               "variant": a minillm variant (or "process" / "transformers" / a ceiling key / a peer),
               "metric": "load time", "build time", "time to first token", "prefill", "decode",
                         "decode vs llama.cpp", "decode vs llama-bench" (--peers llama.cpp: the peer's
                         tok/s in the "transformers" column), "greedy agreement", "weight memory", "transformers footprint",
                         "peak RSS", "matvec", "engine", the paged section's "decode step, <B> sequences",
                         the speculative section's "<task> decode", "<task> vs plain", "<task> accepted",
                         "<task> tokens/forward", "<task> equal to plain",
                         and the lora section's "engine" and "vs base model", the serve section's
                         "<workload> throughput|goodput|ttft pP|itl pP" (variant: "vs <peer>"),
               "n": prompt tokens (prefill), tokens (decode, agreement), requests (engine, lora), context (paged),
               "unit": "s" | "ms" | "tok/s" | "req/s" | "tokens" | "MiB" | "x" | "%",
               "minillm", "transformers": numbers or null,
               "ratio": minillm/transformers for tok/s and tokens, transformers/minillm for
                        s, ms and MiB -- so ratio > 1 always means minillm is better; null if a side is missing,
               "ceiling_fraction": decode tok/s / the variant's ceiling tok/s (decode rows), else null}]}
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from minillm.api import load_tokenizer
from minillm.bench.engine import engine_rows
from minillm.bench.lora import lora_rows
from minillm.bench.moe import moe_rows
from minillm.bench.native import llama_bench_rows
from minillm.bench.paged import paged_rows
from minillm.bench.qwen3_5 import qwen3_5_rows
from minillm.bench.peers import (compile_cache_per_kernels, llamacpp_runner, machine, measure, minillm_runner,
                                 transformers_runner)
from minillm.bench.serve import add_serve_flags, serve_rows
from minillm.bench.speculative import speculative_rows
from minillm.bench.tp import tp_rows
from minillm.bench.streams import streams_rows
from minillm.bench.user import user_rows
from minillm.model.devices import peak_memory_mib
from minillm.weights.embedded import embedded_gguf_path
from minillm.speed.fast import FastCausalLM
from minillm.speed.quant import quantize_model
from minillm.bench.roofline import ceiling_fraction, ceilings, own_ceiling, weight_mib
from minillm.text.tokenizer import Tokenizer
from minillm.weights.loading import load_model

DATA = Path(__file__).resolve().parents[2] / "data"
VARIANTS = ("readable", "fast", "readable-int8", "readable-int4", "fast-int8", "fast-int4")
COMPILED = ("fast-compiled", "fast-int4-compiled")
SECTIONS = ("load", "prefill", "decode", "ceiling", "memory", "engine", "paged", "speculative", "lora", "serve", "tp")
LOWER_IS_BETTER = {"s", "ms", "MiB"}


# ---------------------------------------------------------------- the two sides and the variants

@dataclass
class Sides:
    name: str  # the model, in words
    model: nn.Module  # minillm's readable CausalLM
    tokenizer: object
    hf: nn.Module | None  # transformers' model, None when only minillm is needed
    load_s: tuple[float, float | None]  # (minillm, transformers) seconds
    source: Path  # what was loaded: a .gguf file, a folder, or a hub id


def load_sides(args) -> Sides:
    """Load minillm's model (timed) and its tokenizer; load_transformers adds the other side."""
    gguf, dtype = embedded_gguf_path(), getattr(torch, args.dtype)
    if args.quick:
        source, name = DATA / "tiny-llama", "tiny-llama (fixture)"
    else:
        source = Path(args.model) if args.model else gguf
        name = source.name if args.model is None or Path(args.model).exists() else args.model
    where = source if args.quick or args.model is None or Path(args.model).exists() else args.model  # path or hub id
    ours = []
    for _ in range(2):  # the best of two loads: the first pays one-off imports and cold file reads
        model = None
        gc.collect()
        t0 = time.perf_counter()
        model = load_model(where, dtype=dtype, device="cpu").eval()
        ours.append(time.perf_counter() - t0)
    try:
        tokenizer = load_tokenizer(where)
    except FileNotFoundError:  # a fixture without tokenizer files: ids are all that matters here
        tokenizer = Tokenizer.from_gguf(gguf)
    return Sides(name, model, tokenizer, None, (min(ours), None), source)


def load_transformers(sides: Sides, args) -> None:
    """transformers' model on the same weights and dtype, its load timed (the best of two)."""
    # imported on use: transformers is the peer, installed for tests and benchmarks only (requirements-dev.txt)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    source, dtype = sides.source, getattr(torch, args.dtype)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    theirs = []
    for _ in range(2):
        hf = None
        gc.collect()
        t0 = time.perf_counter()
        if source.suffix == ".gguf":
            hf = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(source if source.exists() else args.model, dtype=dtype)
        hf = hf.eval()
        theirs.append(time.perf_counter() - t0)
    sides.hf, sides.load_s = hf, (sides.load_s[0], min(theirs))


def build_variant(model: nn.Module, variant: str, group_size: int) -> nn.Module:
    """The minillm model a variant name stands for, built from the loaded readable model."""
    if variant == "readable":
        return model
    quantize = "int8" if "int8" in variant else "int4" if "int4" in variant else None
    if variant.startswith("readable-"):
        copied = copy.deepcopy(model)
        out = quantize_model(copied, quantize, group_size)
        return (copied if out is None else out).eval()
    fast = FastCausalLM(model, quantize=quantize, group_size=group_size).eval()
    return fast.compile() if variant.endswith("-compiled") else fast


# ---------------------------------------------------------------- timing one side

def prompt_ids(tokenizer, n: int, vocab: int) -> list[int]:
    """n ids of the committed public-domain text (repeated as needed), or seeded ids for a tiny vocab."""
    ids = tokenizer.encode((DATA / "text" / "declaration.txt").read_text())
    if max(ids) >= vocab:
        rng = random.Random(n)
        return [rng.randrange(3, vocab) for _ in range(n)]
    return (ids * (n // len(ids) + 1))[:n]


# ---------------------------------------------------------------- the run

def run_benchmark(args) -> dict:
    """Everything the subcommand asks for, as the JSON object described in the module docstring."""
    if args.threads:
        torch.set_num_threads(args.threads)
    compile_cache_per_kernels()
    torch.manual_seed(0)
    what, rows, skipped = args.what, [], {}

    def row(section, variant, metric, unit, ours, theirs=None, n=None, fraction=None):
        ratio = None
        if ours is not None and theirs is not None:
            lower_is_better = unit in LOWER_IS_BETTER
            num, den = (theirs, ours) if lower_is_better else (ours, theirs)
            ratio = num / den if den > 0 else None
        rows.append({"section": section, "variant": variant, "metric": metric, "n": n, "unit": unit,
                     "minillm": ours, "transformers": theirs, "ratio": ratio, "ceiling_fraction": fraction})

    if what == "qwen3_5":  # a model of its own: nothing of the others' is loaded
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # imported on use: see load_transformers
        return result(args, qwen3_5_rows(args, row, (Qwen3_5TextConfig, Qwen3_5ForCausalLM)), args.dtype, skipped, {}, rows)
    if what in ("user", "streams"):  # user: fresh processes, one per side; streams: servers (nothing loaded here)
        source = Path(args.model) if args.model else embedded_gguf_path()
        (user_rows(source, args.variants, args, row, skipped) if what == "user" else streams_rows(source, args, row, skipped))
        return result(args, source.name, args.dtype, skipped, {}, rows)
    if what == "moe":  # the same: a model of its own
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        return result(args, moe_rows(args, row, (Qwen3MoeConfig, Qwen3MoeForCausalLM), skipped), args.dtype, skipped, {}, rows)
    sides = load_sides(args)
    config, dtype = sides.model.config, next(sides.model.parameters()).dtype
    context, decode_prompt = config.max_position_embeddings, min(args.prompt_lengths)
    if max(args.prompt_lengths) >= context:
        raise SystemExit(f"error: --prompt-lengths {max(args.prompt_lengths)} leaves no room in the model's context "
                         f"of {context} tokens")
    if what in ("all", "decode") and decode_prompt + args.tokens > context:
        raise SystemExit(f"error: --prompt-lengths {decode_prompt} (the decode prompt) + --tokens {args.tokens} "
                         f"exceed the model's context of {context} tokens")
    if what not in ("ceiling", "tp"):
        load_transformers(sides, args)
    ceiling = ceilings(config, dtype, args.group_size, args.repeats * 2, skipped) if what in ("all", "decode",
                                                                                            "ceiling") else {}
    for key, c in ceiling.items():
        row("ceiling", key, "matvec", "tok/s", c["tok_s"])
    if sides.hf is not None:
        row("load", "readable", "load time", "s", sides.load_s[0], sides.load_s[1])
    if what in ("all", "decode", "prefill"):
        vocab = config.vocab_size
        lengths = args.prompt_lengths if what != "decode" else [min(args.prompt_lengths)]
        prompts = {L: prompt_ids(sides.tokenizer, L, vocab) for L in lengths}
        tokens = None if what == "prefill" else args.tokens
        theirs = measure(transformers_runner(sides.hf), prompts, tokens, args.repeats)
        hf_mib = weight_mib(sides.hf)
        if what == "all":
            row("memory", "transformers", "transformers footprint", "MiB", None, sides.hf.get_memory_footprint() / 2**20)
        decoded = {}  # variant: decode tok/s, for the peers' rows
        for variant in args.variants:
            t0 = time.perf_counter()
            try:
                model = build_variant(sides.model, variant, args.group_size)
            except Exception as e:  # reported, not hidden
                skipped[variant] = f"skipped: {type(e).__name__}: {e}"
                continue
            row("load", variant, "build time", "s", time.perf_counter() - t0)
            ours = measure(minillm_runner(model, sides.tokenizer), prompts, tokens, args.repeats)
            for L in lengths:
                row("prefill", variant, "time to first token", "ms", ours["ttft_s"][L] * 1e3,
                    theirs["ttft_s"][L] * 1e3, n=L)
                row("prefill", variant, "prefill", "tok/s", L / ours["ttft_s"][L], L / theirs["ttft_s"][L], n=L)
            if tokens:
                c = own_ceiling(model, max(10, 5 * args.repeats), compiled=variant.endswith("-compiled"))  # best of 10 or more
                decoded[variant] = ours["decode_tok_s"]
                row("decode", variant, "decode", "tok/s", ours["decode_tok_s"], theirs["decode_tok_s"], n=tokens,
                    fraction=ceiling_fraction(ours["decode_tok_s"], c, variant, skipped))
                agree = next((i for i, (a, b) in enumerate(zip(ours["decode_ids"], theirs["decode_ids"])) if a != b),
                             min(len(ours["decode_ids"]), len(theirs["decode_ids"])))
                row("decode", variant, "greedy agreement", "tokens", agree, len(theirs["decode_ids"]), n=tokens)
            if what == "all":
                row("memory", variant, "weight memory", "MiB", weight_mib(model), hf_mib)
            del model, ours
            gc.collect()
        if tokens and "llama.cpp" in args.peers:
            llamacpp_rows(sides, args, row, skipped, prompts[min(prompts)], theirs, decoded)
            llama_bench_rows(sides.source, args, row, skipped, lengths, theirs, decoded)  # llama.cpp's own llama-bench
    if what in ("all", "engine"):
        engine_rows(sides, args, row)
    if what in ("all", "paged"):
        paged_rows(sides, args, row, skipped)
    if what in ("all", "speculative"):
        speculative_rows(sides, args, row, skipped)
    if what in ("all", "lora"):
        lora_rows(sides, args, row, skipped)
    if what in ("all", "serve"):
        serve_rows(sides, args, row, prompt_ids(sides.tokenizer, 4096, config.vocab_size), skipped)
    if what in ("all", "tp"):
        tp_rows(args, row)
    row("memory", "process", "peak RSS", "MiB", peak_memory_mib(torch.device("cpu")))
    rows.sort(key=lambda r: SECTIONS.index(r["section"]))  # stable: each section's rows keep their order
    return result(args, sides.name, dtype, skipped, ceiling, rows)


def result(args, model: str, dtype: torch.dtype | str, skipped: dict, ceiling: dict, rows: list) -> dict:
    return {"machine": machine(), "model": model, "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers_version(), "args": dict(vars(args)), "skipped": skipped,
            "ceilings": ceiling, "peak_rss_mib": peak_memory_mib(torch.device("cpu")), "rows": rows}


def llamacpp_rows(sides, args, row, skipped: dict, prompt: list[int], theirs: dict, decoded: dict) -> None:
    """decode --peers llama.cpp: llama-cpp-python on the same GGUF, timed as the other sides are."""
    if sides.source.suffix != ".gguf":
        skipped["decode: llama.cpp"] = f"skipped: llama.cpp runs a .gguf file; the model is {sides.source}"
        return
    try:
        run = llamacpp_runner(sides.source, torch.get_num_threads(), len(prompt) + args.tokens + 8)
    except ImportError as e:
        skipped["decode: llama.cpp"] = f"skipped: {e}"
        return
    peer = measure(run, {len(prompt): prompt}, args.tokens, args.repeats)["decode_tok_s"]
    row("decode", "llama.cpp (same GGUF)", "decode", "tok/s", peer, theirs["decode_tok_s"], n=args.tokens)
    for variant, tok_s in decoded.items():
        row("decode", variant, "decode vs llama.cpp", "tok/s", tok_s, peer, n=args.tokens)


def transformers_version() -> str:
    import transformers  # imported on use: see load_transformers

    return transformers.__version__


# ---------------------------------------------------------------- output and the command line

def fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def render_table(result: dict) -> str:
    m, w = result["machine"], max([19] + [len(r["variant"]) for r in result["rows"]])  # w: the variant column
    lines = [f"{result['model']}, {result['dtype']}, {result['threads']} threads, torch {result['torch']}, "
             f"transformers {result['transformers']}, CPU {m['cpu']} ({m['cores']} cores)",
             "ratio > 1: minillm better (minillm/transformers for tok/s, transformers/minillm for s, ms, MiB)",
             f"{'section':<11} {'variant':<{w}} {'metric':<26} {'n':>5} {'unit':<6} {'minillm':>9} "
             f"{'transformers':>12} {'ratio':>7} {'of ceiling':>10}"]
    for r in result["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        frac = "-" if r["ceiling_fraction"] is None else f"{r['ceiling_fraction']:.0%}"
        lines.append(f"{r['section']:<11} {r['variant']:<{w}} {r['metric']:<26} {r['n'] or '':>5} {r['unit']:<6} "
                     f"{fmt(r['minillm']):>9} {fmt(r['transformers']):>12} {ratio:>7} {frac:>10}")
    lines += [f"{variant}: {reason}" for variant, reason in result["skipped"].items()]
    return "\n".join(lines)


def positive(flag: str, cast=int):
    """An argparse type: a number > 0 (an integer, or any finite number with cast=float), errors naming the flag."""
    kind = "integer" if cast is int else "number"

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive {kind}, got {text!r}") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive {kind}, got {value}")
        return value
    return parse


def add_common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The flags every subcommand takes; on a subcommand (suppress) an absent flag keeps the top level's value."""
    d = (lambda value: argparse.SUPPRESS) if suppress else (lambda value: value)
    add = parser.add_argument
    add("--model", default=d(None), help="a .gguf file, a model folder or a hub id (default: the embedded SmolLM2)")
    add("--quick", action="store_true", default=d(False), help="the tiny fixture data/tiny-llama (seconds; qwen3_5, moe: their sizes)")
    add("--dtype", default=d("float32"), choices=["float32", "bfloat16", "float16"])
    add("--threads", type=positive("--threads"), default=d(None), help="torch threads (default: torch's)")
    add("--json", action="store_true", default=d(False), help="print JSON instead of the table")
    add("--out", default=d(None), help="also write the JSON to this file")
    add("--variants", nargs="+", default=d(None), type=variant_name, metavar="VARIANT",
        help=f"minillm variants, of: {', '.join(VARIANTS + COMPILED)} (default: {' '.join(VARIANTS)})")
    add("--compile", action="store_true", default=d(False), help="add the torch.compile'd fast variants (slow start)")
    add("--tokens", type=positive("--tokens"), default=d(None), help="decode tokens (default 256; --quick: 16)")
    add("--prompt-lengths", type=positive("--prompt-lengths"), nargs="+", default=d(None),
        help="prefill prompt lengths (default 128 1024; --quick: 32 128)")
    add("--requests", type=positive("--requests"), nargs="+", default=d([16, 64]),
        help="engine: concurrent requests (default 16 64)")
    add("--repeats", type=positive("--repeats"), default=d(2), help="best of this many runs (default 2)")
    add("--group-size", type=positive("--group-size"), default=d(32), help="int4 group size (default 32)")
    add("--peers", nargs="+", choices=["llama.cpp"], default=d([]),
        help="decode, moe, serve: also time llama.cpp on the same GGUF (llama-cpp-python and llama-bench; "
             "serve: llama-server; optional extras, see minillm/bench/peers.py and native.py)")
    add_serve_flags(add, d, positive)


def variant_name(text: str) -> str:
    if text not in VARIANTS + COMPILED:
        raise argparse.ArgumentTypeError(f"--variants: unknown variant {text!r}; "
                                         f"choose from {', '.join(VARIANTS + COMPILED)}")
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench", description=__doc__.splitlines()[0])
    add_common(parser, suppress=False)
    sub = parser.add_subparsers(dest="what")
    helps = {"all": "every section (the default)", "decode": "batch-1 decode and its ceiling fraction",
             "prefill": "prefill tok/s and time to first token", "ceiling": "matrix-vector ceilings only",
             "engine": "continuous batching vs transformers' padded batch generate",
             "paged": "an engine decode step at 256-4096 tokens of context: gathered vs paged attention",
             "speculative": "speculative decoding (int4 drafter, prompt lookup) vs plain greedy decoding",
             "lora": "serving 4 LoRA adapters in one batch vs the base model alone (and transformers + PEFT)",
             "serve": "requests arriving over time: throughput, latency percentiles and goodput",
             "tp": "tensor parallelism over gloo: a decode step at TP 1 and 2, the collectives' share",
             "qwen3_5": "a Qwen3.5-0.8B-shaped hybrid, random weights (not in all); default --prompt-lengths 1024 4096, --tokens 64",
             "moe": "Qwen3-30B-A3B's MoE layers, random weights (not in all); default --prompt-lengths 128 512, --tokens 64",
             "user": "one chat answered by each side in a fresh process: time to first token, total (not in all)",
             "streams": "C streamed chats at once through the server, beside llama-server (not in all)"}
    for name, text in helps.items():
        add_common(sub.add_parser(name, help=text, description=text), suppress=True)
    args = parser.parse_args(argv)
    args.what = args.what or "all"
    if args.model and args.quick:
        parser.error("--model and --quick exclude each other")
    if args.tokens is not None and args.tokens < 2 and args.what in ("all", "decode", "qwen3_5", "moe"):
        parser.error("argument --tokens: must be at least 2 to time decode")
    args.tokens = args.tokens or (16 if args.quick else 64 if args.what in ("qwen3_5", "moe") else 96 if args.what == "user"
                                  else 128 if args.what == "streams" else 256)
    args.prompt_lengths = args.prompt_lengths or ([32, 128] if args.quick else [1024, 4096] if args.what == "qwen3_5"
                                                  else [128, 512] if args.what == "moe" else [128, 1024])
    args.variants = list(dict.fromkeys((args.variants or list(VARIANTS)) + (list(COMPILED) if args.compile else [])))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_benchmark(args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else render_table(result))
    return 0
