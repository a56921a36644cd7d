"""minillm/cache/hybrid.py: what a Qwen3.5 cache holds and what it costs.

The DeltaNet layers' states have a fixed size; only the attention layers (one in four) grow with
the context. The byte counts are checked against the tensors make_hybrid_cache allocates, and,
for the real Qwen3.5-0.8B shape, against a Qwen3-style KV cache of the same sizes in every layer.
"""

from __future__ import annotations

import copy

import pytest
import torch

from minillm.cache.dense import KVCache, kv_cache_bytes
from minillm.cache.hybrid import hybrid_cache_bytes, linear_state_bytes, make_hybrid_cache
from minillm.model.decoder import ModelConfig
from minillm.model.qwen3_5 import HybridConfig, LinearState
from support import DATA

QWEN3_5_0_8B_TEXT = {  # the text part of Qwen/Qwen3.5-0.8B's config.json
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attn_output_gate": True, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
}


@pytest.fixture(scope="module")
def tiny():
    return HybridConfig.from_json(DATA / "qwen3_5-tiny")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_linear_state_bytes_are_the_states_make_hybrid_cache_makes(tiny, dtype, batch):
    cache = make_hybrid_cache(tiny, batch, 16, dtype=dtype)
    assert [type(c) for c in cache] == [LinearState] * 3 + [KVCache]
    states = [c for c in cache if isinstance(c, LinearState)]
    for s in states:
        assert s.conv.dtype == dtype and s.recurrent.dtype == torch.float32  # the recurrent state stays fp32
        assert s.recurrent.shape == (batch, 4, 16, 8) and s.conv.shape == (batch, 2 * 2 * 16 + 4 * 8, 3)
    allocated = sum(nbytes(s.conv) + nbytes(s.recurrent) for s in states)
    assert linear_state_bytes(tiny, batch, dtype) == allocated == sum(s.nbytes() for s in states)
    kv = [c for c in cache if isinstance(c, KVCache)]
    kv_allocated = sum(nbytes(t) for c in kv for t in vars(c).values() if isinstance(t, torch.Tensor))
    assert hybrid_cache_bytes(tiny, 16, batch, dtype) == allocated + kv_allocated


def test_hybrid_cache_bytes_grow_by_the_attention_layers_only(tiny):
    config = HybridConfig.from_dict(copy.deepcopy(QWEN3_5_0_8B_TEXT))
    for cfg in (tiny, config):
        full = cfg.layer_types.count("full_attention")
        per_token = 2 * full * cfg.num_key_value_heads * cfg.head_dim * 2  # k and v, bf16
        base = hybrid_cache_bytes(cfg, 0)
        assert base == linear_state_bytes(cfg) > 0
        for tokens in (1, 100, 4096):
            assert hybrid_cache_bytes(cfg, tokens) - base == per_token * tokens
        assert hybrid_cache_bytes(cfg, 10, batch_size=4) == 4 * hybrid_cache_bytes(cfg, 10)


@pytest.mark.parametrize("tokens", [4096, 32768])
def test_qwen3_5_0_8b_against_a_kv_cache_in_every_layer(tokens):
    """A Qwen3 of the same shape keeps K and V in all 24 layers; Qwen3.5 in 6, plus 18 fixed states."""
    text = copy.deepcopy(QWEN3_5_0_8B_TEXT)
    hybrid = HybridConfig.from_dict(text)
    dense = ModelConfig(model_type="qwen3", vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
                        intermediate_size=text["intermediate_size"], num_hidden_layers=text["num_hidden_layers"],
                        num_attention_heads=text["num_attention_heads"],
                        num_key_value_heads=text["num_key_value_heads"], head_dim=text["head_dim"],
                        max_position_embeddings=text["max_position_embeddings"], rms_norm_eps=text["rms_norm_eps"],
                        rope_theta=text["rope_parameters"]["rope_theta"], tie_word_embeddings=True, qk_norm=True)
    L, Hkv, D = text["num_hidden_layers"], text["num_key_value_heads"], text["head_dim"]
    full = L // text["full_attention_interval"]
    kv_per_layer_token = 2 * Hkv * D * 2  # k and v, bf16
    channels = 2 * text["linear_num_key_heads"] * text["linear_key_head_dim"] + \
        text["linear_num_value_heads"] * text["linear_value_head_dim"]
    state = channels * (text["linear_conv_kernel_dim"] - 1) * 2 + \
        text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"] * 4
    dense_bytes, hybrid_bytes = kv_cache_bytes(dense, tokens), hybrid_cache_bytes(hybrid, tokens)
    assert dense_bytes == L * kv_per_layer_token * tokens
    assert hybrid_bytes == full * kv_per_layer_token * tokens + (L - full) * state
    assert dense_bytes / hybrid_bytes == pytest.approx(
        L * kv_per_layer_token * tokens / (full * kv_per_layer_token * tokens + (L - full) * state), rel=1e-12)
    # the fixed states weigh less and less as the context grows: the ratio tends to L / full = 4 from below
    assert 1 < dense_bytes / hybrid_bytes < L / full
    if tokens == 32768:
        assert dense_bytes / hybrid_bytes > 0.95 * L / full
