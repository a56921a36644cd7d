"""minillm.model.rope against Hugging Face transformers' rotary embedding, computed live.

The reference values pasted into notebooks/03_rope.ipynb come from the same transformers
classes used here: Qwen2RotaryEmbedding / Qwen3RotaryEmbedding / LlamaRotaryEmbedding for
inv_freq and the cos/sin tables (rope_scaling included), apply_rotary_pos_emb for the rotation.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from minillm.model.rope import (
    SUPPORTED_ROPE_TYPES,
    apply_rope,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    rotate_half,
)

LLAMA3_1 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
LLAMA3_2 = {**LLAMA3_1, "factor": 32.0}

# name: (transformers rotary class, config class, config kwargs, head_dim, rope_theta, rope_scaling)
CASES = {
    "qwen2.5-0.5b": (Qwen2RotaryEmbedding, Qwen2Config, dict(hidden_size=896, num_attention_heads=14), 64, 1e6, None),
    "qwen3-explicit-head-dim": (Qwen3RotaryEmbedding, Qwen3Config, dict(hidden_size=1024, num_attention_heads=16, head_dim=128), 128, 1e6, None),
    "smollm2-135m": (LlamaRotaryEmbedding, LlamaConfig, dict(hidden_size=576, num_attention_heads=9), 64, 1e5, None),
    "llama2-7b": (LlamaRotaryEmbedding, LlamaConfig, dict(hidden_size=4096, num_attention_heads=32), 128, 1e4, None),
    "default-type-dict": (Qwen2RotaryEmbedding, Qwen2Config, dict(hidden_size=512, num_attention_heads=8), 64, 1e6, {"rope_type": "default"}),
    "llama3.1-8b": (LlamaRotaryEmbedding, LlamaConfig, dict(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072), 128, 5e5, LLAMA3_1),
    "llama3.2-1b": (LlamaRotaryEmbedding, LlamaConfig, dict(hidden_size=2048, num_attention_heads=32, head_dim=64, max_position_embeddings=131072), 64, 5e5, LLAMA3_2),
    "linear-legacy-type": (LlamaRotaryEmbedding, LlamaConfig, dict(hidden_size=512, num_attention_heads=8), 64, 1e4, {"type": "linear", "factor": 4.0}),
    "linear-rope-type": (LlamaRotaryEmbedding, LlamaConfig, dict(hidden_size=1024, num_attention_heads=8), 128, 1e4, {"rope_type": "linear", "factor": 2.5}),
    # YaRN: Qwen3's 128K setting from its model card; betas and DeepSeek-style mscale terms; a given
    # attention_factor without the ends' rounding (gpt-oss); original_max_position_embeddings left to default
    "qwen3-yarn-128k": (Qwen3RotaryEmbedding, Qwen3Config, dict(hidden_size=1024, num_attention_heads=16, head_dim=128,
                        max_position_embeddings=131072), 128, 1e6,
                        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "yarn-betas-mscale": (Qwen3RotaryEmbedding, Qwen3Config, dict(hidden_size=512, num_attention_heads=8, head_dim=64,
                          max_position_embeddings=32768), 64, 1e4,
                          {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
                           "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0}),
    "yarn-factor-untruncated": (LlamaRotaryEmbedding, LlamaConfig, dict(hidden_size=512, num_attention_heads=8,
                                max_position_embeddings=4096), 64, 1.5e5,
                                {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                                 "attention_factor": 1.05, "truncate": False}),
    "yarn-original-default": (Qwen2RotaryEmbedding, Qwen2Config, dict(hidden_size=512, num_attention_heads=8,
                              max_position_embeddings=8192), 64, 1e6, {"rope_type": "yarn", "factor": 4.0}),
}


def hf_rotary(name: str):
    rotary_cls, config_cls, kwargs, head_dim, theta, scaling = CASES[name]
    extra = {"rope_scaling": dict(scaling)} if scaling is not None else {}
    config = config_cls(**kwargs, rope_theta=theta, **extra)
    return rotary_cls(config), head_dim, theta, scaling


def context(name: str) -> int | None:
    return CASES[name][2].get("max_position_embeddings")


def offset_positions() -> torch.Tensor:
    # two sequences at different offsets (a cached decode step), one far out in the context
    return torch.tensor([[0, 1, 2, 3, 4], [37, 38, 39, 40, 41], [30000, 30001, 30002, 30003, 30004]])


@pytest.mark.parametrize("name", list(CASES))
def test_inv_freq_and_cos_sin_match_transformers(name):
    rotary, head_dim, theta, scaling = hf_rotary(name)
    inv_freq = rope_inv_freq(head_dim, theta, scaling, context(name))
    assert inv_freq.shape == (head_dim // 2,) and inv_freq.dtype == torch.float32
    torch.testing.assert_close(inv_freq, rotary.inv_freq, atol=1e-6, rtol=1e-6)
    scale = rope_attention_factor(scaling, context(name))  # 1 but for YaRN
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert (scale != 1.0) == (name.startswith(("qwen3-yarn", "yarn")))

    positions = offset_positions()
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_cos_sin(positions, inv_freq, scale=scale)
    assert cos.shape == sin.shape == (3, 5, head_dim)
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)


def test_cos_sin_low_precision_dtype_matches_transformers():
    rotary, head_dim, theta, _ = hf_rotary("qwen2.5-0.5b")
    positions = offset_positions()
    for dtype in (torch.bfloat16, torch.float16):
        ref_cos, ref_sin = rotary(torch.zeros(1, dtype=dtype), positions)
        cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, theta), dtype=dtype)
        assert cos.dtype == dtype
        torch.testing.assert_close(cos, ref_cos, atol=0, rtol=0)
        torch.testing.assert_close(sin, ref_sin, atol=0, rtol=0)


def test_one_dimensional_positions_give_batch_one():
    inv_freq = rope_inv_freq(16, 1e4)
    cos, sin = rope_cos_sin(torch.arange(3, 9), inv_freq)
    cos2, sin2 = rope_cos_sin(torch.arange(3, 9)[None], inv_freq)
    assert cos.shape == (1, 6, 16)
    assert torch.equal(cos, cos2) and torch.equal(sin, sin2)
    assert torch.equal(cos[..., :8], cos[..., 8:])  # duplicated halves, like HF


def test_rotate_half_matches_transformers():
    x = torch.randn(2, 3, 4, 10)
    assert torch.equal(rotate_half(x), hf_rotate_half(x))


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama3.2-1b", "linear-legacy-type"])
def test_apply_rope_matches_transformers(name):
    torch.manual_seed(0)
    rotary, head_dim, theta, scaling = hf_rotary(name)
    B, H, Hkv, T, p = 2, 4, 2, 7, 123  # a step that starts at position p
    q, k = torch.randn(B, H, T, head_dim), torch.randn(B, Hkv, T, head_dim)
    positions = torch.arange(p, p + T).expand(B, T)
    ref_cos, ref_sin = rotary(q, positions)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)

    cos, sin = rope_cos_sin(torch.arange(p, p + T), rope_inv_freq(head_dim, theta, scaling))  # (1, T, D)
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k, atol=1e-6, rtol=0)
    # with transformers' own tables as well
    torch.testing.assert_close(apply_rope(q, ref_cos, ref_sin), ref_q, atol=1e-6, rtol=0)


def test_apply_rope_per_row_offsets_and_dtype():
    torch.manual_seed(1)
    rotary, head_dim, theta, _ = hf_rotary("smollm2-135m")
    positions = torch.tensor([[5, 6, 7], [100, 101, 102]])  # (B, T): each row its own offset
    q = torch.randn(2, 3, 3, head_dim)
    ref_q, _ = apply_rotary_pos_emb(q, q, *rotary(q, positions))
    ours = apply_rope(q, *rope_cos_sin(positions, rope_inv_freq(head_dim, theta)))
    torch.testing.assert_close(ours, ref_q, atol=1e-6, rtol=0)

    qb = q.to(torch.bfloat16)
    ref_qb, _ = apply_rotary_pos_emb(qb, qb, *rotary(qb, positions))
    ours_b = apply_rope(qb, *rope_cos_sin(positions, rope_inv_freq(head_dim, theta), dtype=torch.bfloat16))
    assert ours_b.dtype == torch.bfloat16
    torch.testing.assert_close(ours_b, ref_qb, atol=0, rtol=0)


def test_relative_position_property():
    torch.manual_seed(2)
    D = 64
    inv_freq = rope_inv_freq(D, 1e6)
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        q, k = torch.randn(D), torch.randn(D)
        q, k = q / q.norm(), k / k.norm()
        m, n, s = (int(v) for v in torch.randint(0, 1000, (3,), generator=gen))

        def score(mq: int, nk: int) -> torch.Tensor:
            cos, sin = rope_cos_sin(torch.tensor([mq, nk]), inv_freq)
            rq = apply_rope(q.view(1, 1, 1, D), cos[:, :1], sin[:, :1])
            rk = apply_rope(k.view(1, 1, 1, D), cos[:, 1:], sin[:, 1:])
            return (rq * rk).sum()

        torch.testing.assert_close(score(m + s, n + s), score(m, n), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "scaling, name",
    [
        ({"type": "dynamic", "factor": 2.0}, "dynamic"),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "longrope"),
    ],
)
def test_unsupported_rope_type_raises_naming_it(scaling, name):
    with pytest.raises(ValueError, match=name) as err:
        rope_inv_freq(64, 1e6, scaling)
    for supported in SUPPORTED_ROPE_TYPES:
        assert supported in str(err.value)


def test_rope_type_key_wins_over_legacy_type():
    both = {"rope_type": "linear", "type": "default", "factor": 2.0}
    torch.testing.assert_close(rope_inv_freq(32, 1e4, both), rope_inv_freq(32, 1e4) / 2)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="head_dim"):
        rope_inv_freq(63, 1e4)
    with pytest.raises(ValueError, match="head_dim"):
        rope_inv_freq(0, 1e4)
    with pytest.raises(ValueError, match="rope_theta"):
        rope_inv_freq(64, 0.0)
    with pytest.raises(TypeError, match="rope_scaling"):
        rope_inv_freq(64, 1e4, "linear")
    with pytest.raises(ValueError, match="factor"):
        rope_inv_freq(64, 1e4, {"rope_type": "linear"})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_inv_freq(64, 5e5, {k: v for k, v in LLAMA3_1.items() if k != "original_max_position_embeddings"})
    with pytest.raises(ValueError, match="high_freq_factor"):
        rope_inv_freq(64, 5e5, {**LLAMA3_1, "high_freq_factor": 1.0})

    inv_freq = rope_inv_freq(8, 1e4)
    with pytest.raises(TypeError, match="integer"):
        rope_cos_sin(torch.arange(4.0), inv_freq)
    with pytest.raises(ValueError, match="positions"):
        rope_cos_sin(torch.zeros(1, 2, 3, dtype=torch.long), inv_freq)
    with pytest.raises(ValueError, match="inv_freq"):
        rope_cos_sin(torch.arange(4), inv_freq[None])

    cos, sin = rope_cos_sin(torch.arange(4), inv_freq)  # (1, 4, 8)
    with pytest.raises(ValueError, match=r"\(2, 3, 5, 8\)"):  # T mismatch: 5 tokens, table of 4
        apply_rope(torch.randn(2, 3, 5, 8), cos, sin)
    with pytest.raises(ValueError, match=r"\(1, 4, 8\)"):  # 3-D x
        apply_rope(torch.randn(3, 4, 8), cos, sin)
    with pytest.raises(ValueError, match="cos"):  # batch 3 tables for a batch of 2
        apply_rope(torch.randn(2, 3, 4, 8), cos.expand(3, 4, 8), sin.expand(3, 4, 8))
    with pytest.raises(ValueError, match="even"):
        rotate_half(torch.randn(2, 7))


def test_planted_bug_positions_off_by_one_is_caught():
    """Shift the positions by one (the classic cache-offset bug): the comparison must fail."""
    torch.manual_seed(4)
    rotary, head_dim, theta, _ = hf_rotary("qwen2.5-0.5b")
    p, T = 50, 4
    q = torch.randn(1, 2, T, head_dim)
    ref_q, _ = apply_rotary_pos_emb(q, q, *rotary(q, torch.arange(p, p + T)[None]))
    inv_freq = rope_inv_freq(head_dim, theta)
    good = apply_rope(q, *rope_cos_sin(torch.arange(p, p + T), inv_freq))
    torch.testing.assert_close(good, ref_q, atol=1e-6, rtol=0)
    for wrong in (torch.arange(p + 1, p + T + 1), torch.arange(p - 1, p + T - 1)):
        bad = apply_rope(q, *rope_cos_sin(wrong, inv_freq))
        with pytest.raises(AssertionError):
            torch.testing.assert_close(bad, ref_q, atol=1e-6, rtol=0)


def test_planted_bug_interleaved_pairs_is_caught():
    """Pair (2i, 2i+1) instead of (i, i + D/2): wrong for HF checkpoints, and the test sees it."""
    torch.manual_seed(5)
    rotary, head_dim, theta, _ = hf_rotary("smollm2-135m")
    q = torch.randn(1, 1, 6, head_dim)
    cos, sin = rotary(q, torch.arange(6)[None])
    ref_q, _ = apply_rotary_pos_emb(q, q, cos, sin)

    def rotate_adjacent(x):  # (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)

    ours_cos, ours_sin = rope_cos_sin(torch.arange(6), rope_inv_freq(head_dim, theta))
    interleaved_cos = ours_cos[..., : head_dim // 2].repeat_interleave(2, dim=-1)[:, None]
    interleaved_sin = ours_sin[..., : head_dim // 2].repeat_interleave(2, dim=-1)[:, None]
    bad = q * interleaved_cos + rotate_adjacent(q) * interleaved_sin
    with pytest.raises(AssertionError):
        torch.testing.assert_close(bad, ref_q, atol=1e-6, rtol=0)
