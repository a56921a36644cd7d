"""minillm/model/gated_delta.py against transformers' Qwen3.5 reference functions, on random inputs.

The chunked form must give the recurrent form's outputs and final state (ours and transformers'),
across chunk boundaries (T = 63, 64, 65, 130) and from a non-zero initial state; q and k come with
fewer heads than v (grouped), repeated per value head as the model does (repeat_interleave).

Tolerances: everything here is float32 on inputs of order 1 (unit-length q and k, the state a
sum of a few dozen rank-1 writes of size < 1). The two forms sum the same terms in a different
order (matrix products and a triangular solve against a running loop), so they differ by a few
ulps of the values times the number of terms: measured at most 1.0e-6 (outputs up to 0.35, states
up to 1.4). 1e-5 absolute (and relative) leaves a 10x margin for other CPUs' kernels, while a real
mistake (a decay applied one token late, a missing beta, a lost write) moves them by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from minillm.model.gated_delta import (
    causal_conv1d,
    chunked_gated_delta_rule,
    gated_rms_norm,
    l2norm,
    recurrent_gated_delta_rule,
)

ATOL = RTOL = 1e-5  # float32, see the module docstring


def close(actual, expected, what=""):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def inputs(T: int, B: int = 2, Hk: int = 2, Hv: int = 4, Dk: int = 16, Dv: int = 8, seed: int = 0):
    """q, k (B, T, Hk, Dk) unit length; v (B, T, Hv, Dv); g <= 0 and beta in (0, 1) (B, T, Hv); a state."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, Hk, Dk, generator=gen))
    k = l2norm(torch.randn(B, T, Hk, Dk, generator=gen))
    v = torch.randn(B, T, Hv, Dv, generator=gen)
    g = -F.softplus(torch.randn(B, T, Hv, generator=gen)) * 0.5  # decays exp(g) in about (0.3, 1)
    beta = torch.sigmoid(torch.randn(B, T, Hv, generator=gen))
    state = torch.randn(B, Hv, Dk, Dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


def grouped(x: torch.Tensor, Hv: int) -> torch.Tensor:
    """Key heads repeated for their value heads, as GatedDeltaNet does before the rule."""
    return x.repeat_interleave(Hv // x.shape[2], dim=2)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("heads", [(2, 4), (3, 3)], ids=["grouped", "equal"])
def test_chunked_equals_recurrent_and_transformers(T, heads):
    Hk, Hv = heads
    q, k, v, g, beta, state = inputs(T, Hk=Hk, Hv=Hv)
    qg, kg = grouped(q, Hv), grouped(k, Hv)
    out_r, s_r = recurrent_gated_delta_rule(qg, kg, v, g, beta, state)
    out_c, s_c = chunked_gated_delta_rule(qg, kg, v, g, beta, state)
    hf_r, hs_r = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state.clone(),
                                                     output_final_state=True)
    hf_c, hs_c = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state.clone(),
                                                 output_final_state=True)
    assert out_c.shape == out_r.shape == (2, T, Hv, 8) and s_c.shape == s_r.shape == (2, Hv, 16, 8)
    assert out_c.dtype == s_c.dtype == torch.float32
    close(out_c, out_r, "chunked vs recurrent out")
    close(s_c, s_r, "chunked vs recurrent state")
    close(out_r, hf_r, "recurrent vs transformers' recurrent out")
    close(s_r, hs_r, "recurrent vs transformers' recurrent state")
    close(out_c, hf_c, "chunked vs transformers' chunked out")
    close(s_c, hs_c, "chunked vs transformers' chunked state")


def test_no_state_means_zeros_and_the_state_matters():
    q, k, v, g, beta, state = inputs(70)
    q, k = grouped(q, 4), grouped(k, 4)
    zero = torch.zeros_like(state)
    for rule in (recurrent_gated_delta_rule, chunked_gated_delta_rule):
        out_none, s_none = rule(q, k, v, g, beta)
        out_zero, s_zero = rule(q, k, v, g, beta, zero)
        close(out_none, out_zero, rule.__name__)
        close(s_none, s_zero, rule.__name__)
        out_state, _ = rule(q, k, v, g, beta, state)
        assert (out_state - out_none).abs().max() > 1e-2  # the initial state is read, not ignored


def test_split_sequence_carries_the_state():
    """Running 100 tokens as 37 + 63, passing the state on, is running them at once."""
    q, k, v, g, beta, state = inputs(100)
    q, k = grouped(q, 4), grouped(k, 4)
    whole, s_whole = chunked_gated_delta_rule(q, k, v, g, beta, state)
    first, s1 = chunked_gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state)
    second, s2 = recurrent_gated_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], s1)
    close(torch.cat([first, second], dim=1), whole)
    close(s2, s_whole)


@pytest.mark.parametrize("K", [2, 4])
def test_causal_conv1d_in_two_calls_equals_one_and_conv1d(K):
    """The carried conv state (the last K-1 inputs) makes two calls one; both are the causal
    depthwise convolution F.conv1d(padding=K-1) keeps the first T outputs of, then silu."""
    gen = torch.Generator().manual_seed(1)
    B, C, T = 2, 6, 11
    x = torch.randn(B, C, T, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    reference = F.silu(F.conv1d(x, weight[:, None, :], padding=K - 1, groups=C)[..., :T])
    whole, state = causal_conv1d(x, weight)
    close(whole, reference, "one call")
    assert state.shape == (B, C, K - 1)
    torch.testing.assert_close(state, x[..., -(K - 1):], atol=0, rtol=0)
    a, state_a = causal_conv1d(x[..., :5], weight)
    b, state_b = causal_conv1d(x[..., 5:], weight, state_a)
    close(torch.cat([a, b], dim=-1), reference, "two calls")
    torch.testing.assert_close(state_b, state)
    single = [causal_conv1d(x[..., :1], weight)]  # token by token, as decode runs
    for t in range(1, T):
        single.append(causal_conv1d(x[..., t : t + 1], weight, single[-1][1]))
    close(torch.cat([out for out, _ in single], dim=-1), reference, "token by token")


def test_causal_conv1d_state_is_not_ignored():
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(1, 3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    assert (causal_conv1d(x, weight, torch.ones(1, 3, 3))[0] - causal_conv1d(x, weight)[0]).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_equals_transformers(dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 5, 4, 8, generator=gen) * 3).to(dtype)
    gate = torch.randn(2, 5, 4, 8, generator=gen).to(dtype)
    norm = hf.Qwen3_5RMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, generator=gen) + 1)
    norm = norm.to(dtype)
    with torch.no_grad():
        expected = norm(x, gate)
    actual = gated_rms_norm(x, gate, norm.weight.detach(), 1e-6)
    assert actual.dtype == dtype
    if dtype == torch.float32:
        close(actual, expected)
    else:  # the same roundings in the same order: bit for bit
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_l2norm_equals_transformers():
    x = torch.randn(3, 7, 2, 16, generator=torch.Generator().manual_seed(4)) * 5
    x[0, 0, 0] = 0  # eps keeps a zero vector finite
    out = l2norm(x)
    close(out, hf.l2norm(x))
    assert torch.isfinite(out).all()
    close(out[1:].norm(dim=-1), torch.ones(2, 7, 2))
