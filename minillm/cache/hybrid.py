# Generated from notebooks/22_linear_attention.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""A hybrid model's cache: a KV cache for each attention layer, a fixed-size state for each DeltaNet layer.

Built in notebooks/22_linear_attention.ipynb. The KV cache grows with the context; the
LinearState (conv + recurrent) does not, which is why three layers in four of Qwen3.5 cost the
same memory at 32k tokens as at 1.
"""

from __future__ import annotations

import torch

from minillm.cache.dense import KVCache, _validate_max_seq_len
from minillm.model.qwen3_5 import HybridConfig, LinearState


def make_hybrid_cache(config: HybridConfig, batch_size: int, max_seq_len: int, dtype: torch.dtype = torch.float32,
                      device: str | torch.device | None = None) -> list:
    """Per layer: a KVCache (B, Hkv, max_seq_len, D) for full_attention, a LinearState for linear_attention."""
    _validate_max_seq_len(config, max_seq_len)
    return [KVCache(batch_size, max_seq_len, config.num_key_value_heads, config.head_dim, dtype, device)
            if kind == "full_attention" else LinearState(config, batch_size, dtype, device)
            for kind in config.layer_types]


def linear_state_bytes(config: HybridConfig, batch_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of every DeltaNet layer's state for `batch_size` sequences, at any context length:
    the conv state (C x (K-1), in the model's dtype) and the recurrent state (Hv x Dk x Dv, float32)."""
    Hv, Dk, Dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    conv = config.conv_channels * (config.linear_conv_kernel_dim - 1) * dtype.itemsize
    recurrent = Hv * Dk * Dv * 4
    return config.layer_types.count("linear_attention") * (conv + recurrent) * batch_size


def hybrid_cache_bytes(config: HybridConfig, tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes to hold `tokens` positions: k and v of the attention layers only, plus the states."""
    kv_per_token = 2 * config.layer_types.count("full_attention") * config.num_key_value_heads * config.head_dim
    return kv_per_token * dtype.itemsize * tokens * batch_size + linear_state_bytes(config, batch_size, dtype)
