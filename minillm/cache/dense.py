# Generated from notebooks/08_kv_cache.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The KV cache: keys and values of past tokens, kept so each decode step computes only the new token.

Built in notebooks/08_kv_cache.ipynb. `KVCache` is preallocated, with one method,
`update(pos, k, v)` (after gpt-fast's model.py); `ConcatKVCache` is the naive growing version
the notebook measures it against. The model (minillm/model/decoder.py) calls `cache[i].update(...)` in
each layer's attention; positions and the cache are passed, never hidden. The input checks are
the `_check_*` functions.

Shape legend: B batch, Hkv kv heads, S_max cache length, T new tokens, D head dim.
"""

from __future__ import annotations

import torch


def _validate_sizes(shape: tuple[int, int, int, int]) -> None:
    """A KVCache's (B, Hkv, S_max, D): every size >= 1."""
    if min(shape) < 1:
        raise ValueError(f"KVCache: every size must be >= 1, got (B, Hkv, S_max, D) = {shape}")


def _validate_update(shape: torch.Size, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """k and v (B, Hkv, T, D) fit a cache of `shape` (B, Hkv, S_max, D) at slots pos..pos+T-1."""
    B, Hkv, S_max, D = shape
    T = k.shape[2]
    if k.shape != (B, Hkv, T, D) or v.shape != k.shape:
        raise ValueError(f"KVCache.update: k and v must be (B, Hkv, T, D) = ({B}, {Hkv}, T, {D}), "
                         f"got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if pos < 0 or pos + T > S_max:
        raise ValueError(f"KVCache.update: writing {T} token(s) at position {pos} needs {pos + T} slots, "
                         f"the cache holds {S_max}")


def _validate_append(cached: int, pos: int) -> None:
    """A concatenating cache can only grow at its end."""
    if pos != cached:
        raise ValueError(f"ConcatKVCache.update: holds {cached} positions, cannot write at position {pos}")


def _validate_max_seq_len(config, max_seq_len: int) -> None:
    """make_cache's length: no more slots than the positions the model was trained for."""
    if max_seq_len > config.max_position_embeddings:
        raise ValueError(f"make_cache: max_seq_len {max_seq_len} exceeds the model's "
                         f"max_position_embeddings {config.max_position_embeddings}")


class KVCache:
    """One layer's keys and values, preallocated: k and v of shape (B, Hkv, S_max, D)."""

    def __init__(self, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        _validate_sizes(shape)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, Hkv, T, D) at positions pos..pos+T-1; return views of positions 0..pos+T-1."""
        _validate_update(self.k.shape, pos, k, v)
        T = k.shape[2]
        self.k[:, :, pos : pos + T] = k  # (B, Hkv, T, D) into the slots pos..pos+T-1
        self.v[:, :, pos : pos + T] = v
        return self.k[:, :, : pos + T], self.v[:, :, : pos + T]  # views (B, Hkv, pos+T, D), no copy


class ConcatKVCache:
    """The naive cache: grows by concatenation, copying everything cached at every step."""

    def __init__(self):
        self.k = self.v = None

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cached = 0 if self.k is None else self.k.shape[2]
        _validate_append(cached, pos)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)  # (B, Hkv, pos+T, D): a full copy
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def make_cache(config, batch_size: int, max_seq_len: int, dtype: torch.dtype = torch.float32,
               device: str | torch.device | None = None) -> list[KVCache]:
    """A preallocated KVCache for each of the model's layers."""
    _validate_max_seq_len(config, max_seq_len)
    return [KVCache(batch_size, max_seq_len, config.num_key_value_heads, config.head_dim, dtype, device)
            for _ in range(config.num_hidden_layers)]


def kv_cache_bytes(config, tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes to cache `tokens` positions for `batch_size` sequences: 2 (k and v) x L x Hkv x D per token."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return per_token * tokens * batch_size
