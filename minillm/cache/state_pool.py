# Generated from notebooks/A6_hybrid_engine.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Qwen3.5's DeltaNet states in the engine: a slot per sequence, snapshots at block boundaries.

Built in notebooks/A6_hybrid_engine.ipynb on the engine (notebook 17) and the hybrid model (22).
Each DeltaNet layer keeps a `StatePool`: one row per running sequence (its slot), and rows of
saved states (snapshots) that prefix caching restores. `HybridStates` says which slot holds which
sequence; its `plan` tells a packed forward which slot each segment and decode row reads and
writes, and after which tokens to save a snapshot. `StateView` runs the conv and the delta rule
of a packed row per sequence, as `PackedView` runs attention. `SnapshotIndex` names each snapshot
by the chained hash of the block it ends (notebook 15), and `StateBlockManager` offers a prefix
hit only as far as a snapshot reaches.

Shape legend: S slots, M snapshots, C conv channels, K conv kernel, Hv value heads, Dk/Dv their
dims, N packed tokens, P prompt tokens among them, Bd decode rows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from minillm.cache.packed import PackedLayout
from minillm.cache.paged import BlockManager
from minillm.model.gated_delta import causal_conv1d, chunked_gated_delta_rule, recurrent_gated_delta_rule
from minillm.model.qwen3_5 import HybridConfig, LinearState


class StatePool:
    """One DeltaNet layer's states for the engine: a slot per sequence, conv (S, C, K-1) and
    recurrent (S, Hv, Dk, Dv) as LinearState's, and M snapshot rows of each (none until needed)."""

    def __init__(self, states: HybridStates, config: HybridConfig, slots: int, dtype, device):
        self.states = states  # the slot table and plan every DeltaNet layer of the model shares
        live, saved = LinearState(config, slots, dtype, device), LinearState(config, 0, dtype, device)
        self.conv, self.recurrent = live.conv, live.recurrent
        self.saved_conv, self.saved_recurrent = saved.conv, saved.recurrent

    def packed_view(self, layout: PackedLayout) -> StateView:
        return StateView(self, self.states.plan(layout))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write concerns KV blocks: a state belongs to its sequence, not to a block."""

    def grow(self, slots: int) -> None:
        """Room for `slots` sequences: the rows past the old ones start as zeros."""
        more = slots - self.conv.shape[0]
        self.conv = torch.cat([self.conv, self.conv.new_zeros(more, *self.conv.shape[1:])])
        self.recurrent = torch.cat([self.recurrent, self.recurrent.new_zeros(more, *self.recurrent.shape[1:])])

    def reserve(self, rows: int) -> None:
        """Room for `rows` snapshot rows, allocated when prefix caching first needs them (doubling, up to
        the engine's state_snapshots): an engine holds only the rows its prompts have used."""
        have = self.saved_conv.shape[0]
        if rows > have:
            size = min(max(rows, 2 * have), self.states.max_snapshots)
            self.saved_conv, self.saved_recurrent = (torch.cat([t, t.new_zeros(size - have, *t.shape[1:])])
                                                     for t in (self.saved_conv, self.saved_recurrent))

    def load(self, slot: int, row: int | None) -> None:
        """The slot starts from snapshot `row`, or from zeros (None: a prompt's start)."""
        if row is None:
            self.conv[slot], self.recurrent[slot] = 0, 0
        else:
            self.conv[slot], self.recurrent[slot] = self.saved_conv[row], self.saved_recurrent[row]

    def copy(self, src: int, dst: int) -> None:
        self.conv[dst], self.recurrent[dst] = self.conv[src], self.recurrent[src]


@dataclass
class StateSegment:
    """A prompt chunk of the packed row, for the DeltaNet: columns start .. start + sum of its pieces."""
    start: int  # its first column
    slot: int   # the slot it continues
    pieces: list[tuple[int, int, int | None]]  # (first, end) columns from start, then the snapshot row to save, or None


@dataclass
class StatePlan:
    """Which slot each part of a packed row continues: the prompt chunks, then one decode token per row."""
    segments: list[StateSegment]
    prefill_tokens: int               # P: the decode rows' tokens follow
    decode_slots: torch.Tensor | None  # (Bd,) each decode row's slot
    layout: PackedLayout              # the forward it was made for: every DeltaNet layer shares one plan


class ConvStateView:
    """A DeltaNet layer's cache in a packed forward, for its short conv: each prompt chunk continues its
    sequence's slot (saving snapshots on the way), and the decode rows continue theirs, all in one call."""

    def __init__(self, pool: StatePool, plan: StatePlan):
        self.pool, self.plan = pool, plan

    def convolve(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """causal_conv1d per sequence, from its slot's conv state: x (1, C, N) -> (1, C, N)."""
        pool, plan, outs = self.pool, self.plan, []
        for seg in plan.segments:
            state = pool.conv[seg.slot : seg.slot + 1]  # (1, C, K-1)
            for first, end, row in seg.pieces:
                out, state = causal_conv1d(x[:, :, seg.start + first : seg.start + end], weight, state)
                outs.append(out)
                if row is not None:
                    pool.saved_conv[row] = state[0]
            pool.conv[seg.slot] = state[0]
        if plan.decode_slots is not None:  # one token per row: (C, Bd) -> (Bd, C, 1) and back
            slots, P = plan.decode_slots, plan.prefill_tokens
            out, pool.conv[slots] = causal_conv1d(x[0, :, P:].t()[:, :, None], weight, pool.conv[slots])
            outs.append(out[:, :, 0].t()[None])  # (1, C, Bd)
        return torch.cat(outs, dim=2)


class StateView(ConvStateView):
    """ConvStateView, and the same for the gated delta rule: what `GatedDeltaNet` calls in a packed forward."""

    def delta_rule(self, q, k, v, g, beta) -> torch.Tensor:
        """The gated delta rule per sequence, from its slot's state: q, k (1, N, Hv, Dk), v (1, N, Hv, Dv),
        g, beta (1, N, Hv) -> out (1, N, Hv, Dv), float32."""
        pool, plan, outs = self.pool, self.plan, []
        for seg in plan.segments:
            state = pool.recurrent[seg.slot : seg.slot + 1]  # (1, Hv, Dk, Dv)
            for first, end, row in seg.pieces:
                cols = slice(seg.start + first, seg.start + end)
                rule = recurrent_gated_delta_rule if end - first == 1 else chunked_gated_delta_rule
                out, state = rule(q[:, cols], k[:, cols], v[:, cols], g[:, cols], beta[:, cols], state)
                outs.append(out)
                if row is not None:
                    pool.saved_recurrent[row] = state[0]
            pool.recurrent[seg.slot] = state[0]
        if plan.decode_slots is not None:  # one token per row: (Bd, 1, ...)
            slots, P = plan.decode_slots, plan.prefill_tokens
            rows = lambda x: x[0, P:, None]
            out, pool.recurrent[slots] = recurrent_gated_delta_rule(rows(q), rows(k), rows(v), rows(g), rows(beta),
                                                                    pool.recurrent[slots])
            outs.append(out[:, 0][None])  # (1, Bd, Hv, Dv)
        return torch.cat(outs, dim=1)


class HybridStates:
    """What the DeltaNet layers' pools share: which slot holds which sequence (and how many of its tokens),
    and the plan of the forward running now. `interval`: tokens between snapshots (None: none saved)."""

    def __init__(self, config: HybridConfig, manager: StateBlockManager, slots: int, snapshots: int,
                 interval: int | None, dtype=torch.float32, device=None):
        self.manager, self.interval, self.max_snapshots = manager, interval, snapshots
        self.pools = [StatePool(self, config, slots, dtype, device)
                      for kind in config.layer_types if kind == "linear_attention"]
        self.slot_of: dict = {}   # sequence id -> its slot
        self.tokens: dict = {}    # sequence id -> how many of its tokens its slot has absorbed
        self.free = list(range(slots - 1, -1, -1))  # slot 0 first
        self._plan: StatePlan | None = None

    def start(self, seq_id, num_computed: int) -> None:
        """A prefill begins (again, after a preemption) at num_computed: from zeros, or from the
        snapshot saved after its last cached block (a prefix hit, whole blocks only)."""
        if seq_id not in self.slot_of:
            self.slot_of[seq_id] = take_slot(self)
        row = None
        if num_computed:
            block = self.manager.tables[seq_id][num_computed // self.manager.block_size - 1]
            row = self.manager.snapshots.find(self.manager.block_hash[block])
        for pool in self.pools:
            pool.load(self.slot_of[seq_id], row)
        self.tokens[seq_id] = num_computed

    def fork(self, seq_id, new_seq_id) -> None:
        """Another choice of the same prompt (n > 1): its own slot, a copy of the prompt's states."""
        self.slot_of[new_seq_id] = take_slot(self)
        for pool in self.pools:
            pool.copy(self.slot_of[seq_id], self.slot_of[new_seq_id])
        self.tokens[new_seq_id] = self.tokens[seq_id]

    def keep(self, seq_ids: set) -> None:
        """Free the slots of every sequence not in seq_ids (finished, aborted or preempted)."""
        for seq_id in [s for s in self.slot_of if s not in seq_ids]:
            self.free.append(self.slot_of.pop(seq_id))
            del self.tokens[seq_id]

    def plan(self, layout: PackedLayout) -> StatePlan:
        """The plan of a packed forward: made by its first DeltaNet layer, shared by the others."""
        if self._plan is None or self._plan.layout is not layout:
            self._plan = make_plan(self, layout)
        return self._plan


def take_slot(states: HybridStates) -> int:
    """A free slot; with none left (n > 1 choices join after admission), every pool doubles its slots."""
    if not states.free:
        old = states.pools[0].conv.shape[0]
        for pool in states.pools:
            pool.grow(2 * old)
        states.free = list(range(2 * old - 1, old - 1, -1))
    return states.free.pop()


def make_plan(states: HybridStates, layout: PackedLayout) -> StatePlan:
    """Which slot each part of a packed forward continues, and where its prompt chunks save snapshots;
    the slots' counts move on by their new tokens (the forward is about to absorb them)."""
    segments, busy = [], set()  # busy: the snapshot rows this forward writes
    for seg, seq_id in zip(layout.segments, layout.seq_ids):
        pieces, at = [], 0
        cuts = snapshot_rows(states, seq_id, seg.cached, seg.new, busy) if states.interval else []
        for boundary, row in cuts:
            pieces.append((at, boundary - seg.cached, row))
            at = boundary - seg.cached
        pieces += [(at, seg.new, None)] if at < seg.new else []
        segments.append(StateSegment(seg.start, states.slot_of[seq_id], pieces))
        states.tokens[seq_id] = seg.cached + seg.new
    decoding = layout.seq_ids[len(layout.segments):]
    for seq_id in decoding:
        states.tokens[seq_id] += 1
    slots = torch.tensor([states.slot_of[s] for s in decoding], device=layout.slots.device) if decoding else None
    for pool in states.pools if busy else ():
        pool.reserve(max(busy) + 1)  # the snapshot rows this forward writes exist
    return StatePlan(segments, layout.prefill_tokens, slots, layout)


def snapshot_rows(states: HybridStates, seq_id, cached: int, new: int, busy: set[int]) -> list[tuple[int, int]]:
    """(boundary, snapshot row) for each block boundary in (cached, cached + new] to save the states
    at: every `interval` tokens, and the last boundary before the sequence's last token."""
    manager, bs = states.manager, states.manager.block_size
    tokens = manager.tokens[seq_id]
    last = (len(tokens) - 1) // bs * bs
    wanted = {b for b in range(cached // bs * bs + bs, min(cached + new, last) + 1, bs)
              if b % states.interval == 0 or b == last}
    if not wanted:
        return []
    parent = manager.block_hash[manager.tables[seq_id][cached // bs - 1]] if cached >= bs else manager.salts.get(seq_id)
    rows = []
    for i in range(cached // bs, max(wanted) // bs):  # the chain of block hashes, as notebook 15 names blocks
        parent = manager.chain_hash(parent, tokens[i * bs : (i + 1) * bs])
        if (i + 1) * bs in wanted and (row := manager.snapshots.claim(parent, busy)) is not None:
            busy.add(row)
            rows.append(((i + 1) * bs, row))
    return rows


class SnapshotIndex:
    """Which snapshot row holds the states after which block: block hash -> row, least recently used first."""

    def __init__(self, rows: int):
        self.rows: OrderedDict[int, int] = OrderedDict()
        self.free = list(range(rows - 1, -1, -1))  # row 0 first: the pools allocate rows as they are used
        self.saved = self.restored = 0  # counters: snapshots written, and restored for a prefix hit

    def __contains__(self, block_hash) -> bool:
        return block_hash in self.rows

    def find(self, block_hash: int) -> int:
        """The row saved after that block, now the most recently used."""
        self.rows.move_to_end(block_hash)
        self.restored += 1
        return self.rows[block_hash]

    def claim(self, block_hash: int, busy: set[int]) -> int | None:
        """A row to save the states after that block into: a free one, else the least recently used
        one not in `busy` (written by this forward). None: already saved, or every row is busy."""
        if block_hash in self.rows:
            self.rows.move_to_end(block_hash)
            return None  # the same tokens give the same state: nothing to write
        if self.free:
            row = self.free.pop()
        else:
            old = next((h for h, r in self.rows.items() if r not in busy), None)
            if old is None:
                return None
            row = self.rows.pop(old)
        self.rows[block_hash] = row
        self.saved += 1
        return row


class StateBlockManager(BlockManager):
    """Notebook 15's block manager for a hybrid model: a prefix hit is usable only where the DeltaNet
    states after it were saved, so the hit ends at the last such block (and before the last token)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, snapshots: SnapshotIndex):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.snapshots = snapshots

    def prefix_hits(self, token_ids: list[int], salt=None) -> list[int]:
        hits = super().prefix_hits(token_ids, salt)[: (len(token_ids) - 1) // self.block_size]
        while hits and self.block_hash[hits[-1]] not in self.snapshots:
            hits.pop()  # its keys are cached, but not the states after it
        return hits
