# Generated from notebooks/17_engine.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Packed (variable-length) batches: every new token of an engine step in one row, no padding.

Built in notebooks/17_engine.ipynb. Prompt chunks first, then one token per decoding sequence; only
attention keeps the sequences apart: each chunk causal over its own keys, the decode tokens through
the gathered (notebook 15) or paged (notebook 16) views. FlashAttention's varlen layout.

Shape legend: N packed tokens, H heads, Hkv kv heads, D head dim, Bd decoding sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minillm.model.attention import causal_mask, padding_mask
from minillm.cache.paged_attention import BlockTableView, DecodeLayout, decode_layout
from minillm.cache.paged import BatchLayout, BlockManager, PagedView, batch_layout


@dataclass
class Segment:
    """One prompt chunk in the packed row: columns start .. start + new - 1."""
    start: int                # its first column
    new: int                  # its new tokens
    cached: int               # keys before them, already in the pool
    keys: torch.Tensor | None  # (cached + new,) pool slots of all its keys; None: nothing cached
    allowed: torch.Tensor | None  # (new, cached + new) which keys each query sees; None: nothing cached


@dataclass
class PackedLayout:
    """Where each packed token goes, and how attention splits the row."""
    slots: torch.Tensor      # (N,) pool slot of each token's key and value
    positions: torch.Tensor  # (1, N) RoPE position of each token within its own sequence
    segments: list[Segment]  # the prompt chunks, in columns 0 .. P - 1
    prefill_tokens: int      # P: the decode tokens follow, one per sequence
    decode: BatchLayout | DecodeLayout | None  # the decode tokens' own layout (gathered or paged)
    decode_keys: torch.Tensor | None  # (Bd, 1, 1, S) True for a real key of a gathered decode row
    decode_tables: torch.Tensor | None  # (Bd, W) each decode row's pool blocks (0 past its last); tables_only
    decode_lengths: torch.Tensor | None  # (Bd,) each decode row's tokens, its new one counted; tables_only
    ends: torch.Tensor       # (rows,) the column of each sequence's last token: its logits are kept
    seq_ids: list            # (rows,) each row's sequence: the chunks', then the decode tokens'


def packed_layout(manager: BlockManager, chunks: list[tuple], decode_ids: list, pool_blocks: int, device=None,
                  paged: bool = False, tables_only: bool = False) -> PackedLayout:
    """chunks: (sequence id, cached, new) prompt chunks, each ending at token cached + new; decode_ids:
    sequences computing their last token; pool_blocks: the cache's blocks. paged: the decode tokens
    read the blocks in place (notebook 16's DecodeLayout), else they are gathered (a BatchLayout);
    tables_only: neither is built, for a model that reads the block tables itself (A4's one call)."""
    slots, positions, segments, ends = [], [], [], []
    for s, cached, new in chunks:
        table = [manager.slot(s, p) for p in range(cached + new)]  # every key's slot, cached then new
        keys, allowed = (torch.tensor(table, device=device), causal_mask(new, cached + new, cached, device)) if cached \
            else (None, None)  # query i sees keys 0 .. cached + i (notebook 02's rule); fresh: plain causal
        segments.append(Segment(len(slots), new, cached, keys, allowed))
        slots += table[cached:]
        positions += range(cached, cached + new)
        ends.append(len(slots) - 1)
    P, decode, decode_keys, tables, lengths = len(slots), None, None, [], []
    if decode_ids and not tables_only:
        decode = (decode_layout(manager, decode_ids, pool_blocks, device) if paged else
                  batch_layout(manager, decode_ids, 1, device=device))  # one new token each: no padding queries
        decode_keys = None if paged else padding_mask(decode.attention_mask)  # once, for every layer
    if decode_ids:
        lengths = [manager.num_tokens(s) for s in decode_ids]
        tables = [manager.block_table(s) for s in decode_ids] if tables_only else []  # read by A4's call only
        slots += [manager.slot(s, L - 1) for s, L in zip(decode_ids, lengths)]  # as in their own layout
        positions += [L - 1 for L in lengths]
        ends += range(P, P + len(decode_ids))
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    seq_ids = [s for s, _, _ in chunks] + list(decode_ids)
    width = max(map(len, tables), default=0)
    blocks = t([table + [0] * (width - len(table)) for table in tables]) if tables else None  # (Bd, W)
    return PackedLayout(t(slots), t([positions]), segments, P, decode, decode_keys, blocks,
                        t(lengths) if tables else None, t(ends), seq_ids)


class GatheredDecodeView(PagedView):
    """Decode tokens gathered as notebook 15's PagedView does, then SDPA over each row's real keys."""

    def __init__(self, cache, layout: BatchLayout, real_keys: torch.Tensor):
        super().__init__(cache, layout)
        self.real_keys = real_keys  # (Bd, 1, 1, S): the left padding masked

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (Bd, H, 1, D), k, v (Bd, Hkv, 1, D) -> (Bd, H, 1, D)."""
        keys, values = self.update(self.layout.start_pos, k, v)  # (Bd, Hkv, S, D): cached keys and the new one
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.real_keys, enable_gqa=True)


@dataclass
class DecodeRows:
    """A decode-only step as appendix A4's one C++ call per layer reads it: the layer's pools, each row's
    blocks and length (the fast int4 model's road; any other model attends through `attend`)."""
    k: torch.Tensor        # (blocks, bs, Hkv, D) the layer's keys
    v: torch.Tensor        # (blocks, bs, Hkv, D) its values
    tables: torch.Tensor   # (Bd, W) each decode row's blocks
    lengths: torch.Tensor  # (Bd,) each decode row's tokens, its new one counted


class PackedView:
    """What the model sees as `cache[i]` in a packed forward: `attend` splits the row by sequence."""

    def __init__(self, cache, layout: PackedLayout):
        self.cache, self.layout, decode = cache, layout, layout.decode
        only_decode = layout.decode_tables is not None and layout.prefill_tokens == 0
        self.decode_rows = DecodeRows(cache.k, cache.v, layout.decode_tables, layout.decode_lengths) if only_decode \
            else None
        if decode is None:
            self.decode = None
        elif isinstance(decode, DecodeLayout):
            self.decode = BlockTableView(cache, decode)
        else:
            self.decode = GatheredDecodeView(cache, decode, layout.decode_keys)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, D), k, v (1, Hkv, N, D) -> (1, H, N, D): each chunk causal over its own keys."""
        if self.layout.decode_tables is not None:  # packed_layout(tables_only=True): no view of the decode rows
            raise RuntimeError("PackedView: this step was laid out for a model that reads the block tables itself")
        blocks, bs, Hkv, D = self.cache.k.shape
        P, outs = self.layout.prefill_tokens, []
        k_pool = self.cache.k.view(blocks * bs, Hkv, D)  # (blocks, bs, Hkv, D) -> one row per slot
        v_pool = self.cache.v.view(blocks * bs, Hkv, D)
        k_pool[self.layout.slots[:P]] = k[0, :, :P].transpose(0, 1)  # (Hkv, P, D) -> (P, Hkv, D)
        v_pool[self.layout.slots[:P]] = v[0, :, :P].transpose(0, 1)
        for seg in self.layout.segments:
            cols = slice(seg.start, seg.start + seg.new)
            if seg.keys is None:  # a fresh prompt: its own new keys, plainly causal (SDPA's fused kernel)
                outs.append(F.scaled_dot_product_attention(q[:, :, cols], k[:, :, cols], v[:, :, cols],
                                                           is_causal=True, enable_gqa=True))
            else:  # after cached keys: read them all from the pool, each query sees its own and earlier ones
                keys = k_pool[seg.keys].transpose(0, 1)[None]  # (S, Hkv, D) -> (1, Hkv, S, D), S = cached + new
                values = v_pool[seg.keys].transpose(0, 1)[None]
                outs.append(F.scaled_dot_product_attention(q[:, :, cols], keys, values, attn_mask=seg.allowed,
                                                           enable_gqa=True))
        if self.decode is not None:  # one token per row: (1, heads, Bd, D) -> (Bd, heads, 1, D) and back
            rows = lambda x: x[0, :, P:, None].transpose(0, 1)
            outs.append(self.decode.attend(rows(q), rows(k), rows(v)).transpose(0, 2))  # (1, H, Bd, D)
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (1, H, N, D)


def packed_views(cache: list, layout: PackedLayout) -> list:
    """Each layer's view of a packed forward: a PackedView of its KV blocks, unless its cache entry
    makes its own (`packed_view`: a recurrent state's, as Qwen3.5's DeltaNet layers have)."""
    return [c.packed_view(layout) if hasattr(c, "packed_view") else PackedView(c, layout) for c in cache]


def kv_pool_blocks(cache: list) -> int:
    """The blocks of the layers' KV pools (every attention layer's alike), the sink included."""
    return next(c.k.shape[0] for c in cache if hasattr(c, "k"))
