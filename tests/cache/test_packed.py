"""Packed (varlen) forwards (minillm/cache/packed.py, notebook 17): a step's new tokens in one row, each
sequence's attention kept apart, against the plain full recompute of every sequence alone; the
model's tensor `logits_to_keep` against slicing the full logits; the engine's plan of a step;
planted bugs the comparison must catch."""

from __future__ import annotations

import re

import pytest
import torch

import minillm.runtime.engine as engine_module
import minillm.cache.packed as packed_module
from support import DATA
from minillm.weights.embedded import embedded_gguf_path
from minillm.runtime.engine import Engine, forward_packed, forward_step, packed_batches
from minillm.speed.fast import FastCausalLM
from minillm.runtime.generate import generate
from minillm.model.decoder import from_folder
from minillm.cache.packed import packed_layout
from minillm.cache.paged import BlockManager, make_paged_cache
from minillm.runtime.sequence import Sequence
from minillm.text.tokenizer import Tokenizer

TINY = ["tiny-qwen3", "tiny-llama", "tiny-qwen2-tied", "tiny-qwen2-untied"]


def seq(i: int, ids: list[int], computed: int = 0, pending: int | None = None) -> Sequence:
    """A sequence as the engine holds it: `computed` prompt tokens already in the pool, or decoding `pending`."""
    return Sequence(i, ids, None, None, num_computed=computed, pending=pending)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """The reference: the whole sequence recomputed with no cache, the last position's logits (V,)."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1]


def mixed_step(model, attention: str, seed: int = 0):
    """One packed forward after earlier ones filled the pool: a fresh prompt, a chunk after 11 cached
    tokens, a chunk after a cached block, and three decode rows. Returns (logits, references)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 23, 37, 5, 17, 30)]
    manager = BlockManager(64, 4)
    manager.free_list = type(manager.free_list)(torch.randperm(64, generator=g).tolist())  # blocks in no order
    cache = make_paged_cache(model.config, 65, 4)
    history = [seq(1, ids[1], 0), seq(2, ids[2], 0)] + [seq(3 + i, ids[3 + i], 0) for i in range(3)]
    earlier = [(history[0], 11), (history[1], 8)] + [(s, len(s.token_ids) - 1) for s in history[2:]]
    for s, _ in earlier:
        manager.allocate(s.id, s.token_ids)
    with torch.no_grad():
        forward_packed(model, cache, manager, earlier)  # the cached parts, themselves packed
    for s, n in earlier:
        s.num_computed = n
    decoding = history[2:]
    for s in decoding:
        s.pending = s.token_ids[-1]
    fresh = seq(0, ids[0])
    manager.allocate(fresh.id, fresh.token_ids)
    batch = [(fresh, 9), (history[0], 12), (history[1], 29)] + [(s, 0) for s in decoding]
    with torch.no_grad():
        logits = forward_packed(model, cache, manager, batch, attention)  # (6, V)
    return logits, torch.stack([full_logits(model, s.token_ids) for s, _ in batch])


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("attention", ["gather", "paged"])
def test_packed_forward_equals_the_full_recompute(name, attention):
    model = from_folder(DATA / name)
    logits, want = mixed_step(model, attention)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_fast_model_packed_forward_equals_the_full_recompute(name):
    model = from_folder(DATA / name)
    logits, want = mixed_step(FastCausalLM(model).eval(), "gather", seed=1)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


def test_smollm2_packed_prefill_and_decode_equal_the_full_recompute(smollm2):
    model, tokenizer = smollm2
    texts = ["The capital of France is", "Once upon a time, in a land far away, there lived a",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return", "1, 2, 3, 4, 5,"]
    seqs = [seq(i, tokenizer.encode(t)) for i, t in enumerate(texts)]
    manager, cache = BlockManager(32, 16), make_paged_cache(model.config, 33, 16)
    for s in seqs:
        manager.allocate(s.id, s.token_ids)
    with torch.no_grad():
        first = forward_packed(model, cache, manager, [(s, len(s.token_ids)) for s in seqs[:3]])  # (3, V)
        for s, token in zip(seqs, first.argmax(-1).tolist()):
            s.num_computed, s.pending = len(s.token_ids), token
            manager.append(s.id, token)
        mixed = forward_packed(model, cache, manager, [(seqs[3], len(seqs[3].token_ids))] + [(s, 0) for s in seqs[:3]])
    prompts = [s.token_ids for s in seqs]  # the pending tokens are not output yet: these are the prompts
    want = [prompts[i] for i in range(3)] + [prompts[3]] + [prompts[i] + [seqs[i].pending] for i in range(3)]
    for got, ids in zip([*first, *mixed], want):
        torch.testing.assert_close(got, full_logits(model, ids), atol=1e-3, rtol=0)
    assert mixed[1:].argmax(-1).tolist() == [generate(model, tokenizer, p, max_new_tokens=2).token_ids[1] for p in prompts[:3]]


def test_planted_bug_a_chunk_blind_to_its_own_key_is_caught(monkeypatch):
    """causal_mask one position short for a chunk after cached keys: each query misses its own key."""
    model = from_folder(DATA / "tiny-qwen3")
    real = packed_module.causal_mask
    monkeypatch.setattr(packed_module, "causal_mask", lambda T, S, start, device=None: real(T, S, start - 1, device))
    logits, want = mixed_step(model, "gather")
    assert (logits[1:3] - want[1:3]).abs().max() > 1e-2  # the two chunks after cached keys
    torch.testing.assert_close(logits[0], want[0], atol=1e-4, rtol=0)  # the fresh prompt is not affected


def test_planted_bug_positions_from_the_row_start_are_caught(monkeypatch):
    """RoPE positions counted along the packed row instead of within each sequence."""
    model = from_folder(DATA / "tiny-llama")
    real = packed_module.packed_layout

    def row_positions(*args, **kwargs):
        layout = real(*args, **kwargs)
        layout.positions = torch.arange(layout.positions.shape[1])[None]
        return layout

    monkeypatch.setattr(engine_module, "packed_layout", row_positions)
    logits, want = mixed_step(model, "gather")
    assert (logits[1:] - want[1:]).abs().max() > 1e-2


def test_layout_of_a_small_step():
    m = BlockManager(8, 4)
    m.allocate("a", list(range(10, 18)))  # 8 tokens: 5 cached, 3 new
    m.allocate("b", list(range(30, 35)))  # 5 new
    m.allocate("c", list(range(50, 57)))  # decoding its 7th token
    lay = packed_layout(m, [("a", 5, 3), ("b", 0, 5)], ["c"], pool_blocks=9)
    assert lay.slots.tolist() == [m.slot("a", p) for p in (5, 6, 7)] + [m.slot("b", p) for p in range(5)] + [m.slot("c", 6)]
    assert lay.positions.tolist() == [[5, 6, 7, 0, 1, 2, 3, 4, 6]] and lay.ends.tolist() == [2, 7, 8]
    assert [(s.start, s.new, s.cached) for s in lay.segments] == [(0, 3, 5), (3, 5, 0)] and lay.prefill_tokens == 8
    assert lay.segments[0].keys.tolist() == [m.slot("a", p) for p in range(8)] and lay.segments[1].keys is None


def test_a_step_is_one_forward_until_the_token_budget():
    a, b, c, d = (seq(i, [1] * 10) for i in range(4))
    assert packed_batches([(a, 10), (b, 6)], [c, d], 4096, 256) == [[(a, 10), (b, 6), (c, 0), (d, 0)]]
    assert packed_batches([(a, 10), (b, 6)], [c, d], 12, 256) == [[(a, 10)], [(b, 6), (c, 0), (d, 0)]]
    assert packed_batches([(a, 10)], [c, d], 4096, 11) == [[(a, 10), (c, 0)], [(d, 0)]]  # the context bounds a row
    assert packed_batches([], [c], 1, 256) == [[(c, 0)]] and packed_batches([], [], 8, 8) == []


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(embedded_gguf_path())  # decodes any id < 320: the tiny models have no tokenizer


@pytest.mark.parametrize("num_blocks", [512, 8], ids=["roomy", "forced-preemption"])
def test_engine_runs_one_forward_a_step_and_equals_one_at_a_time(tok, num_blocks, monkeypatch):
    model = from_folder(DATA / "tiny-llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (10,), generator=g)]
    forwards, steps, real_step, real = [], [], Engine.step, engine_module.forward_step
    monkeypatch.setattr(Engine, "step", lambda self: steps.append(len(forwards)) or real_step(self))
    monkeypatch.setattr(engine_module, "forward_step", lambda *a: forwards.append(a[3]) or real(*a))
    engine = Engine(model, tok, num_blocks=num_blocks, max_num_seqs=4)  # <= 4 x 52 tokens a step: one forward
    limits = [int(n) for n in torch.randint(2, 13, (10,), generator=g)]  # they end apart: others join mid-decode
    out = engine.generate(prompts, max_new_tokens=limits, eos_token_ids=())
    assert [r["token_ids"] for r in out] == [generate(model, tok, p, max_new_tokens=m, eos_token_ids=()).token_ids
                                             for p, m in zip(prompts, limits)]
    assert len(forwards) == len(steps)  # one forward per step: prefills and decodes together
    assert any(any(n for _, n in b) and any(n == 0 for _, n in b) for b in forwards)  # some mixed both
    assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 8)


@pytest.mark.parametrize("name", ["tiny-qwen2-untied", "tiny-qwen3"])
def test_logits_to_keep_columns_equal_the_full_logits(name):
    model = from_folder(DATA / name)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    cols = torch.tensor([0, 4, 8, 4])
    with torch.no_grad():
        for m in (model, FastCausalLM(model).eval()):
            torch.testing.assert_close(m(ids, logits_to_keep=cols), m(ids)[:, cols], atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad, says", [(torch.tensor([[0, 1]]), "1-D int64"), (torch.tensor([0.0]), "1-D int64"),
                                       (torch.tensor([9]), "in [0, T=9)"), (torch.tensor([-1]), "in [0, T=9)")])
def test_bad_logits_to_keep_is_named(bad, says):
    model = from_folder(DATA / "tiny-llama")
    with pytest.raises(ValueError, match=r"logits_to_keep.*" + re.escape(says)):
        model(torch.zeros(1, 9, dtype=torch.long), logits_to_keep=bad)


def test_lora_rows_still_run_padded(monkeypatch):
    """An adapter is chosen per row: a batch holding one goes through forward_batch, not the packed row."""
    model = from_folder(DATA / "tiny-llama")
    calls = []
    monkeypatch.setattr(engine_module, "forward_batch", lambda *a, **k: calls.append(len(a[3])) or torch.zeros(len(a[3]), 7))
    a, b = seq(0, [5] * 6), seq(1, [6] * 4, pending=6)
    a.lora = 1
    manager = BlockManager(8, 4)
    manager.allocate(0, a.token_ids), manager.allocate(1, b.token_ids)
    logits = forward_step(model, make_paged_cache(model.config, 9, 4), manager, [(a, 6), (b, 0)], 32)
    assert calls == [1, 1] and logits.shape == (2, 7)


def test_only_a_tables_only_layout_carries_block_tables_and_it_cannot_be_attended():
    """packed_layout builds the decode rows' block tables only when asked (A4's one call reads them); a view
    of such a layout hands them over as decode_rows and refuses `attend`, which it laid out nothing for."""
    manager, pool = BlockManager(8, 4), make_paged_cache(from_folder(DATA / "tiny-llama").config, 9, 4)
    for s, prompt in ((0, [3, 1, 4, 1, 5]), (1, [9, 2])):
        manager.allocate(s, prompt)
    plain = packed_layout(manager, [], [0, 1], 9)
    assert plain.decode_tables is None and packed_module.PackedView(pool[0], plain).decode_rows is None
    layout = packed_layout(manager, [], [0, 1], 9, tables_only=True)
    assert layout.decode is None and layout.decode_lengths.tolist() == [5, 2]
    assert layout.decode_tables.tolist() == [manager.block_table(0), manager.block_table(1) + [0]]
    view = packed_module.PackedView(pool[0], layout)
    assert view.decode_rows.tables is layout.decode_tables
    q, kv = torch.zeros(1, 4, 2, 16), torch.zeros(1, 2, 2, 16)  # refused before any shape is read
    with pytest.raises(RuntimeError, match="reads the block tables itself"):
        view.attend(q, kv, kv)
