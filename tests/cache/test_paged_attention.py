"""Paged attention (minillm/cache/paged_attention.py, notebook 16): the online softmax against torch's
softmax, and attention read block by block through a block table against the gathered keys and
torch's scaled_dot_product_attention, with planted bugs that the comparison must catch."""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch
import torch.nn.functional as F

from minillm.cache import paged_attention
from minillm.model.attention import causal_mask
from minillm.cache.paged_attention import SoftmaxState, empty_state, fold_block, paged_attention_reference
from minillm.cache.paged import BlockManager, PagedKVCache, gather_reference, make_paged_cache, paged_forward


def folded(scores: torch.Tensor, values: torch.Tensor, block: int) -> torch.Tensor:
    """softmax(scores) @ values by the online softmax, `block` keys at a time: scores (T, S), values (S, D)."""
    state = empty_state((scores.shape[0],), values.shape[-1])
    for start in range(0, scores.shape[1], block):
        state = fold_block(state, scores[:, start:start + block], values[start:start + block])
    return state.acc / state.l[..., None]


@pytest.mark.parametrize("block", [1, 3, 16, 100])
def test_fold_block_equals_softmax(block):
    g = torch.Generator().manual_seed(block)
    scores = 40 * torch.randn(5, 37, generator=g)  # spread wide enough that exp(scores) overflows float32
    values = torch.randn(37, 8, generator=g)
    assert torch.exp(scores).isinf().any()
    torch.testing.assert_close(folded(scores, values, block), torch.softmax(scores, -1) @ values)


def test_a_fully_masked_first_block_leaves_no_trace():
    """A query whose first block is all masked (-inf) has m = -inf after it; the next block must not see NaN."""
    g = torch.Generator().manual_seed(0)
    scores, values = torch.randn(2, 8, generator=g), torch.randn(8, 4, generator=g)
    scores[:, :4] = -math.inf
    out = folded(scores, values, block=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values)


def random_pool(num_blocks: int, block_size: int, Hkv: int, D: int, seed: int) -> PagedKVCache:
    g = torch.Generator().manual_seed(seed)
    pool = PagedKVCache(num_blocks, block_size, Hkv, D)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    return pool


def dense_attention(q: torch.Tensor, pool: PagedKVCache, table: list[int], length: int) -> torch.Tensor:
    """The reference: the sequence's keys gathered densely, then torch's attention with a causal mask."""
    T = q.shape[1]
    k, v = gather_reference(pool, table, length)  # (Hkv, length, D)
    mask = causal_mask(T, length, length - T)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]


# (H, Hkv, D, block_size): SmolLM2's heads, Qwen2.5-0.5B's (14 over 2), plain multi-head, tiny blocks
SHAPES = [(9, 3, 64, 16), (14, 2, 64, 16), (4, 4, 8, 4), (6, 1, 16, 1)]
CASES = [(1, 1), (15, 1), (16, 1), (17, 1), (300, 1), (300, 7), (17, 17), (33, 5), (64, 64)]  # (length, T)


@pytest.mark.parametrize("H, Hkv, D, bs", SHAPES)
@pytest.mark.parametrize("length, T", CASES)
def test_paged_attention_equals_dense_attention(H, Hkv, D, bs, length, T):
    num_blocks = -(-300 // bs) + 3
    pool = random_pool(num_blocks, bs, Hkv, D, seed=length * 100 + T)
    g = torch.Generator().manual_seed(T)
    table = torch.randperm(num_blocks, generator=g)[: -(-length // bs)].tolist()  # blocks in no order
    q = 2 * torch.randn(H, T, D, generator=g)
    want = dense_attention(q, pool, table, length)
    torch.testing.assert_close(paged_attention_reference(q, pool, table, length), want)


def test_scale_is_used():
    pool, g = random_pool(8, 4, 2, 8, seed=1), torch.Generator().manual_seed(1)
    q = torch.randn(4, 3, 8, generator=g)
    k, v = gather_reference(pool, [3, 1, 5], 10)
    want = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal_mask(3, 10, 7), scale=0.05,
                                          enable_gqa=True)[0]
    torch.testing.assert_close(paged_attention_reference(q, pool, [3, 1, 5], 10, scale=0.05), want)


def test_reads_only_the_blocks_of_its_table():
    """Garbage in every block outside the table (and past the length in the last one) changes nothing."""
    pool, g = random_pool(10, 4, 1, 8, seed=2), torch.Generator().manual_seed(2)
    q, table = torch.randn(2, 1, 8, generator=g), [6, 0, 3]
    before = paged_attention_reference(q, pool, table, 10)
    for block in set(range(10)) - set(table):
        pool.k[block], pool.v[block] = 1e4, float("nan")
    pool.k[3, 2:], pool.v[3, 2:] = 1e4, float("nan")  # slots 10 and 11 of the sequence: not yet written
    torch.testing.assert_close(paged_attention_reference(q, pool, table, 10), before, atol=0, rtol=0)


def test_planted_missing_rescale_fails(monkeypatch):
    """Forgetting exp(m - m') (old sums kept relative to the old maximum) must fail the comparison."""
    def fold_without_rescale(state: SoftmaxState, scores, values) -> SoftmaxState:
        m = torch.maximum(state.m, scores.amax(-1))
        p = torch.exp(scores - m[..., None])
        return SoftmaxState(m, state.l + p.sum(-1), state.acc + p @ values)

    pool, g = random_pool(24, 16, 3, 64, seed=3), torch.Generator().manual_seed(3)
    q, table = 2 * torch.randn(9, 1, 64, generator=g), list(range(19))
    want = dense_attention(q, pool, table, 300)
    torch.testing.assert_close(paged_attention_reference(q, pool, table, 300), want)
    monkeypatch.setattr(paged_attention, "fold_block", fold_without_rescale)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(paged_attention_reference(q, pool, table, 300), want)


def test_planted_causal_slip_fails():
    """A prefill chunk whose queries see one key too few (the mask one position early) must fail."""
    source = inspect.getsource(paged_attention.paged_attention_reference)
    assert source.count("causal_mask(T, length, length - T,") == 1
    namespace = dict(vars(paged_attention))
    exec(source.replace("causal_mask(T, length, length - T,", "causal_mask(T, length, length - T - 1,"), namespace)
    pool, g = random_pool(8, 4, 2, 8, seed=4), torch.Generator().manual_seed(4)
    q, table = torch.randn(4, 6, 8, generator=g), [2, 7, 4, 0]
    want = dense_attention(q, pool, table, 14)
    torch.testing.assert_close(paged_attention_reference(q, pool, table, 14), want)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(namespace["paged_attention_reference"](q, pool, table, 14), want)


def test_real_keys_of_smollm2(smollm2):
    """The keys and values SmolLM2 writes into a paged cache during a prefill, read back by paged attention."""
    model, tok = smollm2
    cfg = model.config
    ids = tok.encode("The paged KV cache keeps each sequence's keys in blocks scattered over one pool. " * 3)
    manager = BlockManager(num_blocks=16, block_size=16)
    manager.allocate("a", [0] * 16)  # take blocks first, so the sequence's table is not 0, 1, 2, ...
    manager.allocate("s", ids)
    manager.free("a")
    cache = make_paged_cache(cfg, 16, 16)
    with torch.no_grad():
        paged_forward(model, cache, manager, ["s"], torch.tensor([ids]))
    g = torch.Generator().manual_seed(5)
    for layer in (0, cfg.num_hidden_layers - 1):
        q = torch.randn(cfg.num_attention_heads, 4, cfg.head_dim, generator=g)
        table = manager.block_table("s")
        torch.testing.assert_close(paged_attention_reference(q, cache[layer], table, len(ids)),
                                   dense_attention(q, cache[layer], table, len(ids)))


@pytest.mark.parametrize("q_shape, length, message", [
    ((9, 1, 32), 10, "q must be (H, T, D) with D = 64"),
    ((8, 1, 64), 10, "H a multiple of Hkv = 3"),
    ((9, 64), 10, "q must be (H, T, D)"),
    ((9, 1, 64), 49, "length must be in [T, blocks * block_size] = [1, 48], got 49"),
    ((9, 5, 64), 4, "length must be in [T, blocks * block_size] = [5, 48], got 4"),
])
def test_bad_inputs_name_the_problem(q_shape, length, message):
    pool = random_pool(4, 16, 3, 64, seed=0)
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention_reference(torch.zeros(q_shape), pool, [0, 1, 2], length)
