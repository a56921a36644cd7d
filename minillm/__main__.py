"""`python -m minillm`: the command line (plain plumbing, not exported from a notebook).

    python -m minillm generate "What is the capital of France?" --temperature 0 --stats
    python -m minillm chat                       # interactive, streaming; /reset, /exit
    python -m minillm info                       # what is inside a GGUF file
    python -m minillm serve --port 8000          # an OpenAI-compatible server on 127.0.0.1
    python -m minillm serve --api-key-file keys.txt --tokens-per-minute 20000 --request-timeout 120
    python -m minillm generate "Hi" --quantize int4 --group-size 32   # int4 weights (notebook 12)
    python -m minillm generate "Hi" --fast --quantize int4            # the fast path (notebook 13)
    python -m minillm generate "Hi" --speculative int4 --num-draft 4  # speculative decoding (notebook 19)
    python -m minillm serve --speculative int4   # the engine speculates while few requests decode
    python -m minillm generate "A city?" --json-schema city.json      # JSON that always parses (notebook 14)
    torchrun --nproc-per-node 2 -m minillm serve --tensor-parallel 2 # one model over 2 ranks (notebook 21)

The default model is the embedded SmolLM2-135M-Instruct GGUF (offline); --model takes a hub
id, a model folder or a .gguf file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from functools import partial
from pathlib import Path

from minillm.api import load
from minillm.text.chat_template import validate_template_kwargs
from minillm.text.constrained import validate_response_format
from minillm.weights.embedded import embedded_gguf_path
from minillm.runtime.generate import stream
from minillm.weights.gguf_file import read_gguf
from minillm.weights.lora import MultiLoRA, read_adapter
from minillm.runtime.sampling import SamplingParams
from minillm.serve.server import PREFILL_CHUNK, serve
from minillm.serve.ops import read_keys
from minillm.runtime.speculative import SpeculationStats
from minillm.runtime.speculative import stream as speculative_stream
from minillm.runtime.speculative_engine import SpeculativeEngine
from minillm.runtime.hybrid_engine import HybridEngine, HybridSpeculativeEngine
from minillm.parallel.tensor_parallel import RankLost
from minillm.parallel.lockstep import Control, LeadEngine, follow, read_line


def gguf_summary(path: Path) -> dict:
    """Architecture, sizes and quantization of a GGUF file, read from its header and tensor table."""
    reader = read_gguf(path)  # WeightsError (a ValueError) naming the file if it is not readable

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: GGUF has no general.architecture field")
    tokens = field("tokenizer.ggml.tokens", [])
    quant = Counter(t.tensor_type.name for t in reader.tensors)
    return {
        "file": str(path),
        "file_size_mb": round(path.stat().st_size / 1e6, 1),
        "name": field("general.name", "?"),
        "architecture": arch,
        "layers": field(f"{arch}.block_count"),
        "hidden_size": field(f"{arch}.embedding_length"),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "attention_heads": field(f"{arch}.attention.head_count"),
        "kv_heads": field(f"{arch}.attention.head_count_kv"),
        "context_length": field(f"{arch}.context_length"),
        "rope_theta": field(f"{arch}.rope.freq_base"),
        "vocab_size": field(f"{arch}.vocab_size", len(tokens)),
        "tokenizer": field("tokenizer.ggml.model"),
        "has_chat_template": "tokenizer.chat_template" in reader.fields,
        "parameters": sum(int(t.n_elements) for t in reader.tensors),
        "tensors": len(reader.tensors),
        "quant_types": dict(quant.most_common()),
    }


def cmd_info(args) -> int:
    path = Path(args.model) if args.model else embedded_gguf_path()
    if not path.is_file():
        raise FileNotFoundError(f"--model {path}: no such file (info reads .gguf files)")
    summary = gguf_summary(path)
    print(f"minillm: model summary of {summary['name']}")
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        if key == "parameters":
            value = f"{value:,} ({value / 1e6:.1f} M)"
        print(f"  {key:<{width}}  {value}")
    return 0


def _params(args):
    """The sampling flags, checked before the model loads (a load takes seconds)."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed)


def _load(args, lora=None):
    if args.group_size is not None and args.quantize != "int4":
        raise ValueError(f"--group-size applies to --quantize int4, got --quantize {args.quantize}")
    if args.tensor_parallel is not None and getattr(args, "speculative", None):
        raise ValueError("--speculative drafts with a second model: not with --tensor-parallel")
    return load(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize,
                group_size=32 if args.group_size is None else args.group_size, fast=args.fast, compile=args.compile,
                lora=lora, tensor_parallel=args.tensor_parallel)


def _ranks(args) -> Control | None:
    """--tensor-parallel: the ranks' control channel (notebook 21); only rank 0 writes to stdout."""
    if args.tensor_parallel is None:
        return None
    control = Control()
    if control.rank:
        sys.stdout = open(os.devnull, "w")
    return control


def lora_specs(args) -> dict[str, str]:
    """serve's --lora NAME=PATH flags as {name: folder}, checked before the model loads (notebook 20)."""
    specs = {}
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"--lora takes NAME=PATH with a name of letters, digits, '-', '_' or '.', got {spec!r}")
        if name in specs:
            raise ValueError(f"--lora: the name {name!r} is given twice")
        specs[name] = path
    if specs and (args.fast or args.quantize):
        raise ValueError("--lora serves adapters beside the float model's linears: drop --fast and --quantize")
    if specs and args.tensor_parallel is not None:
        raise ValueError("--lora serves adapters beside the whole model's linears: not with --tensor-parallel")
    return specs


def _add_weight_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=["int8", "int4", "gguf"],
                   help="weight-only quantization: int8 (per channel), int4 (per group), or gguf "
                        "(keep a .gguf file's Q4_0/Q4_1/Q8_0 blocks, dequantize its other types; cpu); default: none")
    p.add_argument("--group-size", type=int, help="inputs per int4 scale: 32, 64, 128 or 256 (default: 32)")
    p.add_argument("--fast", action="store_true", help="the fast path: fused projections, SDPA (notebook 13)")
    p.add_argument("--compile", action="store_true", help="torch.compile the fast path at load (needs --fast; a "
                                                          "minute the first time; --fast --quantize int4 alone is faster)")


def _messages(args, text: str) -> list[dict]:
    return ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]


def _validate_speculative(args) -> None:
    """--num-draft (and serve's --speculative-max-batch) need --speculative; checked before the model loads."""
    for flag, value in (("--num-draft", args.num_draft), ("--speculative-max-batch", getattr(args, "speculative_max_batch", None))):
        if value is not None and args.speculative is None:
            raise ValueError(f"{flag} applies to --speculative")
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


def _response_format(args) -> dict | None:
    """--json (any JSON object) or --json-schema (a schema as JSON text, or a .json file); checked before
    the model loads."""
    fmt = {"type": "json_object"} if args.json else None
    if args.json_schema is not None:
        path = Path(args.json_schema)
        text = path.read_text() if path.suffix == ".json" and path.is_file() else args.json_schema
        try:
            fmt = {"type": "json_schema", "json_schema": {"name": "cli", "schema": json.loads(text)}}
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-schema takes a JSON schema or a .json file: {exc}") from None
    if fmt is not None and args.speculative is not None:
        raise ValueError("--json and --json-schema cannot be combined with --speculative")
    validate_response_format(fmt)
    return fmt


def _drafter(llm, args):
    """The drafter of --speculative (built once per session): int4, ngram, or a draft model to load."""
    if args.speculative is None:
        return None
    if args.speculative in ("int4", "ngram"):
        return llm.drafter(args.speculative)
    return llm.drafter(load(args.speculative, dtype=args.dtype, device=args.device))


def _print_stream(llm, prompt_ids, args, params, drafter=None, fmt=None, chat=True) -> tuple[str, object]:
    """Stream one answer to stdout; Ctrl-C stops it cleanly. Returns (text, metrics or None)."""
    pieces, metrics, stats = [], None, SpeculationStats()
    limits = dict(params=params, max_new_tokens=args.max_new_tokens, stop=args.stop)
    thinking = llm.thinking(prompt_ids) if chat else None  # a thinking template: the format after </think>
    constraint = llm.constraints.for_format(fmt, thinking, args.reasoning_budget, prompt_ids)  # None: free text
    limits["cache_factory"] = llm.cache_factory  # Qwen3.5's hybrid cache (notebook 22), else the KV cache
    steps = (stream(llm.model, llm.tokenizer, prompt_ids, constraint=constraint, **limits) if drafter is None else
             speculative_stream(llm.model, llm.tokenizer, prompt_ids, drafter, num_draft=args.num_draft or 4,
                                stats=stats, **limits))
    try:
        for step in steps:
            print(step.text, end="", flush=True)
            pieces.append(step.text)
            metrics = step.metrics
    except KeyboardInterrupt:
        print(" [interrupted]", end="")
    print()
    if args.stats and metrics is not None:
        print(f"[{metrics}]" + (f" [speculative: {stats}]" if drafter is not None else ""), file=sys.stderr)
    return "".join(pieces), metrics


def cmd_generate(args) -> int:
    params, template_kwargs = _params(args), _template_kwargs(args)  # bad flags fail before the model loads
    _validate_speculative(args)
    fmt = _response_format(args)
    llm = _load(args, args.lora)
    _ranks(args)  # every rank runs this same command: the same tokens everywhere, printed once
    chat = not args.raw and bool(llm.tokenizer.chat_template)
    if chat:
        ids = llm.encode_chat(_messages(args, args.prompt), **template_kwargs)
    else:
        ids = llm.tokenizer.encode(args.prompt)
    _print_stream(llm, ids, args, params, _drafter(llm, args), fmt, chat)
    return 0


def cmd_chat(args) -> int:
    params, template_kwargs = _params(args), _template_kwargs(args)
    _validate_speculative(args)
    fmt = _response_format(args)
    llm = _load(args, args.lora)
    control, drafter = _ranks(args), _drafter(llm, args)
    print(f"minillm chat with {args.model or 'the embedded SmolLM2-135M-Instruct'} "
          "(/reset starts over, /exit or Ctrl-D quits)")
    history = [{"role": "system", "content": args.system}] if args.system else []
    start = list(history)
    while True:
        line = read_line() if control is None else control.read_line()  # notebook 21: rank 0's line, on every rank
        if line is None:  # Ctrl-D or Ctrl-C
            print()
            return 0
        line = line.strip()
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = list(start)
            print("(conversation cleared)")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        try:
            answer, _ = _print_stream(llm, llm.encode_chat(history, **template_kwargs), args, params, drafter, fmt)
        except ValueError as exc:  # e.g. the conversation outgrew the context: say so, keep the session
            print(f"minillm: error: {exc} (use /reset)", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})


def cmd_serve(args) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    keys = read_keys(args.api_key, args.api_key_file, os.environ)  # before loading: a bad key fails fast
    specs = lora_specs(args)
    _check_budget(args)
    adapters = {name: read_adapter(path) for name, path in specs.items()}  # a bad adapter fails fast too
    _validate_speculative(args)
    llm = _load(args)
    control = _ranks(args)
    if control is not None and control.rank:  # notebook 21: a follower steps as rank 0's engine does
        follow(llm.model, llm.tokenizer, control)
        return 0
    drafter = _drafter(llm, args)  # before the adapters wrap the model: the drafter drafts for the base model
    if adapters:  # notebook 20: requests pick one with model="<name>:<adapter>"
        llm.model = MultiLoRA(llm.model, adapters)
    name = args.served_model_name or (Path(args.model).name.removesuffix(".gguf") if args.model
                                      else "smollm2-135m-instruct")
    print(f"minillm: serving {name} at http://{args.host}:{args.port}/v1 with {len(keys) or 'no'} API key(s) "
          f"(SIGTERM or Ctrl-C: drain for up to {args.shutdown_grace:g} s, then exit)", file=sys.stderr)
    serve(llm, host=args.host, port=args.port, access_log=None if args.access_log == "off" else args.access_log,
          model_name=name, num_blocks=args.num_blocks, max_in_flight=args.max_in_flight, api_keys=keys,
          max_concurrent_per_key=args.max_concurrent_per_key, tokens_per_minute=args.tokens_per_minute,
          request_timeout=args.request_timeout, shutdown_grace=args.shutdown_grace, prefill_chunk=args.prefill_chunk or None,
          lenient=args.lenient, chat_template_kwargs=args.default_chat_template_kwargs,
          reasoning_budget=args.reasoning_budget,
          **_engine_class(args, control, drafter, llm))
    if control is not None:
        control.share(None)  # the followers stop
    return 0


def _engine_class(args, control, drafter, llm) -> dict:
    """serve's engine: the llm's own (notebook 17's, or A6's for Qwen3.5), rank 0's under --tensor-parallel
    (nb 21), or speculating (nb 19; A6's for Qwen3.5)."""
    if control is not None:
        return {"engine_class": partial(LeadEngine, control=control)}
    if drafter is not None:
        speculating = HybridSpeculativeEngine if llm.engine_class is HybridEngine else SpeculativeEngine
        return {"engine_class": partial(speculating, drafter=drafter, num_draft=args.num_draft or 4,
                                        max_batch=args.speculative_max_batch or 2)}
    return {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minillm", description="Run a language model with minillm.")
    sub = parser.add_subparsers(dest="command")
    info = sub.add_parser("info", help="summarize a GGUF file (default: the embedded model)")
    info.add_argument("--model", help="a .gguf file")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, ...)")
    serve.add_argument("--model", help="hub id, model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    serve.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (default: auto)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", help="the model id clients send (default: from --model)")
    serve.add_argument("--num-blocks", type=int, default=256, help="KV cache blocks of 16 tokens (default: 256)")
    serve.add_argument("--max-in-flight", type=int, default=128, help="requests at once; more get 429 (default: 128)")
    serve.add_argument("--prefill-chunk", type=int, metavar="N", default=PREFILL_CHUNK,
                       help="prompt tokens computed per engine step, so that a long prompt does not stall the "
                            f"answers being written (chunked prefill, notebook 17; 0: no limit; default: {PREFILL_CHUNK})")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require `Authorization: Bearer KEY` on /v1/* (repeatable; also --api-key-file and "
                            "the MINILLM_API_KEY variable; without any key the server is open)")
    serve.add_argument("--api-key-file", metavar="PATH", help="API keys, one per line (# comments)")
    serve.add_argument("--max-concurrent-per-key", type=int, metavar="N", help="requests at once per key (429 past it)")
    serve.add_argument("--tokens-per-minute", type=int, metavar="N",
                       help="prompt + completion tokens per minute per key, a token bucket (429 with Retry-After)")
    serve.add_argument("--request-timeout", type=float, metavar="S",
                       help="a request still generating after S seconds ends with finish_reason 'length'")
    serve.add_argument("--shutdown-grace", type=float, default=20.0, metavar="S",
                       help="on SIGTERM/Ctrl-C, running requests get S seconds to finish; the rest end with "
                            "finish_reason 'shutdown' (default: 20)")
    serve.add_argument("--reasoning-budget", type=int, metavar="N",
                       help="a thinking model's reasoning is closed after N tokens, then it answers (0: at once)")
    serve.add_argument("--default-chat-template-kwargs", metavar="JSON", type=_json_value,
                       help='template variables every chat gets unless its request\'s chat_template_kwargs say '
                            'otherwise, e.g. \'{"enable_thinking": false}\'')
    serve.add_argument("--lenient", action="store_true",
                       help="accept a request field the server does not know, and log it (default: a 400 naming it, "
                            "as OpenAI answers); fields it knows but does not do are refused either way")
    serve.add_argument("--access-log", default="-", metavar="PATH",
                       help="one JSON line per request: '-' stderr (default), a file, or 'off'")
    _add_weight_flags(serve)
    serve.add_argument("--tensor-parallel", type=int, metavar="N",
                       help="split the model over N ranks started by `torchrun --nproc-per-node N -m minillm ...` "
                            "(gloo on CPU, NCCL on CUDA; notebook 21)")
    serve.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                       help="serve a PEFT LoRA adapter beside the model (repeatable); a request picks it with "
                            "model='<served model>:NAME' (notebook 20)")
    serve.add_argument("--speculative", metavar="DRAFTER",
                       help="speculative decoding in the engine (notebook 19) while at most --speculative-max-batch "
                            "requests decode: int4 (the model's own int4 fast path drafts), ngram (prompt lookup), "
                            "or a draft model with the same tokenizer; the answers are unchanged")
    serve.add_argument("--num-draft", type=int, metavar="N", help="tokens drafted per round, at most (default: 4)")
    serve.add_argument("--speculative-max-batch", type=int, metavar="N",
                       help="speculate while at most N requests decode (default: 2, measured in notebook 19)")
    for name, help_text in (("generate", "answer one prompt, streaming"), ("chat", "interactive chat, streaming")):
        p = sub.add_parser(name, help=help_text)
        if name == "generate":
            p.add_argument("prompt", help="the user message (or plain text with --raw)")
            p.add_argument("--raw", action="store_true", help="continue the text as is, without the chat template")
        p.add_argument("--model", help="hub id, model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
        p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: auto)")
        p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (default: auto)")
        _add_weight_flags(p)
        p.add_argument("--tensor-parallel", type=int, metavar="N", help="split the model over N ranks started by "
                       "`torchrun --nproc-per-node N -m minillm ...` (notebook 21)")
        p.add_argument("--lora", metavar="PATH", help="a PEFT LoRA adapter's folder, merged into the weights (notebook 20)")
        p.add_argument("--system", help="a system prompt")
        p.add_argument("--max-new-tokens", type=int, default=256)
        p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default: 0.7)")
        p.add_argument("--top-p", type=float, default=0.9)
        p.add_argument("--top-k", type=int, default=0, help="0 = off")
        p.add_argument("--min-p", type=float, default=0.0)
        p.add_argument("--repetition-penalty", type=float, default=1.0)
        p.add_argument("--seed", type=int, help="makes sampling reproducible")
        p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
        p.add_argument("--stats", action="store_true", help="print the metrics after each answer")
        p.add_argument("--speculative", metavar="DRAFTER",
                       help="speculative decoding (notebook 19), the same answer in fewer forwards: int4 (the "
                            "model's own int4 fast path drafts), ngram (prompt lookup), or a draft model with the "
                            "same tokenizer (hub id, folder or .gguf)")
        p.add_argument("--num-draft", type=int, metavar="N", help="tokens drafted per round, at most (default: 4)")
        p.add_argument("--json", action="store_true", help="answer with a JSON object, always (notebook 14)")
        p.add_argument("--json-schema", metavar="SCHEMA",
                       help="answer with JSON following this schema (JSON text or a .json file), always")
        _add_template_flags(p)
    return parser


def _add_template_flags(p) -> None:
    """The chat template's own variables (appendix A2), for thinking models (notebook 10)."""
    p.add_argument("--chat-template-kwargs", metavar="JSON", type=_json_value,
                   help='the chat template\'s variables as a JSON object, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--no-thinking", action="store_true",
                   help="enable_thinking=false for the template (Qwen3 and later answer without reasoning)")
    p.add_argument("--reasoning-effort", metavar="LEVEL", help="the template's reasoning_effort (Qwen3.8 reads it)")
    p.add_argument("--reasoning-budget", type=int, metavar="N",
                   help="close a thinking model's reasoning after N tokens, then it answers (0: at once)")


def _json_value(text: str):
    """A flag's JSON text, parsed; argparse names the flag when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None


def _template_kwargs(args) -> dict:
    """--chat-template-kwargs, then --no-thinking and --reasoning-effort over it; checked (ValueError),
    with --reasoning-budget."""
    _check_budget(args)
    kwargs = dict(validate_template_kwargs(args.chat_template_kwargs, "--chat-template-kwargs"))
    if args.no_thinking:
        kwargs["enable_thinking"] = False
    if args.reasoning_effort is not None:
        kwargs["reasoning_effort"] = args.reasoning_effort
    return kwargs


def _check_budget(args) -> None:
    if args.reasoning_budget is not None and args.reasoning_budget < 0:
        raise ValueError(f"--reasoning-budget must be an integer >= 0 (tokens), got {args.reasoning_budget}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"info": cmd_info, "generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
               None: cmd_info}[args.command]
    if args.command is None:
        args.model = None
    try:
        return command(args)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"minillm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except RankLost as exc:  # notebook 21: another rank died or stopped answering
        print(f"minillm: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
