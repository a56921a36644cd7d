# Generated from notebooks/A6_hybrid_engine.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Notebook 17's engine for Qwen3.5: `HybridEngine`, and notebook 19's speculating one.

Built in notebooks/A6_hybrid_engine.ipynb. The attention layers page their keys and values as
before; each DeltaNet layer keeps a state slot per sequence (minillm/cache/state_pool.py). A slot
starts when a prefill starts (from zeros, or from the snapshot a prefix hit restores), is copied
when n > 1 choices fork, and is freed when its sequence finishes or is preempted (which then
recomputes, as notebook 17's do). Chunked prefill continues the slot from chunk to chunk.
`HybridSpeculativeEngine` saves a speculating sequence's slot before the verify forward and, after
a rejection, restores it and runs the kept tokens again: a state cannot forget by position.
"""

from __future__ import annotations

import torch

from minillm.cache.packed import kv_pool_blocks, packed_layout, packed_views
from minillm.cache.paged import BlockManager, PagedKVCache
from minillm.cache.state_pool import HybridStates, SnapshotIndex, StateBlockManager
from minillm.runtime.engine import Engine
from minillm.runtime.sequence import Output, Sequence
from minillm.runtime.speculative_engine import SpeculativeEngine
from minillm.utils.validate import is_int, is_positive_int


class HybridEngine(Engine):
    """Notebook 17's Engine with a DeltaNet state slot per sequence beside its KV blocks.

    state_snapshots: saved states kept for prefix caching (least recently used ones go first);
    snapshot_interval: tokens between the boundaries a prompt saves its states at (and its last one)."""

    def __init__(self, model, tokenizer, *args, state_snapshots: int = 32, snapshot_interval: int = 64, **kwargs):
        if not is_int(state_snapshots) or state_snapshots < 0:
            raise ValueError(f"state_snapshots must be an int >= 0, got {state_snapshots!r}")
        if not is_positive_int(snapshot_interval):
            raise ValueError(f"snapshot_interval must be a positive int (tokens), got {snapshot_interval!r}")
        self.state_snapshots, self.snapshot_interval = state_snapshots, snapshot_interval
        super().__init__(model, tokenizer, *args, **kwargs)

    def make_pools(self, num_blocks: int, block_size: int, prefix_caching: bool, dtype) -> tuple[StateBlockManager, list]:
        """The block manager, a KV pool per attention layer (one block more: the sink) and a StatePool
        per DeltaNet layer; `self.states` is the slot table the pools share."""
        config = self.model.config
        if self.snapshot_interval % block_size:
            raise ValueError(f"snapshot_interval {self.snapshot_interval} must be a multiple of block_size {block_size}")
        snapshots = SnapshotIndex(self.state_snapshots if prefix_caching else 0)
        manager = StateBlockManager(num_blocks, block_size, prefix_caching, snapshots)
        self.states = HybridStates(config, manager, 8, snapshots=len(snapshots.free),
                                   interval=self.snapshot_interval if prefix_caching else None, dtype=dtype,
                                   device=self.device)
        pools = iter(self.states.pools)
        cache = [PagedKVCache(num_blocks + 1, block_size, config.num_key_value_heads, config.head_dim, dtype, self.device)
                 if kind == "full_attention" else next(pools) for kind in config.layer_types]
        return manager, cache

    def run(self, prefills: list[tuple[Sequence, int]], decoding: list[Sequence], rejected: list[Sequence]) -> list[Output]:
        """Notebook 17's run, with the slots kept in step: started for the prompts that begin this step,
        copied to the choices that fork, freed for the sequences no longer running."""
        self.states.keep({seq.id for seq in self.scheduler.running})  # aborted or preempted since the last step
        for seq, _ in prefills:
            if self.states.tokens.get(seq.id) != seq.num_computed:  # admitted (again) this step
                self.states.start(seq.id, seq.num_computed)
        parents = {fork.id: seq.id for seq, _ in prefills for fork in seq.forks}
        outputs = super().run(prefills, decoding, rejected)
        for seq in self.scheduler.running:
            if seq.id in parents and seq.id not in self.states.slot_of:  # joined after its prompt's prefill
                self.states.fork(parents[seq.id], seq.id)
        self.states.keep({seq.id for seq in self.scheduler.running})
        return outputs


def save_slot(states: HybridStates, seq_id) -> tuple[int, list]:
    """A copy of one sequence's slot in every DeltaNet layer, and how many tokens it holds."""
    slot = states.slot_of[seq_id]
    return states.tokens[seq_id], [(pool.conv[slot].clone(), pool.recurrent[slot].clone()) for pool in states.pools]


def restore_slot(states: HybridStates, seq_id, saved: tuple[int, list]) -> None:
    slot = states.slot_of[seq_id]
    states.tokens[seq_id], copies = saved
    for pool, (conv, recurrent) in zip(states.pools, copies):
        pool.conv[slot], pool.recurrent[slot] = conv, recurrent


def replay(model, cache: list, manager: BlockManager, chunks: list[tuple[Sequence, int]]) -> None:
    """Run each sequence's tokens from `cached` (in each (sequence, cached)) to its end once more, in one
    packed forward whose logits are not needed: the DeltaNet slots absorb them, the KV pools get the
    same keys again."""
    device = next(model.parameters()).device
    layout = packed_layout(manager, [(s.id, c, len(s.token_ids) - c) for s, c in chunks], [], kv_pool_blocks(cache), device)
    ids = [t for s, c in chunks for t in s.token_ids[c:]]
    model(torch.tensor([ids], device=device), positions=layout.positions, cache=packed_views(cache, layout), logits_to_keep=1)


class HybridSpeculativeEngine(HybridEngine, SpeculativeEngine):
    """Notebook 19's SpeculativeEngine for Qwen3.5: each speculating sequence's slot is saved before
    the verify forward; where drafts were rejected it is restored, and the kept tokens run again."""

    def verify(self, decoding: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        self.saved = {seq.id: save_slot(self.states, seq.id) for seq in decoding}
        return super().verify(decoding, drafts)

    @torch.no_grad()
    def step(self) -> list[Output]:
        self.saved = {}
        outputs = super().step()  # notebook 19's: a verify forward while few decode
        behind = [(seq, saved) for seq_id, saved in self.saved.items()
                  if (seq := self.sequences.get(seq_id)) and self.states.tokens[seq_id] != len(seq.token_ids)]
        for seq, saved in behind:  # its slot absorbed rejected drafts: back to before them
            restore_slot(self.states, seq.id, saved)
        if behind:
            replay(self.model, self.cache, self.manager, [(seq, saved[0]) for seq, saved in behind])
        self.states.keep({seq.id for seq in self.scheduler.running})  # a verify may have finished some
        return outputs
