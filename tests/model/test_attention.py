"""minillm.model.attention against torch.nn.functional.scaled_dot_product_attention and transformers."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers.models.llama.modeling_llama import repeat_kv as hf_repeat_kv
from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

from minillm.model.attention import (
    attention_mask,
    attention_weights,
    causal_mask,
    padding_mask,
    repeat_kv,
    scaled_dot_product_attention,
)

# (B, H, Hkv, T, S, D); the second is Qwen2.5-0.5B's head layout
SHAPES = [(1, 1, 1, 7, 7, 8), (2, 14, 2, 9, 9, 64), (3, 8, 4, 5, 5, 32), (2, 6, 1, 3, 3, 16)]


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def qkv(B, H, Hkv, T, S, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)
    return q, k, v


# --- masks ------------------------------------------------------------------------------


@pytest.mark.parametrize("T,S", [(1, 1), (4, 4), (3, 8), (1, 9), (6, 7)])
def test_causal_mask_is_torch_lower_right(T, S):
    assert torch.equal(causal_mask(T, S, start=S - T), causal_lower_right(T, S)._materialize())


def test_causal_mask_start_zero_is_tril_and_tail_is_masked():
    assert torch.equal(causal_mask(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())
    m = causal_mask(2, 6, start=1)  # preallocated cache: keys past start + T - 1 masked
    assert m.tolist() == [[True, True, False, False, False, False], [True, True, True, False, False, False]]


@pytest.mark.parametrize("args", [(3, 4, 2), (5, 4, 0), (-1, 4, 0), (2, 4, -1), (2.0, 4, 0)])
def test_causal_mask_bad_arguments(args):
    with pytest.raises(ValueError, match="causal_mask"):
        causal_mask(*args)


def test_padding_mask_shape_and_errors():
    am = torch.tensor([[0, 1, 1], [1, 1, 1]])
    pm = padding_mask(am)
    assert pm.shape == (2, 1, 1, 3) and pm.dtype == torch.bool
    assert pm[:, 0, 0].tolist() == [[False, True, True], [True, True, True]]
    with pytest.raises(ValueError, match="attention_mask"):
        padding_mask(torch.ones(2, 1, 3))
    with pytest.raises(ValueError, match="0 .* and 1"):
        padding_mask(torch.tensor([[0, 2, 1]]))
    with pytest.raises(TypeError, match="attention_mask"):
        padding_mask([[1, 1]])


def test_attention_mask_combines_causal_and_padding():
    am = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    m = attention_mask(4, 4, attention_mask=am)
    assert m.shape == (2, 1, 4, 4)
    assert torch.equal(m, causal_mask(4, 4)[None, None] & am.bool()[:, None, None, :])
    assert attention_mask(2, 5, start=3).shape == (1, 1, 2, 5)
    step = attention_mask(1, 4, start=3, attention_mask=am)  # one decoding step over a padded batch
    assert torch.equal(step[:, 0, 0], am.bool())
    with pytest.raises(ValueError, match="S = 5"):
        attention_mask(4, 5, attention_mask=am)


# --- repeat_kv and GQA ------------------------------------------------------------------


@pytest.mark.parametrize("n_rep", [1, 2, 7])
def test_repeat_kv_matches_transformers(n_rep):
    x = torch.randn(2, 3, 5, 4)
    assert torch.equal(repeat_kv(x, n_rep), hf_repeat_kv(x, n_rep))
    assert torch.equal(repeat_kv(x, n_rep), torch.repeat_interleave(x, n_rep, dim=1))


def test_repeat_kv_bad_input():
    with pytest.raises(ValueError, match="x must be 4-D"):
        repeat_kv(torch.randn(3, 5, 4), 2)
    with pytest.raises(ValueError, match="n_rep"):
        repeat_kv(torch.randn(1, 3, 5, 4), 0)


# --- attention against torch and transformers --------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_causal_matches_torch(shape):
    B, H, Hkv, T, S, D = shape
    q, k, v = qkv(*shape)
    ours = scaled_dot_product_attention(q, k, v, causal_mask(T, S))
    close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    n_rep = H // Hkv
    close(ours, F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True))


@pytest.mark.parametrize("shape", SHAPES)
def test_explicit_mask_and_scale_match_torch(shape):
    B, H, Hkv, T, S, D = shape
    q, k, v = qkv(*shape, seed=1)
    mask = torch.rand(B, 1, T, S, generator=torch.Generator().manual_seed(2)) < 0.6  # some rows fully masked
    ours = scaled_dot_product_attention(q, k, v, mask, scale=0.3)
    close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True))
    no_mask = scaled_dot_product_attention(q, k, v)
    close(no_mask, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_transformers_eager_attention(shape):
    B, H, Hkv, T, S, D = shape
    q, k, v = qkv(*shape, seed=3)
    mask = causal_mask(T, S)
    additive = torch.zeros(T, S).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=H // Hkv, training=False)
    hf_out, hf_w = eager_attention_forward(module, q, k, v, additive, scaling=D**-0.5)
    close(scaled_dot_product_attention(q, k, v, mask).transpose(1, 2), hf_out)  # hf_out is (B, T, H, D)
    close(attention_weights(q, k, mask), hf_w)


def test_bf16_identical_to_transformers_eager():
    q, k, v = qkv(2, 14, 2, 9, 9, 64, seed=4, dtype=torch.bfloat16)
    mask = causal_mask(9, 9)
    additive = torch.zeros(9, 9, dtype=torch.bfloat16).masked_fill(~mask, torch.finfo(torch.bfloat16).min)
    module = SimpleNamespace(num_key_value_groups=7, training=False)
    hf_out, _ = eager_attention_forward(module, q, k, v, additive, scaling=1 / 8)
    ours = scaled_dot_product_attention(q, k, v, mask)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.transpose(1, 2), hf_out, atol=0, rtol=0)


def test_weights_rows_sum_to_one_and_masked_keys_are_zero():
    q, k, _ = qkv(1, 2, 2, 6, 6, 8, seed=5)
    w = attention_weights(q, k, causal_mask(6, 6))
    close(w.sum(-1), torch.ones(1, 2, 6))
    assert (w.triu(1) == 0).all()


def _offset_block(start_bug: int = 0):
    """Attention of a block of T queries at positions p..p+T-1 against the full causal computation."""
    p, T, D = 6, 4, 16
    S = p + T
    q, k, v = qkv(1, 4, 2, S, S, D, seed=6)
    full = scaled_dot_product_attention(q, k, v, causal_mask(S, S))
    block = scaled_dot_product_attention(q[:, :, p:], k, v, causal_mask(T, S, start=p + start_bug))
    close(block, full[:, :, p:])


def test_offset_block_equals_last_rows_of_full_causal():
    _offset_block()


def test_planted_bug_mask_off_by_one_is_caught():
    with pytest.raises(AssertionError):
        _offset_block(start_bug=-1)


def test_wrong_top_left_mask_differs_and_equals_torch_is_causal():
    # the triangle anchored at 0 is what is_causal=True does when T != S: wrong for a cached block
    p, T, D = 5, 3, 16
    S = p + T
    q, k, v = qkv(1, 2, 2, S, S, D, seed=7)
    full = scaled_dot_product_attention(q, k, v, causal_mask(S, S))
    wrong = scaled_dot_product_attention(q[:, :, p:], k, v, torch.ones(T, S, dtype=torch.bool).tril())
    close(wrong, F.scaled_dot_product_attention(q[:, :, p:], k, v, is_causal=True))
    assert (wrong - full[:, :, p:]).abs().max() > 0.1


def test_padded_batch_equals_each_sequence_alone():
    lengths, H, Hkv, S, D = [8, 5, 3, 1], 4, 2, 8, 16
    B = len(lengths)
    q, k, v = qkv(B, H, Hkv, S, S, D, seed=8)
    am = torch.tensor([[0] * (S - n) + [1] * n for n in lengths])
    mask = attention_mask(S, S, attention_mask=am)
    out = scaled_dot_product_attention(q, k, v, mask)
    assert not out.isnan().any()
    for b, n in enumerate(lengths):
        sl = slice(S - n, S)
        alone = scaled_dot_product_attention(q[b : b + 1, :, sl], k[b : b + 1, :, sl], v[b : b + 1, :, sl], causal_mask(n, n))
        close(out[b : b + 1, :, sl], alone)
        assert torch.equal(out[b, :, : S - n], torch.zeros(H, S - n, D))
    n_rep = H // Hkv
    close(out, F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask))


def test_fully_masked_row_gives_zeros_not_nan():
    q, k, v = qkv(1, 2, 1, 3, 4, 8, seed=9)
    mask = causal_mask(3, 4, start=1).clone()
    mask[1] = False                                   # query 1 may see nothing
    out = scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 8))
    assert torch.equal(attention_weights(q, k, mask)[:, :, 1], torch.zeros(1, 2, 4))
    assert not out.isnan().any()
    assert out[:, :, [0, 2]].abs().sum() > 0


# --- bad input --------------------------------------------------------------------------


def test_bad_shapes_raise_value_error_naming_the_tensor():
    q, k, v = qkv(2, 14, 2, 5, 5, 64)
    cases = [
        ((q[0], k, v), r"q must be 4-D .*\(14, 5, 64\)"),
        ((q, k[0], v), r"k must be 4-D"),
        ((q, k, v[0]), r"v must be 4-D"),
        ((q, torch.randn(2, 5, 5, 64), torch.randn(2, 5, 5, 64)), r"H = 14 .* Hkv = 5"),
        ((q, k[..., :32], v[..., :32]), r"q \(2, 14, 5, 64\) and k \(2, 2, 5, 32\)"),
        ((q, k[:1], v[:1]), r"q \(2, 14, 5, 64\) and k \(1, 2, 5, 64\)"),
        ((q, k, v[:, :, :4]), r"k and v .* k \(2, 2, 5, 64\) and v \(2, 2, 4, 64\)"),
    ]
    for args, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            scaled_dot_product_attention(*args)
    for mask in [causal_mask(5, 6), torch.ones(3, 1, 5, 5, dtype=torch.bool), torch.ones(1, 1, 1, 5, 5, dtype=torch.bool)]:
        with pytest.raises(ValueError, match=r"mask of shape .* \(B, H, T, S\) = \(2, 14, 5, 5\)"):
            scaled_dot_product_attention(q, k, v, mask)
    with pytest.raises(ValueError, match="q must be 4-D"):
        attention_weights(q[0], k)


def test_bad_dtypes_raise_type_error():
    q, k, v = qkv(1, 2, 2, 3, 3, 8)
    with pytest.raises(TypeError, match="mask must be a bool"):
        scaled_dot_product_attention(q, k, v, causal_mask(3, 3).float())
    with pytest.raises(TypeError, match="share a dtype"):
        scaled_dot_product_attention(q, k.double(), v)
