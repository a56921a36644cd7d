"""`python -m minillm.bench`: minillm against transformers, same model, same machine, same run.

Plain plumbing (not exported from a notebook). Speed is a ratio measured side by side in one
process, never a timed test: absolute numbers on a shared machine mean little.

    python -m minillm.bench engine                # continuous batching vs transformers' padded batch
    python -m minillm.bench engine --quick        # a tiny fixture, seconds
    python -m minillm.bench engine --requests 16 64 --json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent.parent / "data"


def mixed_requests(n: int, vocab: int, seed: int = 0, prompt_range=(8, 96), new_range=(8, 64)):
    """n (prompt ids, max_new_tokens) pairs of mixed lengths, reproducible."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*new_range))
            for _ in range(n)]


def transformers_padded_batch(hf_model, requests, pad_id: int) -> float:
    """Seconds for transformers' generate on all requests as one left-padded batch, greedy.

    A padded batch runs until its longest request is done; only each request's own
    max_new_tokens count as useful tokens (the same tokens minillm's engine produces)."""
    T = max(len(p) for p, _ in requests)
    ids = torch.full((len(requests), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(requests), T, dtype=torch.long)
    for b, (p, _) in enumerate(requests):
        ids[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1
    longest = max(m for _, m in requests)
    t0 = time.perf_counter()
    with torch.no_grad():
        hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                          do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t0


def minillm_engine(model, tokenizer, requests) -> float:
    from minillm.engine import Engine

    engine = Engine(model, tokenizer, num_blocks=4096, max_num_seqs=len(requests), enable_prefix_caching=False)
    t0 = time.perf_counter()
    out = engine.generate([p for p, _ in requests], max_new_tokens=[m for _, m in requests], eos_token_ids=())
    seconds = time.perf_counter() - t0
    assert [len(r["token_ids"]) for r in out] == [m for _, m in requests]
    return seconds


def bench_engine(args) -> dict:
    from transformers import AutoModelForCausalLM

    from minillm.embedded import embedded_gguf_path
    from minillm.model import from_folder
    from minillm.tokenizer import Tokenizer
    from minillm.weights import from_gguf

    gguf = embedded_gguf_path()
    tokenizer = Tokenizer.from_gguf(gguf)
    if args.quick:
        name, model = "tiny-llama", from_folder(DATA / "tiny-llama")
        hf = AutoModelForCausalLM.from_pretrained(DATA / "tiny-llama", dtype=torch.float32)
        prompt_range, new_range = (4, 48), (4, 32)
    else:
        name, model = "SmolLM2-135M-Instruct (fp32)", from_gguf(gguf)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        prompt_range, new_range = (16, 128), (16, 64)
    hf.eval()
    rows = []
    for n in args.requests:
        requests = mixed_requests(n, model.config.vocab_size, seed=n, prompt_range=prompt_range, new_range=new_range)
        useful = sum(m for _, m in requests)
        ours = minillm_engine(model, tokenizer, requests)
        theirs = transformers_padded_batch(hf, requests, pad_id=0)
        rows.append({"requests": n, "useful_tokens": useful, "minillm_tok_s": useful / ours,
                     "transformers_tok_s": useful / theirs, "ratio": theirs / ours})
    return {"benchmark": "engine", "model": name, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    engine = sub.add_parser("engine", help="continuous batching vs transformers' padded batch generate")
    engine.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    engine.add_argument("--quick", action="store_true", help="a tiny fixture instead of SmolLM2")
    engine.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    result = bench_engine(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['model']}, {result['threads']} threads, torch {result['torch']}: useful generated tokens/s")
    print(f"{'requests':>8} {'tokens':>7} {'minillm engine':>15} {'transformers batch':>19} {'ratio':>6}")
    for r in result["rows"]:
        print(f"{r['requests']:>8} {r['useful_tokens']:>7} {r['minillm_tok_s']:>15.1f} {r['transformers_tok_s']:>19.1f} "
              f"{r['ratio']:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
