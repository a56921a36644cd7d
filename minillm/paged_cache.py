# Generated from notebooks/11_paged_cache.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The paged KV cache: keys and values in fixed-size blocks, shared between sequences by prefix.

Built in notebooks/11_paged_cache.ipynb, after vLLM's PagedAttention (Kwon et al., "Efficient
Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023,
https://arxiv.org/abs/2309.06180) and nano-vllm's block manager
(https://github.com/GeeeekExplorer/nano-vllm, engine/block_manager.py), in plain PyTorch.

Each layer keeps a pool of blocks, k and v of shape (num_blocks, block_size, Hkv, D)
(`PagedKVCache`). A pure-Python `BlockManager` hands blocks to sequences: a free list,
reference counts, a block table per sequence, prefix caching by a chained hash of each full
block's tokens, copy-on-write for a shared block that must change. Token `p` of a sequence
lives in slot `table[p // block_size] * block_size + p % block_size` of the flattened pool.
`batch_layout` turns the block tables of a batch into index tensors, and `PagedView` is what the
model sees as `cache[i]`: it writes the new keys/values into their slots and gathers each
sequence's keys/values into a dense, right-aligned (B, Hkv, S, D) batch.

Shape legend: B batch, T new tokens, S keys, Hkv kv heads, D head dim, N blocks, bs block size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


class BlockManager:
    """Which blocks of the pool each sequence owns: free list, reference counts, block tables.

    Prefix caching (when enabled): a full block is keyed by `hash((parent_hash, tokens))`, the
    hash of its tokens chained with the hash of every block before it, so equal keys mean equal
    prefixes and therefore equal keys/values. `allocate` reuses the longest cached chain of the
    prompt's full blocks. A freed block whose hash is known stays findable until the free list
    hands it out again (freed blocks go to the back of the list, new ones come from the front,
    so the most recently freed are reused last). Counters: `queries` counts the full prompt
    blocks looked up by `allocate`, `hits` those found; `hits / queries` is the hit rate.

    Blocks are accounted before they are computed. A block filled by decoding becomes findable
    only when the sequence appends past it (its last token has been through a forward by then).
    A prompt's full blocks are findable as soon as `allocate` returns, so its prefill must run
    before, or in the same batch as, the forward of a later sequence that reuses them (in one
    batched forward every layer writes all new keys before it gathers). A hit is confirmed by
    the block's own tokens; the parent chain is trusted to the hash.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager: num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_list: deque[int] = deque(range(num_blocks))   # blocks nobody uses
        self.ref_count = [0] * num_blocks                        # users of each block
        self.block_hash: list[int | None] = [None] * num_blocks  # chained hash of a full block
        self.block_tokens: list[tuple | None] = [None] * num_blocks  # its tokens, to confirm a hit
        self.cached: dict[int, int] = {}                         # hash -> block holding those keys/values
        self.tables: dict[object, list[int]] = {}               # seq_id -> block table
        self.tokens: dict[object, list[int]] = {}               # seq_id -> token ids accounted
        self.copies: list[tuple[int, int]] = []                  # pending copy-on-write (src, dst)
        self.hits = self.queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # -- prefix cache --------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent: int | None, tokens) -> int:
        """The key of a full block: its tokens and (through `parent`) everything before them."""
        return hash((parent, tuple(tokens)))

    def prefix_hits(self, token_ids: list[int]) -> list[int]:
        """The cached blocks that hold the longest chain of the prompt's leading full blocks."""
        found, parent, bs = [], None, self.block_size
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

    def _register(self, block: int, parent: int | None, tokens) -> None:
        """Record a full block's chained hash (and make it findable, if no block holds it yet)."""
        self.block_hash[block] = self.chain_hash(parent, tokens)
        self.block_tokens[block] = tuple(tokens)
        if self.enable_prefix_caching:
            self.cached.setdefault(self.block_hash[block], block)

    def _take_free(self) -> int:
        """A block from the front of the free list; it forgets the prefix it held."""
        block = self.free_list.popleft()
        h = self.block_hash[block]
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.block_hash[block] = self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block

    def _share(self, block: int) -> int:
        if self.ref_count[block] == 0:  # cached but unused: take it back from the free list
            self.free_list.remove(block)
        self.ref_count[block] += 1
        return block

    # -- sequences -----------------------------------------------------------------------------
    def _need(self, token_ids: list[int]) -> tuple[list[int], int]:
        """(cached blocks to reuse, free blocks the prompt takes from the free list)."""
        hits = self.prefix_hits(token_ids)
        fully_cached = len(hits) * self.block_size == len(token_ids)
        need = self.blocks_needed(len(token_ids)) - len(hits) + int(fully_cached)  # +1: copy of the last
        need += sum(self.ref_count[b] == 0 for b in hits)  # idle cached blocks come off the free list
        return hits, need

    def can_allocate(self, token_ids: list[int]) -> bool:
        """Are there enough free blocks for this prompt, counting prefix-cache hits?"""
        return self._need(token_ids)[1] <= self.num_free_blocks

    def allocate(self, seq_id, token_ids: list[int]) -> int:
        """Give the prompt a block table; return how many leading tokens are already cached.

        The count is a multiple of block_size, except when every block of the prompt is cached:
        then the last token is recomputed (its logits are needed), so the count is len - 1 and the
        last block is copied on write (see `take_copies`).
        """
        if seq_id in self.tables:
            raise ValueError(f"allocate: seq_id {seq_id!r} already has blocks")
        if len(token_ids) == 0:
            raise ValueError("allocate: token_ids is empty, a prompt needs at least one token")
        hits, need = self._need(token_ids)
        if need > self.num_free_blocks:
            raise ValueError(f"allocate: seq_id {seq_id!r} needs {need} free blocks, only {self.num_free_blocks} are free")
        bs, n_full = self.block_size, len(token_ids) // self.block_size
        self.queries += n_full if self.enable_prefix_caching else 0
        self.hits += len(hits)
        table = [self._share(b) for b in hits]
        parent = self.block_hash[table[-1]] if table else None
        for i in range(len(hits), self.blocks_needed(len(token_ids))):
            table.append(self._take_free())
            if i < n_full:  # a full block: findable by later prompts
                self._register(table[-1], parent, token_ids[i * bs : (i + 1) * bs])
                parent = self.block_hash[table[-1]]
        self.tables[seq_id], self.tokens[seq_id] = table, list(token_ids)
        cached = len(hits) * bs
        if cached == len(token_ids):  # all cached: recompute the last token in a private copy
            self._copy_on_write(seq_id)
            cached -= 1
        return cached

    def _copy_on_write(self, seq_id) -> None:
        """Replace the sequence's (shared) last block by a private copy, recorded in `copies`."""
        table = self.tables[seq_id]
        src = table[-1]
        dst = self._take_free()
        self.block_hash[dst], self.block_tokens[dst] = self.block_hash[src], self.block_tokens[src]  # same contents
        self.ref_count[src] -= 1
        if self.ref_count[src] == 0:  # an idle cached block: back to the free list, still findable
            self.free_list.append(src)
        table[-1] = dst
        self.copies.append((src, dst))

    def fork(self, seq_id, new_seq_id) -> None:
        """A new sequence sharing every block of `seq_id` (parallel sampling, beam search)."""
        self._check(seq_id)
        if new_seq_id in self.tables:
            raise ValueError(f"fork: seq_id {new_seq_id!r} already has blocks")
        self.tables[new_seq_id] = [self._share(b) for b in self.tables[seq_id]]
        self.tokens[new_seq_id] = list(self.tokens[seq_id])

    def can_append(self, seq_id) -> bool:
        """Is there room for one more token (a free block if the last one is full or shared)?"""
        self._check(seq_id)
        n, last = len(self.tokens[seq_id]), self.tables[seq_id][-1]
        return n % self.block_size != 0 and self.ref_count[last] == 1 or self.num_free_blocks > 0

    def append(self, seq_id, token_id: int) -> None:
        """Account one more token: a new block when the last is full, a copy when it is shared."""
        if not self.can_append(seq_id):
            raise ValueError(f"append: seq_id {seq_id!r} needs 1 free block, 0 are free")
        table, tokens, bs = self.tables[seq_id], self.tokens[seq_id], self.block_size
        if len(tokens) % bs == 0:  # the last block is full
            if self.block_hash[table[-1]] is None:  # filled by decoding, all of it computed by now
                parent = self.block_hash[table[-2]] if len(table) > 1 else None
                self._register(table[-1], parent, tokens[-bs:])
            table.append(self._take_free())
        elif self.ref_count[table[-1]] > 1:
            self._copy_on_write(seq_id)
        tokens.append(int(token_id))

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending (src, dst) block copies from copy-on-write; apply them to every layer before the next forward."""
        copies, self.copies = self.copies, []
        return copies

    def free(self, seq_id) -> None:
        """Release the sequence's blocks; those with no user left go to the back of the free list."""
        self._check(seq_id)
        for block in reversed(self.tables.pop(seq_id)):  # last blocks first: the prefix is reused last
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} freed twice"
            if self.ref_count[block] == 0:
                self.free_list.append(block)
        del self.tokens[seq_id]

    def _check(self, seq_id) -> None:
        if seq_id not in self.tables:
            raise ValueError(f"unknown seq_id {seq_id!r}: allocate it first (known: {list(self.tables)})")

    def block_table(self, seq_id) -> list[int]:
        self._check(seq_id)
        return list(self.tables[seq_id])

    def num_tokens(self, seq_id) -> int:
        self._check(seq_id)
        return len(self.tokens[seq_id])

    def slot(self, seq_id, position: int) -> int:
        """Where token `position` of the sequence lives in the flattened pool: block * block_size + offset."""
        n = self.num_tokens(seq_id)
        if not 0 <= position < n:
            raise ValueError(f"slot: position must be in [0, {n}) for seq_id {seq_id!r}, got {position}")
        return self.tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size


class PagedKVCache:
    """One layer's pool of blocks: k and v of shape (num_blocks, block_size, Hkv, D)."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if min(shape) < 1:
            raise ValueError(f"PagedKVCache: every size must be >= 1, got (N, bs, Hkv, D) = {shape}")
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
    return [PagedKVCache(num_blocks, block_size, config.num_key_value_heads, config.head_dim, dtype, device)
            for _ in range(config.num_hidden_layers)]


def gather_reference(cache: PagedKVCache, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `length` keys and values, (Hkv, length, D) each, block by block."""
    bs = cache.k.shape[1]
    if not 0 < length <= len(block_table) * bs:
        raise ValueError(f"gather_reference: length must be in [1, {len(block_table) * bs}] "
                         f"for {len(block_table)} blocks of {bs}, got {length}")
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
                 device: str | torch.device | None = None) -> BatchLayout:
    """Layout of a batch where row b computes its last new_tokens[b] accounted tokens (an int: the same for all).

    Keys: S = C + T columns, C = max cached count, T = max new count. Row b's cached keys are
    right-aligned in the first C columns and its new tokens in the last T; the gaps are padding,
    masked as keys. With the same count for every row (a decode step) there are no gaps in the new
    part: each row is simply right-aligned in S = max L_b columns. A row with fewer new tokens than
    T (a batched prefill, notebook 12) has padding queries, whose keys/values go to `sink_slot`.
    """
    lengths = [manager.num_tokens(s) for s in seq_ids]
    new = [new_tokens] * len(seq_ids) if isinstance(new_tokens, int) else list(new_tokens)
    if not seq_ids or len(new) != len(seq_ids) or not all(1 <= n <= L for n, L in zip(new, lengths)):
        raise ValueError(f"batch_layout: need 1 <= new tokens <= length for each sequence, "
                         f"got new_tokens {new_tokens}, lengths {lengths}")
    if len(set(new)) > 1 and sink_slot is None:
        raise ValueError(f"batch_layout: rows with different new-token counts {new} need a sink_slot "
                         "for their padding queries")
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

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, Hkv, T, D) at layout.slots; return all keys/values (B, Hkv, S, D)."""
        layout = self.layout
        N, bs, Hkv, D = self.cache.k.shape
        B, T = layout.slots.shape
        if pos != layout.start_pos or k.shape != (B, Hkv, T, D) or v.shape != k.shape:
            raise ValueError(f"PagedView.update: expected pos {layout.start_pos} and k, v (B, Hkv, T, D) = "
                             f"{(B, Hkv, T, D)}, got pos {pos}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        k_pool = self.cache.k.view(N * bs, Hkv, D)  # (N, bs, Hkv, D) -> (N*bs, Hkv, D): one row per slot
        v_pool = self.cache.v.view(N * bs, Hkv, D)
        flat = layout.slots.flatten()                # (B*T,)
        k_pool[flat] = k.transpose(1, 2).reshape(B * T, Hkv, D)  # (B, Hkv, T, D) -> (B*T, Hkv, D)
        v_pool[flat] = v.transpose(1, 2).reshape(B * T, Hkv, D)
        k_all = k_pool[layout.gather].transpose(1, 2)  # (B, S, Hkv, D) -> (B, Hkv, S, D)
        v_all = v_pool[layout.gather].transpose(1, 2)
        return k_all, v_all


def paged_forward(model, cache: list[PagedKVCache], manager: BlockManager, seq_ids: list,
                  input_ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) for input_ids (B, T): the last T accounted tokens of each sequence."""
    if len(cache) != model.config.num_hidden_layers:
        raise ValueError(f"paged_forward: cache has {len(cache)} layers, the model {model.config.num_hidden_layers}")
    if input_ids.dim() != 2 or input_ids.shape[0] != len(seq_ids):
        raise ValueError(f"paged_forward: input_ids must be (B, T) with B = len(seq_ids) = {len(seq_ids)}, "
                         f"got {tuple(input_ids.shape)}")
    layout = batch_layout(manager, seq_ids, input_ids.shape[1], device=input_ids.device)
    views = [PagedView(c, layout) for c in cache]
    return model(input_ids, positions=layout.positions, attention_mask=layout.attention_mask,
                 cache=views, start_pos=layout.start_pos)
