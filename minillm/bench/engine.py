"""The benchmark's engine section (plumbing): continuous batching against a padded batch.

minillm's engine (notebook 17) serves requests of mixed lengths as they come; transformers'
generate runs them as one left-padded batch until the longest is done. Both are timed on the
same requests and counted in useful tokens: each request's own max_new_tokens.
"""

from __future__ import annotations

import gc
import random
import time
from collections import Counter

import torch

from minillm.runtime.engine import Engine
from minillm.speed.fast import FastCausalLM


def mixed_requests(n: int, vocab: int, seed: int = 0, prompt_range=(8, 96), new_range=(8, 64)):
    """n (prompt ids, max_new_tokens) pairs of mixed lengths, reproducible."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*new_range))
            for _ in range(n)]


def pool_blocks(tokens, page: int = 16) -> int:
    """Blocks of `page` slots to hold every request's KV at once; tokens: each request's prompt + new tokens."""
    return sum(-(-n // page) for n in tokens)


def transformers_padded_batch(hf_model, requests, pad_id: int, **generate_kwargs) -> float:
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
                          do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
                          **generate_kwargs)
    return time.perf_counter() - t0


def minillm_engine(model, tokenizer, requests, adapters=None, engine_class=Engine) -> float:
    """Seconds for the engine to run every request; adapters: a LoRA adapter's name per request (notebook 20);
    engine_class: Qwen3.5's HybridEngine (appendix A6) for a hybrid model."""
    blocks = pool_blocks(len(p) + m for p, m in requests)  # every request's KV at once
    engine = engine_class(model, tokenizer, num_blocks=blocks + 8, block_size=16, max_num_seqs=len(requests),
                          enable_prefix_caching=False)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, None, m, eos_token_ids=(), adapter=a)
            for (p, m), a in zip(requests, adapters or [None] * len(requests))]
    made = Counter()
    while engine.has_unfinished():
        made.update(out.request_id for out in engine.step() if out.token_id is not None)
    seconds = time.perf_counter() - t0
    assert [made[rid] for rid in rids] == [m for _, m in requests]
    return seconds



def mixed_engine_row(section: str, model, hf, args, row, tokenizer, engine_class=Engine) -> None:
    """The engine row of the sections with a model of their own (qwen3_5, moe): useful tokens per second of
    the smallest --requests count of mixed requests, `engine_class` against transformers' padded batch."""
    n = min(args.requests)
    prompt_range, new_range = ((4, 48), (4, 32)) if args.quick else ((16, 128), (16, 64))
    requests = mixed_requests(n, model.config.vocab_size, seed=n, prompt_range=prompt_range, new_range=new_range)
    useful = sum(m for _, m in requests)
    row(section, "readable", "engine", "tok/s", useful / minillm_engine(model, tokenizer, requests, engine_class=engine_class),
        useful / transformers_padded_batch(hf, requests, pad_id=0), n=n)

def engine_rows(sides, args, row) -> None:
    """Rows of the engine section: for each --requests count, readable, fast and fast int4 (appendix A4's kernel,
    several rows per weight load in a batched step) against transformers."""
    prompt_range, new_range = ((4, 48), (4, 32)) if args.quick else ((16, 128), (16, 64))
    models = {"readable": sides.model, "fast": FastCausalLM(sides.model).eval(),
              "fast-int4": FastCausalLM(sides.model, quantize="int4").eval()}
    for n in args.requests:
        requests = mixed_requests(n, sides.model.config.vocab_size, seed=n, prompt_range=prompt_range,
                                  new_range=new_range)
        useful = sum(m for _, m in requests)
        theirs = useful / transformers_padded_batch(sides.hf, requests, pad_id=0)
        for variant, model in models.items():
            row("engine", variant, "engine", "tok/s", useful / minillm_engine(model, sides.tokenizer, requests),
                theirs, n=n)
    del models
    gc.collect()
