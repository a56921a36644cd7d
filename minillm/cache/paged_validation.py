# Generated from notebooks/15_block_manager.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The paged KV cache's input checks (notebook 15): each error names what was expected and what came.

Kept apart from minillm/cache/paged.py so that the lessons' code shows only the logic.
"""

from __future__ import annotations

import torch


def validate_pool(num_blocks: int, block_size: int) -> None:
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"BlockManager: num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")


def validate_known(manager, seq_id) -> None:
    if seq_id not in manager.tables:
        raise ValueError(f"unknown seq_id {seq_id!r}: allocate it first (known: {list(manager.tables)})")


def validate_allocate(manager, seq_id, token_ids: list[int], need: int) -> None:
    if seq_id in manager.tables:
        raise ValueError(f"allocate: seq_id {seq_id!r} already has blocks")
    if len(token_ids) == 0:
        raise ValueError("allocate: token_ids is empty, a prompt needs at least one token")
    if need > manager.num_free_blocks:
        raise ValueError(f"allocate: seq_id {seq_id!r} needs {need} free blocks, only {manager.num_free_blocks} are free")


def validate_fork(manager, seq_id, new_seq_id) -> None:
    validate_known(manager, seq_id)
    if new_seq_id in manager.tables:
        raise ValueError(f"fork: seq_id {new_seq_id!r} already has blocks")


def validate_append(manager, seq_id) -> None:
    if not manager.can_append(seq_id):  # can_append checks that seq_id is known
        raise ValueError(f"append: seq_id {seq_id!r} needs 1 free block, 0 are free")


def validate_position(n: int, seq_id, position: int) -> None:
    if not 0 <= position < n:
        raise ValueError(f"slot: position must be in [0, {n}) for seq_id {seq_id!r}, got {position}")


def validate_pool_shape(shape: tuple[int, ...]) -> None:
    if min(shape) < 1:
        raise ValueError(f"PagedKVCache: every size must be >= 1, got (N, bs, Hkv, D) = {shape}")


def validate_gather(num_blocks: int, bs: int, length: int) -> None:
    if not 0 < length <= num_blocks * bs:
        raise ValueError(f"gather_reference: length must be in [1, {num_blocks * bs}] "
                         f"for {num_blocks} blocks of {bs}, got {length}")


def validate_layout(seq_ids: list, new_tokens, new: list[int], lengths: list[int], sink_slot: int | None) -> None:
    if not seq_ids or len(new) != len(seq_ids) or not all(1 <= n <= L for n, L in zip(new, lengths)):
        raise ValueError(f"batch_layout: need 1 <= new tokens <= length for each sequence, "
                         f"got new_tokens {new_tokens}, lengths {lengths}")
    if len(set(new)) > 1 and sink_slot is None:
        raise ValueError(f"batch_layout: rows with different new-token counts {new} need a sink_slot "
                         "for their padding queries")


def validate_update(layout, pool_shape, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
    (B, T), (Hkv, D) = layout.slots.shape, pool_shape[2:]  # the pool is (N, block_size, Hkv, D)
    if pos != layout.start_pos or k.shape != (B, Hkv, T, D) or v.shape != k.shape:
        raise ValueError(f"PagedView.update: expected pos {layout.start_pos} and k, v (B, Hkv, T, D) = "
                         f"{(B, Hkv, T, D)}, got pos {pos}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def validate_forward(model, cache: list, seq_ids: list, input_ids: torch.Tensor) -> None:
    if len(cache) != model.config.num_hidden_layers:
        raise ValueError(f"paged_forward: cache has {len(cache)} layers, the model {model.config.num_hidden_layers}")
    if input_ids.dim() != 2 or input_ids.shape[0] != len(seq_ids):
        raise ValueError(f"paged_forward: input_ids must be (B, T) with B = len(seq_ids) = {len(seq_ids)}, "
                         f"got {tuple(input_ids.shape)}")
