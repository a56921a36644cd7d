# Generated from notebooks/16_paged_attention.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Paged attention: attention that reads each sequence's keys and values where they lie, block by block.

Built in notebooks/16_paged_attention.ipynb, on the pool and block manager of notebook 15
(minillm/cache/paged.py). The softmax is folded in one block at a time, keeping per
query a running maximum, sum of exponentials and weighted sum of values (`SoftmaxState`, `fold_block`):
exact, the recurrence of FlashAttention and of vLLM's paged kernel. `paged_attention_reference` is
its readable loop. The fast path hands the loop to FlexAttention: `decode_layout` describes a decode
step as a block mask over the pool, `BlockTableView.attend` runs the compiled kernel, and
`use_paged_attention` probes whether that kernel runs (and is exact) on a device; the engine gathers
where it does not.

References: Milakov and Gimelshein, "Online normalizer calculation for softmax" (2018); Dao et al.,
"FlashAttention" (2022); Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention" (SOSP 2023); Dong et al., "Flex Attention: A Programming Model for Generating
Optimized Attention Kernels" (2024), and the `torch.nn.attention.flex_attention` documentation.

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv query heads per kv head,
T queries, n keys in a block, D head dim, N pool blocks, bs block size.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from minillm.model.attention import causal_mask
from minillm.cache.paged import BlockManager, PagedKVCache, PagedView, gather_reference


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


def _validate_reference(q, cache, block_table, length) -> None:
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
    _validate_reference(q, cache, block_table, length)
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


@dataclass
class DecodeLayout:
    """A decode step read through the block tables: one new token per row, nothing gathered."""
    slots: torch.Tensor      # (B, 1) pool slot where each row's new key/value goes
    positions: torch.Tensor  # (B, 1) position of each row's new token: its length - 1
    block_mask: BlockMask    # per row (at least 2): the pool blocks to visit, the slots that are keys
    start_pos: int           # the longest row's length - 1 (forward checks the positions against it)


def decode_layout(manager: BlockManager, seq_ids: list, pool_blocks: int, device=None) -> DecodeLayout:
    """One decode step over `seq_ids`, whose keys lie in a pool of `pool_blocks` blocks."""
    bs, B = manager.block_size, len(seq_ids)
    R = max(B, 2)  # rows of the block mask: a lone sequence gets a dummy second row (notebook 16's Plumbing)
    tables = [manager.block_table(s) for s in seq_ids]
    lengths = [manager.num_tokens(s) for s in seq_ids]
    kb = next(n for n in (4, 2, 1) if bs % n == 0)  # the kernel's key block: 4 slots or fewer (notebook 16's Plumbing)
    f = bs // kb                                     # key blocks per pool block
    full = torch.zeros(R, 1, 1, pool_blocks * f, dtype=torch.int32)  # (R, heads, query blocks, key blocks)
    num_full = torch.zeros(R, 1, 1, dtype=torch.int32)               # how many (0 in the dummy row)
    last = torch.zeros(R, 1, 1, pool_blocks * f, dtype=torch.int32)  # the last pool block's, where the mask_mod decides
    num_last = torch.full((R, 1, 1), f, dtype=torch.int32)           # f each (the dummy row: block 0, slot 0 kept)
    logical = torch.full((R, pool_blocks), 2**40)                   # (R, N): pool block table[j] is block j of row b;
                                                                    # 2**40 (no key) for the blocks of other rows
    for b, table in enumerate(tables):
        subs = [block * f + i for block in table for i in range(f)]  # pool block j = key blocks j f .. j f + f - 1
        full[b, 0, 0, : len(subs) - f] = torch.tensor(subs[:-f], dtype=torch.int32)
        last[b, 0, 0, :f] = torch.tensor(subs[-f:], dtype=torch.int32)
        num_full[b] = len(subs) - f
        logical[b, table] = torch.arange(len(table))
    positions = torch.tensor([[L - 1] for L in lengths] + [[0]] * (R - B), device=device)  # (R, 1)
    slots = torch.tensor([[manager.slot(s, L - 1)] for s, L in zip(seq_ids, lengths)], device=device)  # (B, 1)
    logical, block_size = logical.to(device), torch.tensor(bs, device=device)  # a tensor: kept out of the kernel's shapes

    def is_key(b, h, q_idx, kv_idx):  # slot kv_idx holds a token of row b at or before its query
        return logical[b, kv_idx // block_size] * block_size + kv_idx % block_size <= positions[b, q_idx]

    t = lambda x: x.to(device)
    block_mask = BlockMask.from_kv_blocks(t(num_last), t(last), t(num_full), t(full), BLOCK_SIZE=(1, kb), mask_mod=is_key,
                                          seq_lengths=(1, pool_blocks * bs), compute_q_blocks=False)
    return DecodeLayout(slots, positions[:B], block_mask, max(lengths) - 1)


@functools.cache
def _compiled_flex_attention():  # on first use: torch.compile imports the compiler, seconds of every start-up
    return torch.compile(flex_attention)  # a kernel only when compiled


def _flex_attention(*args, **kwargs):
    return _compiled_flex_attention()(*args, **kwargs)


_failed: dict[tuple, str] = {}  # shapes the compiler failed on, and its error: served uncompiled (exact, slower)


def _reason(e: Exception) -> str:  # an error in one line: a compiler's can run to thousands
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


class BlockTableView(PagedView):
    """What the model sees as `cache[i]` in a paged decode step: `attend`, in place of `update`'s gather."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k, v (B, Hkv, 1, D) into their slots; attention of q (B, H, 1, D) over each row's blocks."""
        k_pool, v_pool = self.write(k, v)  # (N*bs, Hkv, D) each, one row per slot
        (B, H, _, D), (S, Hkv, _) = q.shape, k_pool.shape
        R = self.layout.block_mask.kv_num_blocks.shape[0]  # the layout's rows: B, or 2 for a lone sequence
        q_rows = q if R == B else torch.cat([q, q.new_zeros(R - B, H, 1, D)])  # (R, H, 1, D)
        keys = k_pool.transpose(0, 1).expand(R, Hkv, S, D)  # (Hkv, N*bs, D) -> (R, Hkv, N*bs, D): stride 0, no copy
        values = v_pool.transpose(0, 1).expand(R, Hkv, S, D)
        for t in (q_rows, keys, values):  # heads and head dim: static, one kernel per model
            torch._dynamo.mark_static(t, 1), torch._dynamo.mark_static(t, 3)
        shapes = (R, S, H, Hkv, D, q.dtype, q.device.type)
        if shapes not in _failed:
            try:
                with torch._dynamo.config.patch(recompile_limit=64):  # room for the kernels of many models
                    return _flex_attention(q_rows, keys, values, block_mask=self.layout.block_mask, enable_gqa=True)[:B]
            except Exception as e:  # noqa: BLE001 -- any compiler error: these shapes fall back, once and for all
                _failed[shapes] = _reason(e)
        with warnings.catch_warnings():  # FlexAttention's "called without torch.compile" note: we know
            warnings.simplefilter("ignore")
            return flex_attention(q_rows, keys, values, block_mask=self.layout.block_mask, enable_gqa=True)[:B]


ATTENTION_CHOICES = ("auto", "paged", "gather")
PAGED_MIN_TOKENS = 16384  # "auto": below this many tokens in a decode batch, the gather was faster (2-core CPU)
_probed: dict[tuple, str | None] = {}  # (device type, dtype, H, Hkv, D) -> None if the kernel runs, else why not


def _probe(config, dtype: torch.dtype, device: torch.device) -> str | None:
    """Run the kernel on random keys, one sequence and then three, against the dense attention."""
    H, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    manager, g = BlockManager(12, 4, enable_prefix_caching=False), torch.Generator().manual_seed(0)
    pool = PagedKVCache(12, 4, Hkv, D, dtype, device)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g)); pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    failed_before = set(_failed)
    try:
        for seqs in ([0], [1, 2, 3]):
            for s in seqs:
                manager.allocate(s, [0] * (3 * s + 1))  # 1, 4, 7 and 10 tokens: a full block, partial ones
            q = torch.randn(len(seqs), H, 1, D, generator=g).to(device, dtype)
            k, v = (torch.randn(len(seqs), Hkv, 1, D, generator=g).to(device, dtype) for _ in range(2))
            out = BlockTableView(pool, decode_layout(manager, seqs, 12, device)).attend(q, k, v)  # (B, H, 1, D)
            if set(_failed) - failed_before:  # the compiler failed and attend fell back: not the fast path
                return _failed[(set(_failed) - failed_before).pop()]
            for b, s in enumerate(seqs):
                keys, values = gather_reference(pool, manager.block_table(s), manager.num_tokens(s))  # (Hkv, L, D)
                want = F.scaled_dot_product_attention(q[b:b + 1].float(), keys[None].float(), values[None].float(),
                                                      enable_gqa=True)
                worst = (out[b:b + 1].float() - want).abs().max().item()
                if not worst <= (1e-4 if dtype == torch.float32 else 3e-2):
                    return f"the compiled kernel differs from the dense attention by {worst:.2e}"
    except Exception as e:  # noqa: BLE001 -- a missing or failing compiler raises many kinds; each means "gather"
        return _reason(e)
    return None


def validate_attention(attention: str, config=None, dtype: torch.dtype = torch.float32, device="cpu") -> str:
    """The engine's `attention` argument, checked; "paged" also probes the kernel now (and fails here)."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
    if attention == "paged" and config is not None:
        use_paged_attention(attention, config, dtype, device)
    return attention


def use_paged_attention(attention: str, config, dtype: torch.dtype, device) -> bool:
    """attention: "auto" (paged where the kernel runs, else gather and warn), "paged" (or an error), "gather"."""
    if validate_attention(attention) == "gather":
        return False
    device = torch.device(device)
    key = (device.type, dtype, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    if key not in _probed:
        _probed[key] = _probe(config, dtype, device)
    if _probed[key] is not None and attention == "paged":
        raise RuntimeError(f"attention='paged': FlexAttention does not run here ({key}): {_probed[key]}")
    if _probed[key] is not None:
        warnings.warn(f"paged attention does not run here ({_probed[key]}); the engine gathers blocks instead",
                      stacklevel=2)
    return _probed[key] is None
