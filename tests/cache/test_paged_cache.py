"""The paged KV cache equals the dense one; the BlockManager's bookkeeping holds under random use."""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from safetensors.torch import load_file

from support import DATA, TINY
from minillm.cache.dense import make_cache
from minillm.model.decoder import from_folder
from minillm.cache.paged import (
    BatchLayout,
    BlockManager,
    PagedKVCache,
    PagedView,
    batch_layout,
    gather_reference,
    make_paged_cache,
    paged_forward,
)
from support import assert_logits_close


def dense_logits(model, ids, tokens):
    """Dense cache (notebook 08): prefill, then the generated tokens teacher-forced; (n, V)."""
    cache = make_cache(model.config, 1, len(ids) + len(tokens))
    with torch.no_grad():
        first = model(ids[None], cache=cache)[0, -1:]
        rest = model(torch.tensor([tokens[:-1]]), cache=cache, start_pos=len(ids))[0]
    return torch.cat([first, rest])


def paged_greedy(model, prompts, n, num_blocks=48, block_size=16):
    """Prefill each prompt alone, then decode all together; tokens and logits (n, V) per prompt."""
    manager = BlockManager(num_blocks, block_size)
    cache = make_paged_cache(model.config, num_blocks, block_size)
    tokens, steps = {}, {}
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            cached = manager.allocate(i, ids.tolist())
            logits = paged_forward(model, cache, manager, [i], ids[None, cached:])[0, -1]
            tokens[i], steps[i] = [int(logits.argmax())], [logits]
        for _ in range(n - 1):
            for i in tokens:
                manager.append(i, tokens[i][-1])
            last = torch.tensor([[t[-1]] for t in tokens.values()])
            logits = paged_forward(model, cache, manager, list(tokens), last)[:, -1]
            for b, i in enumerate(tokens):
                steps[i].append(logits[b])
                tokens[i].append(int(logits[b].argmax()))
    return tokens, {i: torch.stack(s) for i, s in steps.items()}


@pytest.fixture(scope="module")
def qwen3():
    return from_folder(DATA / "tiny-qwen3")


@pytest.mark.parametrize("name", TINY)
def test_paged_batched_decode_equals_dense(name):
    model = from_folder(DATA / name)
    ref = load_file(DATA / name / "reference.safetensors")
    prompts = [ref[f"input_ids_{i}"] for i in range(3)]  # 1, 9 and 80 tokens: rows of different lengths
    tokens, steps = paged_greedy(model, prompts, 32)
    for i, ids in enumerate(prompts):
        want = dense_logits(model, ids, tokens[i])
        assert want.argmax(-1).tolist() == tokens[i]
        assert_logits_close(steps[i], want)


def test_smollm2_paged_equals_dense(smollm2):
    model = smollm2[0]
    ref = load_file(DATA / "smollm2" / "reference.safetensors")
    ids, n = ref["prompt_ids_1"], 16
    tokens, steps = paged_greedy(model, [ids], n)
    assert_logits_close(steps[0], dense_logits(model, ids, tokens[0]))


def test_planted_slot_bug_is_caught(qwen3):
    """Keys read one slot too far (offset + 1, a classic off-by-one): the logits must differ."""
    ids = load_file(DATA / "tiny-qwen3" / "reference.safetensors")["input_ids_2"]
    manager, cache = BlockManager(16), make_paged_cache(qwen3.config, 16)
    manager.allocate("s", ids.tolist())
    layout = batch_layout(manager, ["s"], len(ids))
    bad = BatchLayout(layout.slots, layout.gather + 1, layout.attention_mask, layout.positions, layout.start_pos)
    with torch.no_grad():
        logits = qwen3(ids[None], positions=bad.positions, attention_mask=bad.attention_mask,
                       cache=[PagedView(c, bad) for c in cache], start_pos=bad.start_pos)[0]
        want = qwen3(ids[None])[0]
    with pytest.raises(AssertionError):
        assert_logits_close(logits, want)


def test_gather_reference_equals_batched_gather():
    g = torch.Generator().manual_seed(0)
    manager, pool = BlockManager(40, 16), PagedKVCache(40, 16, 2, 8)
    lengths = [5, 16, 33, 70, 1, 17]
    for i, n in enumerate(lengths):
        manager.allocate(i, torch.randint(0, 50, (n,), generator=g).tolist())
    layout = batch_layout(manager, list(range(len(lengths))), new_tokens=1)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    k_new, v_new = torch.randn(len(lengths), 2, 1, 8, generator=g), torch.randn(len(lengths), 2, 1, 8, generator=g)
    k_all, v_all = PagedView(pool, layout).update(layout.start_pos, k_new, v_new)  # (B, Hkv, S, D)
    S = max(lengths)
    assert k_all.shape == (len(lengths), 2, S, 8) and layout.start_pos == S - 1
    for b, n in enumerate(lengths):
        k_ref, v_ref = gather_reference(pool, manager.block_table(b), n)  # (Hkv, n, D)
        torch.testing.assert_close(k_all[b, :, S - n:], k_ref, atol=0, rtol=0)
        torch.testing.assert_close(v_all[b, :, S - n:], v_ref, atol=0, rtol=0)
        torch.testing.assert_close(k_ref[:, -1:], k_new[b], atol=0, rtol=0)  # the new token landed in its slot
        assert layout.attention_mask[b].tolist() == [0] * (S - n) + [1] * n
        assert layout.positions[b].tolist() == [n - 1]


def test_prefix_cache_reuses_two_blocks(qwen3):
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 320, (32,), generator=g).tolist()
    a = prefix + torch.randint(0, 320, (7,), generator=g).tolist()
    b = prefix + torch.randint(0, 320, (12,), generator=g).tolist()
    manager, cache = BlockManager(16), make_paged_cache(qwen3.config, 16)
    with torch.no_grad():
        assert manager.allocate("a", a) == 0
        paged_forward(qwen3, cache, manager, ["a"], torch.tensor([a]))
        cached = manager.allocate("b", b)
        assert cached == 32 and manager.hits == 2 and manager.queries == 4
        assert manager.block_table("b")[:2] == manager.block_table("a")[:2]
        logits = paged_forward(qwen3, cache, manager, ["b"], torch.tensor([b[cached:]]))[0]
        scratch = qwen3(torch.tensor([b]))[0, cached:]
    assert_logits_close(logits, scratch)


def test_fully_cached_prompt_recomputes_last_token_with_copy_on_write(qwen3):
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 320, (40,), generator=g).tolist()
    manager, cache = BlockManager(16), make_paged_cache(qwen3.config, 16)
    with torch.no_grad():
        manager.allocate("a", a)
        paged_forward(qwen3, cache, manager, ["a"], torch.tensor([a]))
        before = [c.k.clone() for c in cache]
        cached = manager.allocate("b", a[:32])  # exactly 2 full blocks, both cached
        copies = manager.take_copies()
        assert cached == 31 and copies == [(manager.block_table("a")[1], manager.block_table("b")[1])]
        assert manager.take_copies() == []  # cleared on read
        for c in cache:
            c.copy_blocks(copies)
        logits = paged_forward(qwen3, cache, manager, ["b"], torch.tensor([a[31:32]]))[0, -1]
        scratch = qwen3(torch.tensor([a[:32]]))[0, -1]
    assert_logits_close(logits, scratch)
    for c, k in zip(cache, before):  # a's blocks were not touched
        for blk in manager.block_table("a"):
            torch.testing.assert_close(c.k[blk], k[blk], atol=0, rtol=0)


def test_fork_then_diverge_copies_on_write(qwen3):
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 320, (21,), generator=g).tolist()
    manager, cache = BlockManager(16), make_paged_cache(qwen3.config, 16)
    with torch.no_grad():
        manager.allocate("a", a)
        paged_forward(qwen3, cache, manager, ["a"], torch.tensor([a]))
        manager.fork("a", "b")  # b shares all of a's blocks, the partial last one too
        last = manager.block_table("a")[-1]
        manager.append("a", 5)  # the slot to write is in a shared block: a gets a copy
        manager.append("b", 6)  # now b is the block's only user: no copy
        copies = manager.take_copies()
        assert copies == [(last, manager.block_table("a")[-1])] and manager.block_table("b")[-1] == last
        for c in cache:
            c.copy_blocks(copies)
        logits = paged_forward(qwen3, cache, manager, ["a", "b"], torch.tensor([[5], [6]]))[:, -1]
        want = torch.stack([qwen3(torch.tensor([a + [t]]))[0, -1] for t in (5, 6)])
    assert_logits_close(logits, want)


def test_free_returns_blocks_and_keeps_prefix_findable():
    m = BlockManager(6, 4)
    m.allocate("a", list(range(10)))
    assert m.num_free_blocks == 3
    m.free("a")
    assert m.num_free_blocks == 6
    assert m.allocate("b", list(range(9))) == 8  # the freed full blocks are still in the prefix cache
    m.free("b")
    for i in range(3):  # reuse every block: the old prefix is evicted
        m.allocate(i, [100 + i] * 8)
    for i in range(3):
        m.free(i)
    assert m.allocate("c", list(range(9))) == 0


def test_decoded_block_is_findable_once_the_sequence_moves_past_it():
    m = BlockManager(8, 4)
    m.allocate("a", [1, 2])
    m.append("a", 3)
    m.append("a", 4)  # the block is full, but token 4 has not been through a forward yet
    assert m.cached == {}
    m.append("a", 5)  # a moves on: the block's keys/values are all written
    assert list(m.cached.values()) == [m.block_table("a")[0]]
    assert m.allocate("c", [1, 2, 3, 4, 5]) == 4 and m.block_table("c")[0] == m.block_table("a")[0]


def test_errors():
    m = BlockManager(4, 16)
    m.allocate("a", list(range(40)))
    with pytest.raises(ValueError, match="needs 3 free blocks, only 1 are free"):
        m.allocate("b", list(range(100, 140)))
    assert not m.can_allocate(list(range(100, 140))) and m.can_allocate([1])
    with pytest.raises(ValueError, match="already has blocks"):
        m.allocate("a", [1])
    with pytest.raises(ValueError, match="empty"):
        m.allocate("c", [])
    with pytest.raises(ValueError, match="unknown seq_id 'zzz'"):
        m.append("zzz", 1)
    for call in (m.free, m.block_table, m.num_tokens, m.can_append):
        with pytest.raises(ValueError, match="unknown seq_id 'zzz'"):
            call("zzz")
    with pytest.raises(ValueError, match=r"position must be in \[0, 40\)"):
        m.slot("a", 40)
    m.free("a")
    with pytest.raises(ValueError, match="unknown seq_id 'a'"):  # no double free
        m.free("a")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    m.allocate("x", [1, 2, 3])
    with pytest.raises(ValueError, match=r"1 <= new tokens <= length .* got new_tokens 4, lengths \[3\]"):
        batch_layout(m, ["x"], 4)
    m.allocate("y", [4, 5, 6, 7])
    with pytest.raises(ValueError, match=r"different new-token counts \[1, 2\] need a sink_slot"):
        batch_layout(m, ["x", "y"], [1, 2])
    m.free("y")
    layout = batch_layout(m, ["x"], 1)
    with pytest.raises(ValueError, match=r"expected pos 2 and k, v \(B, Hkv, T, D\) = \(1, 2, 1, 8\)"):
        PagedView(PagedKVCache(4, 16, 2, 8), layout).update(2, torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))
    with pytest.raises(ValueError, match="length must be in"):
        gather_reference(PagedKVCache(4, 16, 2, 8), [0], 17)
    full = BlockManager(1, 4)
    full.allocate("a", [1, 2, 3, 4])
    assert not full.can_append("a")
    with pytest.raises(ValueError, match="needs 1 free block, 0 are free"):
        full.append("a", 5)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free, checked against a model of what every slot holds.

    `content[slot]` is the prefix of tokens whose key/value that slot holds (what a forward would
    write there). Every sequence must always read its own prefix at every position: shared blocks,
    the prefix cache and copy-on-write are all correct exactly when this holds.
    """

    BS = 4

    def __init__(self):
        super().__init__()
        self.m = BlockManager(10, self.BS)
        self.seqs: dict[int, list[int]] = {}
        self.content: dict[int, tuple] = {}
        self.next_id = 0

    def _apply_copies(self):
        for src, dst in self.m.take_copies():
            assert src != dst and self.m.ref_count[dst] >= 1
            for off in range(self.BS):
                if src * self.BS + off in self.content:
                    self.content[dst * self.BS + off] = self.content[src * self.BS + off]

    def _write(self, seq, start):
        """A forward computes positions start.. of seq: their slots must be exclusive to it."""
        tokens = self.seqs[seq]
        for p in range(start, len(tokens)):
            slot = self.m.slot(seq, p)
            assert self.m.ref_count[slot // self.BS] == 1, "writing into a shared block"
            self.content[slot] = tuple(tokens[: p + 1])

    @rule(data=st.data(), tail=st.lists(st.integers(0, 2), max_size=12))
    def allocate(self, data, tail):
        prefix = []
        if self.seqs and data.draw(st.booleans()):  # reuse the start of a live sequence: prefix hits
            other = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
            prefix = other[: data.draw(st.integers(0, len(other)))]
        tokens = prefix + tail or [0]
        seq, self.next_id = self.next_id, self.next_id + 1
        if not self.m.can_allocate(tokens):
            with pytest.raises(ValueError, match="free blocks"):
                self.m.allocate(seq, tokens)
            return
        cached = self.m.allocate(seq, tokens)
        assert 0 <= cached < len(tokens)
        assert cached % self.BS == 0 or cached == len(tokens) - 1 == len(tokens) // self.BS * self.BS - 1
        self.seqs[seq] = list(tokens)
        self._apply_copies()
        for p in range(cached):  # the cached part already holds this prefix
            assert self.content.get(self.m.slot(seq, p)) == tuple(tokens[: p + 1])
        self._write(seq, cached)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        if not self.m.can_append(seq):
            with pytest.raises(ValueError):
                self.m.append(seq, token)
            return
        self.m.append(seq, token)
        self.seqs[seq].append(token)
        self._apply_copies()
        self._write(seq, len(self.seqs[seq]) - 1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        new, self.next_id = self.next_id, self.next_id + 1
        self.m.fork(seq, new)
        self.seqs[new] = list(self.seqs[seq])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        others = [b for s in self.seqs if s != seq for b in self.m.block_table(s)]
        blocks = self.m.block_table(seq)
        self.m.free(seq)
        del self.seqs[seq]
        for b in blocks:  # a shared block is free only when its last user is gone
            assert (b in self.m.free_list) == (b not in others)
        with pytest.raises(ValueError):
            self.m.free(seq)

    @invariant()
    def bookkeeping(self):
        m = self.m
        used = {b for s in self.seqs for b in m.block_table(s)}
        assert len(set(m.free_list)) == len(m.free_list) == m.num_free_blocks  # no block freed twice
        assert m.num_free_blocks + len(used) == m.num_blocks
        assert not used & set(m.free_list)
        for b in range(m.num_blocks):
            assert m.ref_count[b] == sum(m.block_table(s).count(b) for s in self.seqs)
        for s, tokens in self.seqs.items():
            assert m.num_tokens(s) == len(tokens)
            assert len(m.block_table(s)) == m.blocks_needed(len(tokens))
            for p in range(len(tokens)):  # every sequence reads its own prefix everywhere
                assert self.content[m.slot(s, p)] == tuple(tokens[: p + 1])
        assert 0 <= m.hits <= m.queries

    def teardown(self):
        for s in list(self.seqs):
            self.m.free(s)
        assert self.m.num_free_blocks == self.m.num_blocks and sum(self.m.ref_count) == 0


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
TestBlockManager = BlockManagerMachine.TestCase
