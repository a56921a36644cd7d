# Generated from notebooks/A6_hybrid_engine.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Notebook 17's engine for Qwen3.5: `HybridEngine`.

Built in notebooks/A6_hybrid_engine.ipynb. The attention layers page their keys and values as
before; each DeltaNet layer keeps a state slot per sequence (minillm/cache/state_pool.py). A slot
starts when a prefill starts (from zeros, or from the snapshot a prefix hit restores), is copied
when n > 1 choices fork, and is freed when its sequence finishes or is preempted (which then
recomputes, as notebook 17's do). Chunked prefill continues the slot from chunk to chunk.
"""

from __future__ import annotations


from minillm.cache.paged import PagedKVCache
from minillm.cache.state_pool import HybridStates, SnapshotIndex, StateBlockManager
from minillm.runtime.engine import Engine
from minillm.runtime.sequence import Output, Sequence
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
