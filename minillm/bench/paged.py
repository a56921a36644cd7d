"""The benchmark's paged section (plumbing): one engine decode step at growing context, its
attention gathered or read through the block tables.

Sixteen sequences (--quick: four) of equal length each hold L tokens in the engine's paged cache,
their blocks dealt out of the pool in shuffled order, as in a server that has run for a while.
The cache holds random keys and values: a step's cost does not depend on them. One decode step
(`engine.forward_batch`, the fast model, every layer) is timed both ways, best of --repeats + 1:

- gather: `PagedView` copies each sequence's blocks into a dense batch in every layer, then SDPA;
- paged: `BlockTableView`, FlexAttention over the pool through a block mask (notebook 16).

Where the kernel cannot run, the paged rows are skipped with the reason. Both ways give the same
logits (tests/cache/test_paged_flex.py); here only the time is measured.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from minillm.runtime.engine import forward_batch
from minillm.speed.fast import FastCausalLM
from minillm.cache.paged import BlockManager, make_paged_cache


@dataclass
class _Row:  # what forward_batch reads of a sequence
    id: int
    lora: int = 0


def decode_step_ms(model, batch: int, length: int, attention: str, repeats: int, block_size: int = 16) -> float:
    """The best time of one decode step, in ms, for `batch` sequences of `length` cached tokens."""
    blocks = batch * -(-(length + 1) // block_size)
    manager = BlockManager(blocks, block_size, enable_prefix_caching=False)
    order = list(manager.free_list)
    random.Random(0).shuffle(order)
    manager.free_list = type(manager.free_list)(order)  # blocks in no order, as after many requests
    cache = make_paged_cache(model.config, blocks + 1, block_size)
    for layer in cache:
        layer.k.normal_(), layer.v.normal_()
    rows = [_Row(i) for i in range(batch)]
    for row in rows:
        manager.allocate(row.id, [1] * (length + 1))  # its last token is the one the step computes
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first run also compiles, for the paged kernel
            t0 = time.perf_counter()
            forward_batch(model, cache, manager, rows, [[1]] * batch, blocks * block_size, attention)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def paged_rows(sides, args, row, skipped: dict) -> None:
    """Rows of the paged section: the decode step's time at each context, gathered and paged."""
    batch, contexts = (4, (32, 96)) if args.quick else (16, (256, 1024, 4096))
    model = FastCausalLM(sides.model).eval()
    for length in contexts:
        for attention in ("gather", "paged"):
            try:
                ms = decode_step_ms(model, batch, length, attention, args.repeats)
            except RuntimeError as e:  # attention="paged" where FlexAttention cannot run: say why
                skipped[f"paged {attention}"] = f"skipped: {e}"
                continue
            row("paged", f"fast, {attention}", f"decode step, {batch} sequences", "ms", ms, n=length)
