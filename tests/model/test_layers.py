"""minillm.model.layers against transformers' Qwen2RMSNorm, Qwen2MLP and LlamaMLP, and torch ops."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

from minillm.model.layers import MLP, RMSNorm, rms_norm

SHAPES = [(64,), (3, 64), (2, 7, 64), (2, 3, 5, 32), (1, 1, 896)]


def norm_pair(hidden, eps, hf_class=Qwen2RMSNorm, seed=0):
    """Our RMSNorm and HF's, with the same non-trivial weight loaded by name."""
    torch.manual_seed(seed)
    ours = RMSNorm(hidden, eps=eps)
    with torch.no_grad():
        ours.weight.copy_(1 + 0.3 * torch.randn(hidden))
    theirs = hf_class(hidden, eps=eps)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def mlp_pair(hf_class, config, seed=0):
    """Our MLP and HF's, with HF's random weights loaded into ours by name (strict)."""
    torch.manual_seed(seed)
    theirs = hf_class(config)
    with torch.no_grad():
        for p in theirs.parameters():  # spread the weights so differences show
            p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    ours = MLP(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs


def qwen2_config():
    return Qwen2Config(
        hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, hidden_act="silu"
    )


def in_input_dtype(x, weight, eps):
    """Planted bug: the whole RMSNorm in x's dtype (bf16 mean of squares), no fp32."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


# RMSNorm --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_matches_hf_fp32(shape, eps):
    ours, theirs = norm_pair(shape[-1], eps)
    x = 3 * torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)
        torch.testing.assert_close(rms_norm(x, ours.weight, eps), theirs(x), atol=1e-6, rtol=0)


def test_rms_norm_matches_llama_rms_norm():
    ours, theirs = norm_pair(576, 1e-5, hf_class=LlamaRMSNorm)
    x = torch.randn(2, 9, 576)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_matches_torch_rms_norm_fp32(shape, eps):
    torch.manual_seed(1)
    x, w = 5 * torch.randn(shape), 1 + 0.3 * torch.randn(shape[-1])
    torch.testing.assert_close(rms_norm(x, w, eps), F.rms_norm(x, (shape[-1],), w, eps), atol=1e-6, rtol=0)


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_bf16_equals_hf_exactly(eps):
    ours, theirs = norm_pair(896, eps)
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    x = (3 * torch.randn(4, 16, 896)).to(torch.bfloat16)
    with torch.no_grad():
        y, ref = ours(x), theirs(x)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, atol=0, rtol=0)


def test_planted_bug_rms_norm_in_bf16_is_caught():
    ours, theirs = norm_pair(896, 1e-6)
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    x = (3 * torch.randn(4, 16, 896)).to(torch.bfloat16)
    with torch.no_grad():
        ref = theirs(x)
        buggy = in_input_dtype(x, ours.weight, ours.eps)
    assert buggy.dtype == torch.bfloat16
    with pytest.raises(AssertionError):
        torch.testing.assert_close(buggy, ref, atol=0, rtol=0)


def test_planted_bug_eps_ignored_is_caught_at_small_activations():
    ours, theirs = norm_pair(896, 1e-6)
    ignore_eps = lambda x: rms_norm(x, ours.weight, 0.0)
    with torch.no_grad():
        normal = torch.randn(4, 896)
        # at ordinary scales dropping eps changes outputs by about eps / (2 mean(x^2)) relative ...
        torch.testing.assert_close(ignore_eps(normal), theirs(normal), atol=0, rtol=2e-6)
        small = 1e-3 * torch.randn(4, 896)  # RMS ~ sqrt(eps)
        torch.testing.assert_close(ours(small), theirs(small), atol=1e-6, rtol=0)
        # ... but at small activations dropping it is caught
        with pytest.raises(AssertionError):
            torch.testing.assert_close(ignore_eps(small), theirs(small), atol=1e-6, rtol=0)


def test_rms_norm_zero_input_is_zero_not_nan():
    y = RMSNorm(16)(torch.zeros(2, 16))
    assert torch.equal(y, torch.zeros(2, 16))


def test_rms_norm_keeps_shape_dtype_and_weight_name():
    norm = RMSNorm(32, eps=1e-5)
    assert list(norm.state_dict()) == ["weight"] and torch.equal(norm.weight, torch.ones(32))
    assert norm.eps == 1e-5 and RMSNorm(8).eps == 1e-6
    x = torch.randn(2, 3, 32).to(torch.bfloat16)
    y = norm(x)  # fp32 weight, bf16 input: output stays bf16
    assert y.shape == x.shape and y.dtype == torch.bfloat16


def test_rms_norm_wrong_hidden_size_raises():
    # The module does not check per call (it runs twice per layer per token); torch's broadcast names both sizes.
    with pytest.raises(RuntimeError, match=r"576.*896|896.*576"):
        RMSNorm(896)(torch.randn(2, 576))


def test_rms_norm_functional_bad_weight_shape_raises():
    with pytest.raises(ValueError, match=r"weight.*\(64,\).*\(32,\)"):
        rms_norm(torch.randn(3, 64), torch.ones(32), 1e-6)


# MLP ------------------------------------------------------------------------------------


def test_mlp_matches_qwen2_mlp():
    config = qwen2_config()
    ours, theirs = mlp_pair(Qwen2MLP, config)
    assert list(ours.state_dict()) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_mlp_matches_llama_mlp(mlp_bias):
    config = LlamaConfig(
        hidden_size=48, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        hidden_act="silu", mlp_bias=mlp_bias,
    )
    ours, theirs = mlp_pair(LlamaMLP, config)
    x = torch.randn(3, 5, 48)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)


def test_planted_bug_gate_and_up_swapped_is_caught():
    config = qwen2_config()
    ours, theirs = mlp_pair(Qwen2MLP, config)
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        swapped = ours.down_proj(F.silu(ours.up_proj(x)) * ours.gate_proj(x))
        with pytest.raises(AssertionError):
            torch.testing.assert_close(swapped, theirs(x), atol=1e-6, rtol=0)


def test_mlp_parameter_counts_of_real_configs():
    with torch.device("meta"):
        for h, inter in [(896, 4864), (576, 1536)]:  # Qwen2.5-0.5B, SmolLM2-135M
            mlp = MLP(h, inter)
            assert sum(p.numel() for p in mlp.parameters()) == 3 * h * inter
            assert mlp.gate_proj.weight.shape == (inter, h) and mlp.down_proj.weight.shape == (h, inter)


def test_mlp_wrong_hidden_size_raises():
    # No per-call check (see above): gate_proj's matmul names both sizes.
    with pytest.raises(RuntimeError, match=r"896.*576|576.*896"):
        MLP(576, 1536)(torch.randn(2, 896))
