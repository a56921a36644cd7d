"""Exercise checks of notebooks 08-12: the KV cache, the paged cache, sampling, quantization.

Each takes a student's function or class and returns True (PASS) or False (FAIL, with feedback);
see minillm/check/__init__.py for how they are called.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import torch

from minillm.check.harness import compare, expect_raises, fail, run_check
from minillm.cache.paged_attention import empty_state
from minillm.cache.paged import BlockManager, PagedKVCache


# ------------------------------------------------------------------ 08 KV cache


def kv_cache_update(cls) -> bool:
    """KVCache.update(pos, k, v): write at slots pos..pos+T-1, return views of slots 0..pos+T-1."""
    def body():
        g = torch.Generator().manual_seed(0)
        B, Hkv, S_max, D = 2, 2, 10, 4
        cache = cls(B, S_max, Hkv, D)
        k1, v1 = torch.randn(B, Hkv, 4, D, generator=g), torch.randn(B, Hkv, 4, D, generator=g)
        k2, v2 = torch.randn(B, Hkv, 1, D, generator=g), torch.randn(B, Hkv, 1, D, generator=g)
        k3, v3 = torch.randn(B, Hkv, 2, D, generator=g), torch.randn(B, Hkv, 2, D, generator=g)
        full = "return only positions 0..pos+T-1 (k[:, :, :pos + T]), not the whole preallocated buffer"
        got_k, got_v = cache.update(0, k1, v1)
        compare("update(0, k of 4 tokens): returned k", got_k, k1, hint=full)
        compare("update(0, v of 4 tokens): returned v", got_v, v1, hint="write v into the v buffer")
        got_k, got_v = cache.update(4, k2, v2)
        exp_k, exp_v = torch.cat([k1, k2], 2), torch.cat([v1, v2], 2)
        stale = torch.cat([k2, k1[:, :, 1:], torch.zeros_like(k2)], 2)
        compare("update(4, k of 1 token): returned k", got_k, exp_k, hint=full,
                mistakes=[("write at slots pos..pos+T-1 (the time dim, dim 2), not at slot 0", stale)])
        compare("update(4, v of 1 token): returned v", got_v, exp_v, hint=full)
        for name, got in (("k", got_k), ("v", got_v)):
            buffer = getattr(cache, name, None)
            if isinstance(buffer, torch.Tensor) and got.data_ptr() != buffer.data_ptr():
                fail(f"update returned a copy of {name}, not a view of the cache's buffer",
                     "slice the buffer (self.k[:, :, :pos + T]) instead of torch.cat or .clone(): no copy per step")
        got_k, _ = cache.update(5, k3, v3)
        compare("update(5, k of 2 tokens) after 5 cached: returned k", got_k, torch.cat([k1, k2, k3], 2), hint=full)
    return run_check("KVCache.update", body)


# ------------------------------------------------------------------ 11 paged cache


def _paged_pool(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(8, 4, 2, 3)  # 8 blocks of 4 slots, Hkv 2, D 3
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def gather_reference(fn) -> bool:
    """gather_reference(cache, block_table, length) -> k, v (Hkv, length, D), read block by block."""
    def body():
        cache = _paged_pool()
        table, length = [5, 1, 6], 10  # 4 + 4 + 2 tokens: the last block only partly used
        slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(length)])
        expected_k = cache.k.view(-1, 2, 3)[slots].transpose(0, 1)  # (length, Hkv, D) -> (Hkv, length, D)
        expected_v = cache.v.view(-1, 2, 3)[slots].transpose(0, 1)
        got = fn(cache, table, length)
        if not isinstance(got, tuple) or len(got) != 2:
            fail(f"expected a tuple (k, v), got {type(got).__name__}")
        whole = cache.k[table].reshape(-1, 2, 3).transpose(0, 1)  # every slot of every block
        compare("k for table [5, 1, 6], length 10", got[0], expected_k,
                mistakes=[("the last block is only partly used: take length - i * block_size rows of it", whole),
                           ("return (Hkv, length, D): transpose the (length, Hkv, D) you gathered",
                            expected_k.transpose(0, 1))],
                hint="block i of the table holds positions i*bs .. i*bs+bs-1: read cache.k[block, :n] in table order")
        compare("v for table [5, 1, 6], length 10", got[1], expected_v, hint="read v from cache.v, like k")
    return run_check("gather_reference", body)


def batch_layout(fn) -> bool:
    """batch_layout(manager, seq_ids, new_tokens, sink_slot) -> BatchLayout with right-aligned rows."""
    def body():
        manager = BlockManager(16, 4, enable_prefix_caching=False)
        manager.allocate("a", list(range(10, 19)))  # 9 tokens
        manager.allocate("b", list(range(30, 35)))  # 5 tokens
        lengths = {"a": 9, "b": 5}
        S, T = 9, 1
        got = fn(manager, ["a", "b"], T)
        rows = {s: [manager.slot(s, p) for p in range(L)] for s, L in lengths.items()}
        expected_gather = torch.tensor([[0] * (S - L) + rows[s] for s, L in lengths.items()])
        expected_mask = torch.tensor([[0] * (S - L) + [1] * L for L in lengths.values()])
        left_aligned = torch.tensor([rows[s] + [0] * (S - L) for s, L in lengths.items()])
        right_hint = "right-align each row: padding goes on the LEFT, so every row's newest tokens share the last columns"
        compare("gather", got.gather, expected_gather, mistakes=[(right_hint, left_aligned)],
                hint="gather[b] lists the pool slot of each key position 0..L_b-1, after S - L_b padding columns")
        compare("attention_mask", got.attention_mask, expected_mask, hint="1 for a real key, 0 for padding")
        compare("slots", got.slots, torch.tensor([[rows["a"][-1]], [rows["b"][-1]]]),
                hint="slots are where the T new tokens go: the slots of positions L_b - T .. L_b - 1")
        compare("positions", got.positions, torch.tensor([[8], [4]]),
                mistakes=[("positions count from each sequence's own start: L_b - T .. L_b - 1, not the padded column",
                            torch.tensor([[8], [8]]))])
        if got.start_pos != S - T:
            fail(f"start_pos: expected {S - T}, got {got.start_pos}",
                 "start_pos is the number of key columns before the new tokens: S - T")
        # a batched prefill: a computes its last 3 tokens (6 cached), b its last 1 (4 cached); C = 6, T = 3
        got = fn(manager, ["a", "b"], [3, 1], sink_slot=64)
        a, b = rows["a"], rows["b"]
        compare("gather, new_tokens [3, 1]", got.gather, torch.tensor([a[:6] + a[6:], [0, 0] + b[:4] + [0, 0] + b[4:]]),
                hint="two right-aligned parts: C = max cached columns, then T = max new columns, each padded on the left")
        compare("attention_mask, new_tokens [3, 1]", got.attention_mask,
                torch.tensor([[1] * 9, [0, 0, 1, 1, 1, 1, 0, 0, 1]]), hint="padding in either part is masked")
        compare("slots, new_tokens [3, 1]", got.slots, torch.tensor([a[6:], [64, 64] + b[4:]]),
                hint="a padding query writes its keys to sink_slot, never to a sequence's block")
        compare("positions, new_tokens [3, 1]", got.positions, torch.tensor([[6, 7, 8], [0, 0, 4]]),
                hint="new token positions are c_b .. L_b - 1; padding queries get position 0")
        if got.start_pos != 6:
            fail(f"start_pos with new_tokens [3, 1]: expected C = 6, got {got.start_pos}",
                 "start_pos is the number of key columns before the new part: C, the largest cached count")
    return run_check("batch_layout", body)


def _folded(scores: torch.Tensor, values: torch.Tensor, block: int, rescale_l: bool = True, rescale_acc: bool = True,
            inverted: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(m, l, acc) after each block, by the recurrence, or by a known slip in it (planted by the flags)."""
    T, D = scores.shape[0], values.shape[-1]
    m, l, acc, states = torch.full((T,), -math.inf), torch.zeros(T), torch.zeros(T, D), []
    for start in range(0, scores.shape[1], block):
        s, v = scores[:, start:start + block], values[start:start + block]
        new_m = torch.maximum(m, s.amax(-1))
        safe = new_m.masked_fill(new_m == -math.inf, 0.0)
        rescale = torch.exp(safe - m) if inverted else torch.exp(m - safe)
        p = torch.exp(s - safe[:, None])
        l = (l * rescale if rescale_l else l) + p.sum(-1)
        acc = (acc * rescale[:, None] if rescale_acc else acc) + p @ v
        m = new_m
        states.append((m, l, acc))
    return states


def fold_block(fn) -> bool:
    """fold_block(state, scores, values) -> (m, l, acc) after one more block of keys: the online softmax."""
    def body():
        g = torch.Generator().manual_seed(0)
        scores = torch.stack([torch.tensor([3.0, 91.0, 40.0, 7.5, 96.0, 12.0, 88.0, 95.5, 1.0, 60.0]),  # exp overflows
                              torch.randn(10, generator=g)])                                        # (T = 2, 10 keys)
        scores[1, :4] = -math.inf  # the second query's first block is all masked
        values = torch.randn(10, 3, generator=g)
        want = _folded(scores, values, 4)
        slips = {"l": [("rescale l too: l' = l exp(m - m') + sum exp(s - m')", _folded(scores, values, 4, False))],
                 "acc": [("rescale acc too: acc' = acc exp(m - m') + exp(s - m') @ values",
                          _folded(scores, values, 4, rescale_acc=False)),
                         ("the old sums shrink: multiply by exp(m - m'), which is at most 1, not exp(m' - m)",
                          _folded(scores, values, 4, inverted=True))]}
        state = empty_state((2,), 3)
        for i, start in enumerate(range(0, 10, 4)):
            got = fn(state, scores[:, start:start + 4], values[start:start + 4])
            if not isinstance(got, tuple) or len(got) != 3:
                fail(f"expected a SoftmaxState (m, l, acc), got {type(got).__name__}")
            where = f"after keys {start}..{min(start + 4, 10) - 1}"
            finite = torch.isfinite(got[1]) & torch.isfinite(got[2]).all(-1)  # (T,) per query
            if not finite.all():
                fail(f"{where}: l or acc holds inf or NaN for query {int((~finite).nonzero()[0])}", (
                    "query 1's keys so far are all masked, so m' is -inf: subtract 0 for it instead, so that "
                    "exp(-inf - (-inf)) never appears") if finite[0] else (
                    "subtract the new maximum before exp, and multiply the old sums by exp(m - m'), which is at most "
                    "1 (not exp(m' - m))"))
            compare(f"{where}: m", got[0], want[i][0], hint="m' is the larger of the old m and the block's own maximum")
            for j, name in ((1, "l"), (2, "acc")):
                compare(f"{where}: {name}", got[j], want[i][j], atol=1e-5, rtol=1e-5,
                        mistakes=[(hint, slip[i][j]) for hint, slip in slips[name]],
                        hint="subtract m' from every score of the block before exp, and rescale the old sums")
            state = got
        compare("acc / l after all blocks", state[2] / state[1][:, None], torch.softmax(scores, -1) @ values,
                atol=1e-5, rtol=1e-5)
    return run_check("fold_block", body)


# ------------------------------------------------------------------ 09 sampling

_NEG = float("-inf")


def _no_inplace(what: str, fn, logits: torch.Tensor, *args):
    before = logits.clone()
    out = fn(logits, *args)
    if not torch.equal(logits, before):
        fail(f"{what} changed its input logits", "don't modify logits in place: masked_fill, not masked_fill_")
    return out


def top_k_filter(fn) -> bool:
    """top_k_filter(logits, k): keep the k largest logits per row (and ties with the k-th), others -inf."""
    def body():
        logits = torch.tensor([[1.0, 4.0, 2.0, 3.0, 0.5, -1.0], [0.0, -2.0, 5.0, 1.0, 2.5, 3.5]])
        def keep(k):
            kth = logits.topk(k, -1).values[:, -1:]
            return logits.masked_fill(logits < kth, _NEG)
        compare("top_k_filter(logits (2, 6), k=3)", _no_inplace("top_k_filter", fn, logits, 3), keep(3),
                mistakes=[("keep exactly k tokens: off by one", keep(2)), ("keep exactly k tokens: off by one", keep(4)),
                           ("removed logits become -inf, not 0 (a logit of 0 still has probability)",
                            logits.masked_fill(logits < logits.topk(3, -1).values[:, -1:], 0.0)),
                           ("return logits, not probabilities", torch.softmax(keep(3), -1))])
        compare("top_k_filter(logits, k=0) keeps all", fn(logits, 0), logits, hint="k = 0 means off: return logits")
        compare("top_k_filter(logits, k=6 = V) keeps all", fn(logits, 6), logits)
        ties = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0]])
        compare("top_k_filter with ties at the k-th value, k=2", fn(ties, 2),
                ties.masked_fill(ties < 3.0, _NEG), hint="keep ties with the k-th largest: remove only logits < the k-th value")
    return run_check("top_k_filter", body)


def _logits_of(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def top_p_filter(fn) -> bool:
    """top_p_filter(logits, p): keep the most likely tokens until their mass reaches p, the crossing one too."""
    def body():
        probs = [[0.05, 0.25, 0.10, 0.45, 0.15], [0.30, 0.05, 0.40, 0.10, 0.15]]
        logits = _logits_of(probs)
        def keep(row_sets):
            remove = torch.ones_like(logits, dtype=torch.bool)
            for r, cols in enumerate(row_sets):
                remove[r, cols] = False
            return logits.masked_fill(remove, _NEG)
        # p = 0.6: row 0 keeps 0.45, 0.25 (0.45 + 0.25 crosses 0.6); row 1 keeps 0.40, 0.30
        expected = keep([[3, 1], [2, 0]])
        sorted_order = [[0, 1], [0, 1]]  # the sorted-order mask applied without scattering back
        compare("top_p_filter(logits, p=0.6)", _no_inplace("top_p_filter", fn, logits, 0.6), expected,
                mistakes=[("did you keep the token that crosses the threshold? keep a token while the mass BEFORE it is < p",
                            keep([[3], [2]])),
                           ("keep a token while the mass before it is < p (you kept one past the crossing token)",
                            keep([[3, 1, 4], [2, 0, 4]])),
                           ("the mask was computed in sorted order: scatter it back to vocabulary order", keep(sorted_order)),
                           ("removed logits become -inf, not 0", logits.masked_fill(torch.isinf(expected), 0.0))])
        compare("top_p_filter(logits, p=0.1) keeps the most likely token", fn(logits, 0.1), keep([[3], [2]]),
                hint="the most likely token is always kept (the mass before it is 0)")
        compare("top_p_filter(logits, p=1.0) keeps all", fn(logits, 1.0), logits)
    return run_check("top_p_filter", body)


def min_p_filter(fn) -> bool:
    """min_p_filter(logits, p): keep tokens with probability >= p * (the top token's probability)."""
    def body():
        logits = _logits_of([[0.05, 0.2, 0.5, 0.15, 0.1], [0.3, 0.25, 0.2, 0.15, 0.1]])
        probs = torch.softmax(logits, -1)
        def keep_rel(p):
            return logits.masked_fill(probs < p * probs.amax(-1, keepdim=True), _NEG)
        compare("min_p_filter(logits, p=0.35)", _no_inplace("min_p_filter", fn, logits, 0.35), keep_rel(0.35),
                mistakes=[("the threshold is p times the top token's probability, not p itself",
                            logits.masked_fill(probs < 0.35, _NEG)),
                           ("compare probabilities (softmax), not logits",
                            logits.masked_fill(logits < 0.35 * logits.amax(-1, keepdim=True), _NEG)),
                           ("removed logits become -inf, not 0", logits.masked_fill(probs < 0.35 * probs.amax(-1, keepdim=True), 0.0))])
        compare("min_p_filter(logits, p=0) keeps all", fn(logits, 0.0), logits)
        compare("min_p_filter(logits, p=1) keeps only the top token", fn(logits, 1.0), keep_rel(1.0))
    return run_check("min_p_filter", body)


# ------------------------------------------------------------------ 13 quantization


def quantize_int4(fn) -> bool:
    """quantize_int4(w, group_size, name) -> q (N, K) uint8 in 0..15, scales, zeros (N, K/g): w ≈ (q - 8) * s + z."""
    def body():
        w = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
        for g in (32, 64):
            got = fn(w, g)
            if not isinstance(got, tuple) or len(got) != 3:
                fail(f"expected a tuple (q, scales, zeros), got {type(got).__name__}")
            q, scales, zeros = got
            wg = w.view(3, 128 // g, g)  # independent min/max per group
            lo, hi = wg.min(-1).values, wg.max(-1).values
            s = (hi - lo) / 15
            what = f"quantize_int4(w (3, 128), group_size={g})"
            compare(f"{what}: scales", scales, s, atol=1e-6, rtol=1e-5,
                    mistakes=[("16 levels 0..15 span hi - lo in 15 steps: divide by 15, not 16", (hi - lo) / 16)],
                    hint="one scale per group of g consecutive inputs in a row: (max - min) / 15")
            compare(f"{what}: zeros", zeros, lo + 8 * s, atol=1e-5, rtol=1e-5,
                    mistakes=[("w ≈ (q - 8) * scale + zero, so zero is the value q = 8 stands for: lo + 8 * scale", lo)])
            if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.shape != w.shape:
                fail(f"{what}: q is {getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}, "
                     "expected uint8 (3, 128)", "return q as uint8 of w's shape (reshape the groups back)")
            if int(q.max()) > 15:
                fail(f"{what}: q reaches {int(q.max())}", "clamp q to 0..15")
            err = ((q.float().view_as(wg) - 8) * s[..., None] + (lo + 8 * s)[..., None] - wg).abs()
            bad = err > s[..., None] / 2 + 1e-5
            if bad.any():
                idx = tuple(int(i) for i in bad.nonzero()[0])
                fail(f"{what}: q decodes {int(bad.sum())} weights to more than half a step from w; first at "
                     f"(row, group, i) = {idx}", "q = round((w - lo) / scale): lo -> 0, hi -> 15")
        expect_raises("quantize_int4(w (3, 96), group_size=64)", ValueError, lambda: fn(w[:, :96], 64),
                      "the group size must divide K: call validate_group_size(K, group_size, name) first")
    return run_check("quantize_int4", body)


def _q4_1_decode(raw: torch.Tensor, shape, pairs: str = "j, j+16", offset: float = 0.0) -> torch.Tensor:
    """Q4_1 decoded with a given nibble order (the right one, or a mistake's)."""
    b = raw.reshape(-1, 20)
    d, m = b[:, 0:2].contiguous().view(torch.float16).float(), b[:, 2:4].contiguous().view(torch.float16).float()
    lo, hi = b[:, 4:] & 0x0F, b[:, 4:] >> 4
    q = torch.cat([lo, hi], -1) if pairs == "j, j+16" else torch.stack([lo, hi], -1).reshape(-1, 32)
    return (d * (q.float() - offset) + m).reshape(tuple(shape))


def dequantize_q4_1(fn) -> bool:
    """dequantize_q4_1(raw, shape): GGUF Q4_1 blocks -> float32 weights, checked against the gguf package."""
    def body():
        x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
        packed = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_1)  # (2, 40): 2 blocks per row
        expected = torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q4_1).copy())
        raw = torch.from_numpy(packed.reshape(-1).copy())
        compare("dequantize_q4_1(4 blocks, shape (2, 64))", fn(raw, (2, 64)), expected,
                mistakes=[("nibble order: byte j holds q_j (low 4 bits) and q_{j+16} (high 4 bits), "
                            "not q_{2j} and q_{2j+1}", _q4_1_decode(raw, (2, 64), "2j, 2j+1")),
                           ("Q4_1 has no -8: w = d * q + m (the minimum m is stored)",
                            _q4_1_decode(raw, (2, 64), offset=8.0))],
                hint="block = | d: fp16 | m: fp16 | 16 bytes of nibbles |; w_i = d * q_i + m")
    return run_check("dequantize_q4_1", body)
