# Generated from notebooks/15_block_manager.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The paged KV cache: keys and values in fixed-size blocks, shared between sequences by prefix.

Built in notebooks/15_block_manager.ipynb, after vLLM's PagedAttention (Kwon et al., SOSP 2023) and
the block manager of nano-vllm, in plain PyTorch. Each layer keeps a pool of blocks, k and v of shape
(num_blocks, block_size, Hkv, D) (`PagedKVCache`). The pure-Python `BlockManager` is built in three
stages, each class extending the one before: `BlockPool`/`BlockAllocator` (free list, reference
counts, block tables), `PrefixCache`/`PrefixCachingAllocator` (each full block named by a chained
hash of its tokens), `BlockManager` (copy-on-write). Token `p` of a sequence lives in slot
`table[p // block_size] * block_size + p % block_size` of the flattened pool. `batch_layout` and
`PagedView` give the model a dense, right-aligned copy of each sequence's keys and values per layer
per step; minillm/cache/paged_attention.py (notebook 16) reads the blocks where they lie instead.

Shape legend: B batch, T new tokens, S keys, Hkv kv heads, D head dim, N blocks, bs block size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from minillm.cache.paged_validation import (validate_allocate, validate_append, validate_fork, validate_forward, validate_gather,
                                            validate_known, validate_layout, validate_pool, validate_pool_shape, validate_position,
                                            validate_update)


class BlockPool:
    """The state of the pool: a free list, a reference count per block, a block table per sequence."""

    def __init__(self, num_blocks: int, block_size: int = 16):
        validate_pool(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_list: deque[int] = deque(range(num_blocks))  # blocks nobody uses
        self.ref_count = [0] * num_blocks                       # users of each block
        self.tables: dict[object, list[int]] = {}               # seq_id -> block table
        self.tokens: dict[object, list[int]] = {}               # seq_id -> token ids accounted

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> int:  # the block at the front of the free list, now used once
        block = self.free_list.popleft()
        self.ref_count[block] = 1
        return block

    def _share(self, block: int) -> int:  # one more user (an idle cached block leaves the free list)
        if self.ref_count[block] == 0:
            self.free_list.remove(block)
        self.ref_count[block] += 1
        return block

    def _release(self, block: int) -> None:  # one user fewer; unused, it joins the back of the free list
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"block {block} freed twice"
        if self.ref_count[block] == 0:
            self.free_list.append(block)

    def block_table(self, seq_id) -> list[int]:
        validate_known(self, seq_id)
        return list(self.tables[seq_id])

    def num_tokens(self, seq_id) -> int:
        validate_known(self, seq_id)
        return len(self.tokens[seq_id])

    def slot(self, seq_id, position: int) -> int:
        """Where token `position` of the sequence lives in the flattened pool: block * block_size + offset."""
        validate_position(self.num_tokens(seq_id), seq_id, position)
        return self.tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size


class BlockAllocator(BlockPool):
    """Stage 1: sequences take blocks as they grow and give them back when done; `fork` shares them."""

    def _need(self, token_ids: list[int], salt=None) -> tuple[list[int], int]:  # (cached blocks to reuse, free blocks to take)
        return [], self.blocks_needed(len(token_ids))

    def can_allocate(self, token_ids: list[int], salt=None) -> bool:
        """Are there enough free blocks for this prompt, counting prefix-cache hits? (salt: see stage 2)"""
        return self._need(token_ids, salt)[1] <= self.num_free_blocks

    def _fill(self, table: list[int], token_ids: list[int], salt=None) -> list[int]:  # free blocks until table holds token_ids
        while len(table) < self.blocks_needed(len(token_ids)):
            table.append(self._take_free())
        return table

    def allocate(self, seq_id, token_ids: list[int], salt=None) -> int:
        """Give the prompt a block table; return how many leading tokens are already cached."""
        hits, need = self._need(token_ids, salt)
        validate_allocate(self, seq_id, token_ids, need)
        self.tables[seq_id] = self._fill([self._share(b) for b in hits], token_ids, salt)
        self.tokens[seq_id] = list(token_ids)
        return len(hits) * self.block_size

    def can_append(self, seq_id) -> bool:
        """Is there room for one more token (a free block if the last one is full)?"""
        validate_known(self, seq_id)
        return len(self.tokens[seq_id]) % self.block_size != 0 or self.num_free_blocks > 0

    def append(self, seq_id, token_id: int) -> None:
        """Account one more token: a new block when the last one is full."""
        validate_append(self, seq_id)
        if len(self.tokens[seq_id]) % self.block_size == 0:
            self.tables[seq_id].append(self._take_free())
        self.tokens[seq_id].append(int(token_id))

    def free(self, seq_id) -> None:
        """Release the sequence's blocks, the last ones first (so a shared prefix is reused last)."""
        validate_known(self, seq_id)
        for block in reversed(self.tables.pop(seq_id)):
            self._release(block)
        del self.tokens[seq_id]

    def fork(self, seq_id, new_seq_id) -> None:
        """A new sequence sharing every block of `seq_id` (parallel sampling, beam search)."""
        validate_fork(self, seq_id, new_seq_id)
        self.tables[new_seq_id] = [self._share(b) for b in self.tables[seq_id]]
        self.tokens[new_seq_id] = list(self.tokens[seq_id])


class PrefixCache(BlockAllocator):
    """Stage 2a: each full block is named by a chained hash of its tokens, so a later prompt can find it."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_hash: list[int | None] = [None] * num_blocks      # chained hash of a full block
        self.block_tokens: list[tuple | None] = [None] * num_blocks  # its tokens, to confirm a hit
        self.cached: dict[int, int] = {}                             # hash -> block holding those keys/values
        self.hits = self.queries = 0                                 # full prompt blocks found / looked up
        self.salts: dict[object, object] = {}                        # seq_id -> its salt, when it has one

    @staticmethod
    def chain_hash(parent: int | None, tokens) -> int:
        """The key of a full block: its tokens and (through `parent`) everything before them."""
        return hash((parent, tuple(tokens)))

    def _register(self, block: int, parent: int | None, tokens) -> None:
        """Record a full block's chained hash (and make it findable, if no block holds it yet)."""
        self.block_hash[block] = self.chain_hash(parent, tokens)
        self.block_tokens[block] = tuple(tokens)
        if self.enable_prefix_caching:
            self.cached.setdefault(self.block_hash[block], block)

    def _forget(self, block: int) -> None:  # the block no longer names a prefix: nobody finds it
        h = self.block_hash[block]
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.block_hash[block] = self.block_tokens[block] = None

    def _take_free(self) -> int:  # as in stage 1, and the block forgets the prefix it held
        block = super()._take_free()
        self._forget(block)
        return block

    def _fill(self, table: list[int], token_ids: list[int], salt=None) -> list[int]:  # as in stage 1, registering full blocks
        bs, n_full = self.block_size, len(token_ids) // self.block_size
        parent = self.block_hash[table[-1]] if table else salt  # the salt heads the chain
        for i in range(len(table), self.blocks_needed(len(token_ids))):
            table.append(self._take_free())
            if i < n_full:  # a full block: findable by later prompts
                self._register(table[-1], parent, token_ids[i * bs : (i + 1) * bs])
                parent = self.block_hash[table[-1]]
        return table


class PrefixCachingAllocator(PrefixCache):
    """Stage 2b: a prompt reuses the longest chain of its leading full blocks found in the cache."""

    def prefix_hits(self, token_ids: list[int], salt=None) -> list[int]:
        """The cached blocks that hold the longest chain of the prompt's leading full blocks (after `salt`)."""
        found, parent, bs = [], salt, self.block_size
        if not self.enable_prefix_caching:
            return found
        for i in range(len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = self.chain_hash(parent, tokens)
            block = self.cached.get(parent)
            if block is None or self.block_tokens[block] != tokens:
                break
            found.append(block)
        return found

    def _need(self, token_ids: list[int], salt=None) -> tuple[list[int], int]:
        hits = self.prefix_hits(token_ids, salt)
        if hits and len(hits) * self.block_size == len(token_ids):
            hits = hits[:-1]  # its last token must be computed (for its logits): so, here, its whole block
        need = self.blocks_needed(len(token_ids)) - len(hits)
        return hits, need + sum(self.ref_count[b] == 0 for b in hits)  # idle cached blocks leave the free list

    def allocate(self, seq_id, token_ids: list[int], salt=None) -> int:
        cached = super().allocate(seq_id, token_ids, salt)
        self.salts[seq_id] = salt  # its blocks filled later by decoding are keyed under the same salt
        self.hits += cached // self.block_size  # counters: hits / queries is the hit rate
        self.queries += len(token_ids) // self.block_size if self.enable_prefix_caching else 0
        return cached

    def append(self, seq_id, token_id: int) -> None:
        """As stage 1; a block filled by decoding is registered when the sequence moves past it."""
        validate_append(self, seq_id)
        table, tokens, bs = self.tables[seq_id], self.tokens[seq_id], self.block_size
        if len(tokens) % bs == 0 and self.block_hash[table[-1]] is None:  # all of it computed by now
            self._register(table[-1], self.block_hash[table[-2]] if len(table) > 1 else self.salts.get(seq_id), tokens[-bs:])
        super().append(seq_id, token_id)

    def fork(self, seq_id, new_seq_id) -> None:  # as stage 1; the fork keeps its parent's salt
        super().fork(seq_id, new_seq_id)
        self.salts[new_seq_id] = self.salts.get(seq_id)

    def free(self, seq_id) -> None:  # as stage 1, forgetting the salt
        super().free(seq_id)
        self.salts.pop(seq_id, None)


class BlockManager(PrefixCachingAllocator):
    """Stage 3, what the engine uses: copy-on-write, a shared block that must change is copied first.

    A prompt's full blocks are findable once `allocate` returns: its prefill must run before, or in
    the same batch as, the forward of a later sequence that reuses them (or see `cache_computed`).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.copies: list[tuple[int, int]] = []  # pending copy-on-write (src, dst)

    def _need(self, token_ids: list[int], salt=None) -> tuple[list[int], int]:
        hits = self.prefix_hits(token_ids, salt)  # all of them, now: a fully cached prompt copies its last block
        fully_cached = len(hits) * self.block_size == len(token_ids)
        need = self.blocks_needed(len(token_ids)) - len(hits) + int(fully_cached)  # +1: the copy
        return hits, need + sum(self.ref_count[b] == 0 for b in hits)

    def allocate(self, seq_id, token_ids: list[int], salt=None) -> int:
        """As stage 2; a fully cached prompt gets a private copy of its last block and reports len - 1."""
        cached = super().allocate(seq_id, token_ids, salt)
        if cached == len(token_ids):  # recompute the last token (its logits are needed) in the copy
            self._copy_on_write(seq_id)
            cached -= 1
        return cached

    def _copy_on_write(self, seq_id) -> None:  # the sequence's last block -> a private copy, recorded
        src, dst = self.tables[seq_id][-1], self._take_free()
        self.block_hash[dst], self.block_tokens[dst] = self.block_hash[src], self.block_tokens[src]
        self._release(src)  # an idle cached block goes back to the free list, still findable
        self.tables[seq_id][-1] = dst
        self.copies.append((src, dst))

    def can_append(self, seq_id) -> bool:  # room for one more token: a free block if the last is full or shared
        validate_known(self, seq_id)
        n, last = len(self.tokens[seq_id]), self.tables[seq_id][-1]
        return n % self.block_size != 0 and self.ref_count[last] == 1 or self.num_free_blocks > 0

    def append(self, seq_id, token_id: int) -> None:
        """As stage 2; a token that would land in a shared block first gets the block copied."""
        validate_append(self, seq_id)
        if len(self.tokens[seq_id]) % self.block_size != 0 and self.ref_count[self.tables[seq_id][-1]] > 1:
            self._copy_on_write(seq_id)
        super().append(seq_id, token_id)

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending (src, dst) block copies; apply them to every layer before the next forward."""
        copies, self.copies = self.copies, []
        return copies


def cache_computed(manager: BlockManager, seq_id, num_computed: int) -> None:
    """Only the sequence's full blocks within its first num_computed tokens (whose keys and values
    exist) are findable: those are registered, the blocks past them forget their prefix."""
    validate_known(manager, seq_id)
    table, tokens, bs = manager.tables[seq_id], manager.tokens[seq_id], manager.block_size
    parent = manager.salts.get(seq_id)  # the salt heads the chain
    for i, block in enumerate(table):
        if (i + 1) * bs > min(num_computed, len(tokens)):
            manager._forget(block)  # not computed yet, or not full: only this sequence holds it
        elif manager.block_hash[block] is None:
            manager._register(block, parent, tokens[i * bs : (i + 1) * bs])
        parent = manager.block_hash[block]


class PagedKVCache:
    """One layer's pool of blocks: k and v of shape (num_blocks, block_size, Hkv, D)."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        validate_pool_shape(shape)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's keys and values, for each (src, dst)."""
        if pairs:
            src, dst = (torch.tensor(p, device=self.k.device) for p in zip(*pairs))
            self.k[dst] = self.k[src]  # (n, bs, Hkv, D)
            self.v[dst] = self.v[src]


def make_paged_cache(config, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                     device: str | torch.device | None = None) -> list[PagedKVCache]:
    """A PagedKVCache (pool of `num_blocks` blocks) for each of the model's layers."""
    if set(getattr(config, "layer_types", ["full_attention"])) != {"full_attention"}:  # Qwen3.5: notebook 22
        raise ValueError("a model with linear-attention layers (Qwen3.5) keeps a state per sequence beside its "
                         "KV blocks: its engine is minillm.runtime.hybrid_engine.HybridEngine (or HybridSpeculativeEngine)")
    return [PagedKVCache(num_blocks, block_size, config.num_key_value_heads, config.head_dim, dtype, device)
            for _ in range(config.num_hidden_layers)]


def gather_reference(cache: PagedKVCache, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `length` keys and values, (Hkv, length, D) each, block by block."""
    bs = cache.k.shape[1]
    validate_gather(len(block_table), bs, length)
    ks, vs = [], []
    for i, block in enumerate(block_table):
        n = min(bs, length - i * bs)  # tokens used in this block: bs, except in the last one
        if n <= 0:
            break
        ks.append(cache.k[block, :n])  # (n, Hkv, D)
        vs.append(cache.v[block, :n])
    return torch.cat(ks).transpose(0, 1), torch.cat(vs).transpose(0, 1)  # (length, Hkv, D) -> (Hkv, length, D)


@dataclass
class BatchLayout:
    """Index tensors for one batched forward over paged sequences (rows right-aligned)."""
    slots: torch.Tensor           # (B, T) pool slots where the T new tokens' keys/values go
    gather: torch.Tensor          # (B, S) pool slots of keys 0..S-1 of each row (0 under padding)
    attention_mask: torch.Tensor  # (B, S) 1 for a real key, 0 for left padding
    positions: torch.Tensor       # (B, T) RoPE positions of the new tokens
    start_pos: int                # S - T: keys before the new tokens, in the padded layout


def batch_layout(manager: BlockManager, seq_ids: list, new_tokens: int | list[int], sink_slot: int | None = None,
                 device: str | torch.device | None = None, lengths: list[int] | None = None) -> BatchLayout:
    """Layout of a batch where row b computes its last new_tokens[b] accounted tokens (an int: the same for all).

    lengths: where each row's new tokens end (default: all its accounted tokens; a prompt
    prefilled in chunks, notebook 17, stops earlier).

    Keys: S = C + T columns, C = max cached count, T = max new count. Row b's cached keys are
    right-aligned in the first C columns and its new tokens in the last T; the gaps are padding,
    masked as keys. A row with fewer new tokens than T (a batched prefill, notebook 17) has
    padding queries, whose keys/values go to `sink_slot`.
    """
    lengths = list(lengths) if lengths is not None else [manager.num_tokens(s) for s in seq_ids]
    new = [new_tokens] * len(seq_ids) if isinstance(new_tokens, int) else list(new_tokens)
    validate_layout(seq_ids, new_tokens, new, lengths, sink_slot)
    cached = [L - n for L, n in zip(lengths, new)]
    C, T = max(cached), max(new)
    slots, gather, mask, positions = [], [], [], []
    for s, L, c, n in zip(seq_ids, lengths, cached, new):
        row = [manager.slot(s, p) for p in range(L)]
        gather.append([0] * (C - c) + row[:c] + [0] * (T - n) + row[c:])
        mask.append([0] * (C - c) + [1] * c + [0] * (T - n) + [1] * n)
        slots.append([sink_slot] * (T - n) + row[c:])
        positions.append([0] * (T - n) + list(range(c, L)))
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return BatchLayout(t(slots), t(gather), t(mask), t(positions), C)


class PagedView:
    """What the model sees as `cache[i]`: writes new keys/values into their slots, gathers the batch."""

    def __init__(self, cache: PagedKVCache, layout: BatchLayout):
        self.cache, self.layout = cache, layout

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, Hkv, T, D) at layout.slots; return the pool's keys and values, (N*bs, Hkv, D) each."""
        N, bs, Hkv, D = self.cache.k.shape
        B, T = self.layout.slots.shape
        k_pool = self.cache.k.view(N * bs, Hkv, D)  # (N, bs, Hkv, D) -> (N*bs, Hkv, D): one row per slot
        v_pool = self.cache.v.view(N * bs, Hkv, D)
        flat = self.layout.slots.flatten()           # (B*T,)
        k_pool[flat] = k.transpose(1, 2).reshape(B * T, Hkv, D)  # (B, Hkv, T, D) -> (B*T, Hkv, D)
        v_pool[flat] = v.transpose(1, 2).reshape(B * T, Hkv, D)
        return k_pool, v_pool

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, Hkv, T, D) at layout.slots; return all keys/values (B, Hkv, S, D), a dense copy."""
        validate_update(self.layout, self.cache.k.shape, pos, k, v)
        k_pool, v_pool = self.write(k, v)
        k_all = k_pool[self.layout.gather].transpose(1, 2)  # (B, S, Hkv, D) -> (B, Hkv, S, D): the gather, a copy
        v_all = v_pool[self.layout.gather].transpose(1, 2)
        return k_all, v_all

def paged_forward(model, cache: list[PagedKVCache], manager: BlockManager, seq_ids: list,
                  input_ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) for input_ids (B, T): the last T accounted tokens of each sequence."""
    validate_forward(model, cache, seq_ids, input_ids)
    layout = batch_layout(manager, seq_ids, input_ids.shape[1], device=input_ids.device)
    views = [PagedView(c, layout) for c in cache]
    return model(input_ids, positions=layout.positions, attention_mask=layout.attention_mask,
                 cache=views, start_pos=layout.start_pos)
