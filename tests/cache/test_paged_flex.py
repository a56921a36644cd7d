"""Paged attention's fast path (minillm/cache/paged_attention.py, notebook 16): FlexAttention reading the
pool through the block tables, against the gathered keys and torch's scaled_dot_product_attention;
the engine on that path against one-at-a-time generation; planted bugs the comparison must catch;
the choice of path and its errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minillm.runtime.engine as engine_module
from support import DATA
from minillm.cache import paged_attention
from minillm.weights.embedded import embedded_gguf_path
from minillm.runtime.engine import Engine, forward_batch, paged_step
from minillm.runtime.generate import generate
from minillm.model.decoder import from_folder
from minillm.cache.paged_attention import BlockTableView, decode_layout, use_paged_attention
from minillm.cache.paged import BlockManager, PagedKVCache, gather_reference, make_paged_cache
from minillm.text.tokenizer import Tokenizer

TINY = ["tiny-qwen3", "tiny-llama", "tiny-qwen2-tied"]


def random_batch(H: int, Hkv: int, D: int, bs: int, lengths: list[int], seed: int = 0, shared: int = 0):
    """A shuffled pool of random keys holding sequences of `lengths` tokens; the last two rows share
    their first `shared` tokens when shared > 0. Returns (manager, pool, q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // bs) for L in lengths) + 5
    manager = BlockManager(n_blocks, bs)
    manager.free_list = type(manager.free_list)(torch.randperm(n_blocks, generator=g).tolist())  # blocks in no order
    pool = PagedKVCache(n_blocks, bs, Hkv, D)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g)); pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    prefix = torch.randint(0, 1000, (max(lengths),), generator=g).tolist()
    for i, L in enumerate(lengths):
        own = torch.randint(0, 1000, (L,), generator=g).tolist()
        manager.allocate(i, prefix[:shared] + own[shared:L] if shared and i >= len(lengths) - 2 else own)
    B = len(lengths)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, 1, D, generator=g), torch.randn(B, Hkv, 1, D, generator=g)
    return manager, pool, q, k, v


def dense(manager, pool, q):
    """Each row's attention over its gathered keys (which include the key just written): (B, H, 1, D)."""
    rows = []
    for b in range(q.shape[0]):
        keys, values = gather_reference(pool, manager.block_table(b), manager.num_tokens(b))  # (Hkv, L, D)
        rows.append(F.scaled_dot_product_attention(q[b:b + 1], keys[None], values[None], enable_gqa=True))
    return torch.cat(rows)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16), (8, 8, 32), (14, 2, 64)], ids=str)
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("lengths", [[1], [300], [1, 15, 16, 17, 48], [37, 5, 130, 130]], ids=str)
def test_block_table_view_equals_dense_attention(heads, bs, lengths):
    manager, pool, q, k, v = random_batch(*heads, bs, lengths, seed=bs + len(lengths), shared=5 if len(lengths) > 3 else 0)
    out = BlockTableView(pool, decode_layout(manager, list(range(len(lengths))), pool.k.shape[0])).attend(q, k, v)
    assert out.shape == q.shape
    torch.testing.assert_close(out, dense(manager, pool, q))


def test_blocks_shared_by_rows_are_read_by_each():
    manager, pool, q, k, v = random_batch(9, 3, 64, 4, [9, 40, 41, 43], shared=33)
    assert set(manager.block_table(2)[:8]) == set(manager.block_table(3)[:8])  # 8 full blocks held once
    out = BlockTableView(pool, decode_layout(manager, [0, 1, 2, 3], pool.k.shape[0])).attend(q, k, v)
    torch.testing.assert_close(out, dense(manager, pool, q))


def test_slots_outside_a_rows_keys_do_not_count():
    """Blocks of no table hold NaN (a kernel that read them returns NaN); the unused end of each last
    block holds 1e4 (read with the block, so finite, but it must be masked out)."""
    manager, pool, q, k, v = random_batch(9, 3, 64, 16, [4, 39, 17])
    for s in range(3):
        manager.append(s, 1)  # the new token, whose key attend writes: lengths 5, 40, 18
    used = torch.zeros(pool.k.shape[0] * 16, dtype=torch.bool)
    for s in range(3):
        used[[manager.slot(s, p) for p in range(manager.num_tokens(s))]] = True
    tables = {b for s in range(3) for b in manager.block_table(s)}
    for block in range(pool.k.shape[0]):
        unused = ~used.view(-1, 16)[block]
        fill = 1e4 if block in tables else float("nan")
        pool.k[block][unused], pool.v[block][unused] = fill, fill
    out = BlockTableView(pool, decode_layout(manager, [0, 1, 2], pool.k.shape[0])).attend(q, k, v)
    assert not out.isnan().any()
    torch.testing.assert_close(out, dense(manager, pool, q))


@pytest.mark.parametrize("bug", ["one-slot-too-many", "full-blocks-skipped", "new-key-not-written"])
def test_planted_bugs_are_caught(bug):
    manager, pool, q, k, v = random_batch(9, 3, 64, 16, [20, 37, 51])
    layout = decode_layout(manager, [0, 1, 2], pool.k.shape[0])
    view = BlockTableView(pool, layout)
    if bug == "one-slot-too-many":
        layout.positions.add_(1)  # the mask_mod's query positions (a view of them): one slot past each row's end
    elif bug == "full-blocks-skipped":
        layout.block_mask.full_kv_num_blocks.zero_()
    else:
        view.write = lambda k, v: (pool.k.view(-1, 3, 64), pool.v.view(-1, 3, 64))
    out = view.attend(q, k, v)
    if bug == "new-key-not-written":
        BlockTableView.write(view, k, v)  # the reference must see the key written
    assert not torch.allclose(out, dense(manager, pool, q), atol=1e-3)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(embedded_gguf_path())  # decodes any id < 320: the tiny models have no tokenizer


def mixed(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 320, (int(k),), generator=g).tolist() for k in torch.randint(1, 70, (n,), generator=g)]
    return prompts, [int(k) for k in torch.randint(1, 40, (n,), generator=g)]


@pytest.mark.parametrize("num_blocks", [512, 20], ids=["roomy", "forced-preemption"])
@pytest.mark.parametrize("name", TINY)
def test_paged_engine_equals_one_at_a_time(name, tok, num_blocks):
    model = from_folder(DATA / name)
    prompts, limits = mixed(12, seed=len(name))
    engine = Engine(model, tok, num_blocks=num_blocks, attention="paged")
    out = engine.generate(prompts, max_new_tokens=limits, eos_token_ids=())
    want = [generate(model, tok, p, max_new_tokens=m, eos_token_ids=()).token_ids for p, m in zip(prompts, limits)]
    assert [r["token_ids"] for r in out] == want
    assert engine.manager.num_free_blocks == num_blocks
    assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 20)


class Row:  # what forward_batch reads of a sequence
    def __init__(self, i):
        self.id, self.lora = i, 0


def test_smollm2_decode_step_logits_equal_the_gather(smollm2):
    model, tokenizer = smollm2
    texts = ["The capital of France is", "Once upon a time, in a land far away, there lived a",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return", "1, 2, 3, 4, 5,"]
    manager = BlockManager(64, 16)
    cache = make_paged_cache(model.config, 65, 16)
    rows = [Row(i) for i in range(len(texts))]
    with torch.no_grad():
        for row, text in zip(rows, texts):  # prefill each alone, then one decode step for all, both ways
            ids = tokenizer.encode(text)
            manager.allocate(row.id, ids)
            forward_batch(model, cache, manager, [row], [ids], 64 * 16, "gather")
            manager.append(row.id, 13)
        gathered = forward_batch(model, cache, manager, rows, [[13]] * 4, 64 * 16, "gather")  # (B, V)
        paged = forward_batch(model, cache, manager, rows, [[13]] * 4, 64 * 16, "paged")
    assert (paged - gathered).abs().max().item() < 1e-4
    assert paged.argmax(-1).tolist() == gathered.argmax(-1).tolist()


def test_smollm2_engine_greedy_tokens_equal_the_gather(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(t) for t in ["Hello, my name is", "Write a haiku about rain.", "2 + 2 ="]]
    answers = {a: [r["token_ids"] for r in Engine(model, tokenizer, num_blocks=64, attention=a)
                   .generate(prompts, max_new_tokens=24, eos_token_ids=())] for a in ("gather", "paged")}
    assert answers["paged"] == answers["gather"]
    assert all(len(t) == 24 for t in answers["paged"])


def test_auto_reads_in_place_only_from_the_threshold(tok, monkeypatch):
    model = from_folder(DATA / "tiny-qwen3")
    manager = BlockManager(32, 4)
    manager.allocate("a", list(range(30))); manager.allocate("b", list(range(20)))
    monkeypatch.setattr(engine_module, "PAGED_MIN_TOKENS", 51)
    assert not paged_step("auto", model, manager, ["a", "b"], 1)  # 50 tokens held
    manager.append("b", 7)
    assert paged_step("auto", model, manager, ["a", "b"], 1)      # 51
    assert not paged_step("auto", model, manager, ["a", "b"], 2)  # a prefill: always gathered
    assert not paged_step("gather", model, manager, ["a", "b"], 1)
    assert paged_step("paged", model, manager, ["a"], 1)


def test_a_bad_attention_choice_is_refused(tok):
    with pytest.raises(ValueError, match=r"attention must be one of \('auto', 'paged', 'gather'\), got 'flex'"):
        Engine(from_folder(DATA / "tiny-qwen3"), tok, num_blocks=16, attention="flex")


def test_where_the_kernel_fails_auto_gathers_and_paged_says_why(tok, monkeypatch):
    model = from_folder(DATA / "tiny-llama")
    monkeypatch.setattr(paged_attention, "_probed", {})
    monkeypatch.setattr(paged_attention, "_probe", lambda *a: "CppCompileError: no compiler")
    with pytest.raises(RuntimeError, match="attention='paged': FlexAttention does not run here.*no compiler"):
        Engine(model, tok, num_blocks=16, attention="paged")
    monkeypatch.setattr(engine_module, "PAGED_MIN_TOKENS", 1)  # every decode step would read in place
    engine = Engine(model, tok, num_blocks=64)
    prompts, limits = mixed(3, seed=3)
    with pytest.warns(UserWarning, match="paged attention does not run here .*no compiler.*gathers blocks instead"):
        out = engine.generate(prompts, max_new_tokens=limits, eos_token_ids=())
    assert [r["token_ids"] for r in out] == [generate(model, tok, p, max_new_tokens=m, eos_token_ids=()).token_ids
                                             for p, m in zip(prompts, limits)]


def test_the_probe_catches_a_kernel_that_is_wrong(monkeypatch):
    config = from_folder(DATA / "tiny-qwen3").config
    monkeypatch.setattr(paged_attention, "_probed", {})
    assert paged_attention._probe(config, torch.float32, torch.device("cpu")) is None
    real = BlockTableView.attend
    monkeypatch.setattr(BlockTableView, "attend", lambda self, q, k, v: real(self, q, k, v) * 1.01)
    assert "differs from the dense attention" in paged_attention._probe(config, torch.float32, torch.device("cpu"))
    assert use_paged_attention("gather", config, torch.float32, "cpu") is False


def test_shapes_the_compiler_fails_on_are_served_uncompiled_and_exact(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CppCompileError: planted")
    monkeypatch.setattr(paged_attention, "_flex_attention", broken)
    monkeypatch.setattr(paged_attention, "_failed", {})
    manager, pool, q, k, v = random_batch(9, 3, 64, 16, [20, 37, 51])
    out = BlockTableView(pool, decode_layout(manager, [0, 1, 2], pool.k.shape[0])).attend(q, k, v)
    torch.testing.assert_close(out, dense(manager, pool, q))
    shapes = (3, pool.k.shape[0] * 16, 9, 3, 64, torch.float32, "cpu")
    assert paged_attention._failed == {shapes: "RuntimeError: CppCompileError: planted"}
    config = from_folder(DATA / "tiny-qwen3").config  # the probe reports the compiler's error, not a fast path
    assert paged_attention._probe(config, torch.float32, torch.device("cpu")) == "RuntimeError: CppCompileError: planted"
