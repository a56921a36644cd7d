# Generated from notebooks/11_paged_cache.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Paged attention: attention that reads each sequence's keys and values where they lie, block by block.

Built in notebooks/11_paged_cache.ipynb. `PagedView.update` gathers a sequence's blocks into one
dense tensor before attention; here the softmax is computed one block at a time instead, keeping
per query a running maximum, a running sum of exponentials and a running weighted sum of values
(`SoftmaxState`), rescaled whenever a block raises the maximum (`fold_block`). The result is exact,
and only one block's scores exist at a time. This is the recurrence of FlashAttention, and the
loop that vLLM's paged-attention kernel runs over a block table; `paged_attention_reference` is
its readable version in torch (a Python loop over blocks: a reference, not a fast path).

References:
- Milakov and Gimelshein, "Online normalizer calculation for softmax" (2018).
- Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness" (2022).
- Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention"
  (SOSP 2023).

Shape legend: H query heads, Hkv kv heads, G = H / Hkv query heads per kv head, T queries,
n keys in a block, D head dim.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from minillm.attention import causal_mask
from minillm.paged_cache import PagedKVCache


class SoftmaxState(NamedTuple):
    """What an online softmax keeps per query after the keys seen so far."""
    m: torch.Tensor    # (...,)   the largest score so far (-inf before any key)
    l: torch.Tensor    # (...,)   sum of exp(score - m)
    acc: torch.Tensor  # (..., D) sum of exp(score - m) * value


def empty_state(shape: tuple[int, ...], head_dim: int, device=None) -> SoftmaxState:
    """The state before any key: m = -inf, l = 0, acc = 0, for queries of `shape`."""
    return SoftmaxState(torch.full(shape, -math.inf, device=device), torch.zeros(shape, device=device),
                        torch.zeros(*shape, head_dim, device=device))


def fold_block(state: SoftmaxState, scores: torch.Tensor, values: torch.Tensor) -> SoftmaxState:
    """The state after one more block: scores (..., T, n) (-inf where masked), values (..., n, D)."""
    m = torch.maximum(state.m, scores.amax(-1))              # (..., T) the new running maximum
    m_safe = m.masked_fill(m == -math.inf, 0.0)              # a query that has seen no key yet: exp(-inf) = 0
    rescale = torch.exp(state.m - m_safe)                    # (..., T) exp(old max - new max) <= 1
    p = torch.exp(scores - m_safe[..., None])                # (..., T, n) each <= 1: no overflow
    return SoftmaxState(m, state.l * rescale + p.sum(-1), state.acc * rescale[..., None] + p @ values)


def _check_reference(q, cache, block_table, length) -> None:
    N, bs, Hkv, D = cache.k.shape
    if q.dim() != 3 or q.shape[-1] != D or q.shape[0] % Hkv != 0:
        raise ValueError(f"paged_attention_reference: q must be (H, T, D) with D = {D} and H a multiple of "
                         f"Hkv = {Hkv}, got {tuple(q.shape)}")
    if not q.shape[1] <= length <= len(block_table) * bs:
        raise ValueError(f"paged_attention_reference: length must be in [T, blocks * block_size] = "
                         f"[{q.shape[1]}, {len(block_table) * bs}], got {length}")


def paged_attention_reference(q: torch.Tensor, cache: PagedKVCache, block_table: list[int], length: int,
                              scale: float | None = None) -> torch.Tensor:
    """Attention of one sequence's last T tokens: q (H, T, D) -> (H, T, D), causal over its `length`
    keys, read block by block from `cache` through `block_table`, never gathered."""
    _check_reference(q, cache, block_table, length)
    (H, T, D), bs, Hkv = q.shape, cache.k.shape[1], cache.k.shape[2]
    qg = q.view(Hkv, H // Hkv, T, D) * (D ** -0.5 if scale is None else scale)  # (H, T, D) -> (Hkv, G, T, D)
    allowed = causal_mask(T, length, length - T, q.device)                       # (T, length): notebook 02's rule
    state = empty_state((Hkv, H // Hkv, T), D, q.device)
    for i, block in enumerate(block_table[: -(-length // bs)]):
        n = min(bs, length - i * bs)                              # keys in this block: bs but in the last
        k = cache.k[block, :n].transpose(0, 1)[:, None]           # (n, Hkv, D) -> (Hkv, 1, n, D): a view
        v = cache.v[block, :n].transpose(0, 1)[:, None]
        scores = qg @ k.transpose(-1, -2)                         # (Hkv, G, T, D) @ (Hkv, 1, D, n) -> (Hkv, G, T, n)
        scores = scores.masked_fill(~allowed[:, i * bs : i * bs + n], -math.inf)  # this block's (T, n) columns
        state = fold_block(state, scores, v)
    return (state.acc / state.l[..., None]).view(H, T, D)     # (Hkv, G, T, D) -> (H, T, D)
