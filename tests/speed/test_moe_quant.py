"""Quantized experts and the MoE fast path (notebook 23, minillm/speed/moe.py).

- QuantizedExperts on notebook 12's reference layers (dequantize, then a float product) equals the
  readable loop of minillm/model/moe.py run on the dequantized weights, to rounding: the grouping,
  the routing weights and every expert's own layers are right; planted bugs (two experts swapped,
  the routing weights dropped) fail the same comparison.
- A QuantizedMoeBlock with a shared expert equals the float SparseMoeBlock holding the dequantized
  weights, the router and the shared expert's gate untouched.
- On a Qwen3-MoE with experts 64 wide, built by transformers (the reference): quantize_moe_model and
  FastMoeCausalLM in int8 and int4 stay within quantization's error of transformers' logits, the fast
  path puts A4's kernel under every expert where it builds, and torch.compile gives the eager logits.
- Through minillm.load: quantize and fast on a Qwen3-MoE folder, the int4 drafter's greedy answer is
  the model's own, the engine's batch gives each request alone; narrow experts are refused by name.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import minillm
from minillm.model.moe import MoeCausalLM, MoeConfig, SparseMoeBlock, experts_loop, route
from minillm.runtime.generate import collect
from minillm.speed.cpu_kernel import Int4DotLinear, Int8DotLinear, build_kernel
from minillm.speed.moe import FastMoeCausalLM, QuantizedExperts, QuantizedMoeBlock, quantize_moe_model
from minillm.speed.quant import quantize_linear, quantize_model
from support import qwen_hub_folder

SHAPE = dict(vocab_size=192, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
             norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
             tie_word_embeddings=True, initializer_range=0.02)
# logit error (RMS) over the logits' spread, and top-1 agreement with transformers, on SHAPE at
# std 0.02; measured 0.016 (int8) and 0.107 (int4), every top-1 equal: the bounds leave 2-3x
BOUNDS = {"int8": (0.05, 1.0), "int4": (0.25, 0.95)}


def reference_q(mode):
    return lambda linear, part: quantize_linear(linear, mode, 32, part, "reference")


def dequantized(layers) -> torch.Tensor:
    """The stacked float weights of reference layers: int4's dequantize(), int8's q * scale."""
    return torch.stack([m.dequantize() if hasattr(m, "dequantize") else m.qweight.float() * m.scales[:, None]
                        for m in layers])


@pytest.fixture(scope="module")
def experts():
    torch.manual_seed(0)
    E, h, I = 8, 64, 32
    return torch.randn(E, 2 * I, h) / h**0.5, torch.randn(E, h, I) / I**0.5, torch.randn(E, h) / h**0.5


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("n", [1, 5, 40])
def test_quantized_experts_equal_the_loop_on_their_dequantized_weights(experts, mode, n):
    gate_up, down, router = experts
    x = torch.randn(n, gate_up.shape[-1], generator=torch.Generator().manual_seed(n))
    weights, chosen = route(x, router, 3)
    layer = QuantizedExperts(gate_up, down, reference_q(mode))
    with torch.no_grad():
        want = experts_loop(x, dequantized(layer.gate_up), dequantized(layer.down), weights, chosen)
        torch.testing.assert_close(layer(x, weights, chosen), want, rtol=1e-5, atol=1e-5)


def test_planted_bugs_fail_the_comparison(experts):
    gate_up, down, router = experts
    x = torch.randn(6, gate_up.shape[-1], generator=torch.Generator().manual_seed(7))
    weights, chosen = route(x, router, 3)
    layer = QuantizedExperts(gate_up, down, reference_q("int4"))
    with torch.no_grad():
        want = experts_loop(x, dequantized(layer.gate_up), dequantized(layer.down), weights, chosen)
        swapped = copy.deepcopy(layer)
        swapped.down[0], swapped.down[1] = swapped.down[1], swapped.down[0]  # expert 0's rows through expert 1's down
        for wrong in (swapped(x, weights, chosen), layer(x, torch.ones_like(weights), chosen)):  # or no routing weights
            assert not torch.allclose(wrong, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_block_with_a_shared_expert(mode):
    config = MoeConfig.from_dict(dict(SHAPE, model_type="qwen3_moe", shared_expert_intermediate_size=32))
    torch.manual_seed(1)
    block = SparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    quantized = QuantizedMoeBlock(block, reference_q(mode))
    assert quantized.gate is block.gate and quantized.shared_expert_gate is block.shared_expert_gate  # float, shared
    float_block = copy.deepcopy(block)  # the same block holding the quantized layers' weights, dequantized
    with torch.no_grad():
        float_block.experts.gate_up_proj.copy_(dequantized(quantized.experts.gate_up))
        float_block.experts.down_proj.copy_(dequantized(quantized.experts.down))
        gate, up = dequantized([quantized.shared_expert.gate_up_proj])[0].chunk(2)
        float_block.shared_expert.gate_proj.weight.copy_(gate)
        float_block.shared_expert.up_proj.weight.copy_(up)
        float_block.shared_expert.down_proj.weight.copy_(dequantized([quantized.shared_expert.down_proj])[0])
        x = torch.randn(2, 7, config.hidden_size)
        torch.testing.assert_close(quantized(x), float_block(x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pair():
    """(minillm's MoeCausalLM, transformers' Qwen3MoeForCausalLM) on one copy of seeded random weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE)).eval()
    with torch.device("meta"):
        ours = MoeCausalLM(MoeConfig.from_dict(dict(SHAPE, model_type="qwen3_moe")))
    ours.load_state_dict({k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}, assign=True)
    ours.reset_rope("cpu")
    return ours.eval(), hf


def within_bounds(logits: torch.Tensor, expected: torch.Tensor, mode: str) -> None:
    error = float((logits - expected).pow(2).mean().sqrt() / expected.std())
    agree = float((logits.argmax(-1) == expected.argmax(-1)).float().mean())
    bound, top1 = BOUNDS[mode]
    assert error < bound and agree >= top1, f"{mode}: error {error:.4f} (bound {bound}), top-1 agreement {agree:.3f}"


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("route_", ["quantize_moe_model", "FastMoeCausalLM"])
def test_quantized_models_stay_near_transformers(pair, mode, route_):
    ours, hf = pair
    x = torch.randint(0, SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    model = quantize_moe_model(copy.deepcopy(ours), mode) if route_ == "quantize_moe_model" else FastMoeCausalLM(ours, mode)
    with torch.no_grad():
        within_bounds(model(x), hf(x).logits, mode)
    block = model.model.layers[0].mlp if route_ == "quantize_moe_model" else model.layers[0].mlp
    assert isinstance(block, QuantizedMoeBlock) and ours.model.layers[0].mlp.gate.weight.dtype == torch.float32
    if route_ == "FastMoeCausalLM" and build_kernel() is None:  # A4's kernel under every expert where it builds
        kind = Int4DotLinear if mode == "int4" else Int8DotLinear
        assert all(isinstance(m, kind) for m in [*block.experts.gate_up, *block.experts.down])


def test_the_float_fast_path_is_the_model_and_compiles(pair):
    ours, _ = pair
    x = torch.randint(0, SHAPE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours(x)
        torch.testing.assert_close(FastMoeCausalLM(ours)(x), want, rtol=1e-4, atol=1e-4)
        eager = FastMoeCausalLM(ours, "int4")
        compiled = FastMoeCausalLM(ours, "int4").compile()
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-4)


def test_a_hybrid_moe_and_narrow_experts_are_refused_by_name(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match="group_size 128"):
        quantize_moe_model(copy.deepcopy(ours), "int4", group_size=128)
    narrow = MoeCausalLM(MoeConfig.from_dict(dict(SHAPE, model_type="qwen3_moe", moe_intermediate_size=16)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj: input features K=16 is not a multiple of 32"):
        FastMoeCausalLM(narrow, "int8", kernel="dot8")
    assert isinstance(FastMoeCausalLM(narrow, "int8").layers[0].mlp, QuantizedMoeBlock)  # auto: torch's kernels
    with pytest.raises(ValueError, match="pass quantize_mlp"):
        quantize_model(narrow, "int8")  # notebook 12's pass alone does not know the experts
    with pytest.raises(TypeError, match="Qwen3.5's hybrid layers have no quantized or fast path"):
        quantize_moe_model(torch.nn.Linear(2, 2), "int8")


@pytest.fixture(scope="module")
def folder(pair, tmp_path_factory):
    """The pair's weights as a Qwen3-MoE hub folder (transformers' save_pretrained), with Qwen's tokenizer."""
    _, hf = pair
    saved = tmp_path_factory.mktemp("moe-wide")
    hf.save_pretrained(saved)
    return qwen_hub_folder(saved, tmp_path_factory.mktemp("moe-hub"))


def test_load_quantizes_a_moe_folder_and_its_int4_drafter_keeps_the_answer(folder, pair):
    _, hf = pair
    ids = list(range(3, 23))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    for options, kind in ((dict(quantize="int4"), MoeCausalLM), (dict(quantize="int4", fast=True), FastMoeCausalLM)):
        llm = minillm.load(folder, **options)
        assert type(llm.model) is kind and llm.engine_class.__name__ == "Engine"
        with torch.no_grad():
            within_bounds(llm.model(torch.tensor([ids]))[0], expected, "int4")
    llm = minillm.load(folder)
    plain = collect(llm._steps(ids, None, max_new_tokens=24, eos_token_ids=()))
    drafted = collect(llm._steps(ids, None, speculative="int4", max_new_tokens=24, eos_token_ids=()))
    assert drafted.token_ids == plain.token_ids  # the drafter proposes, the float model decides


def test_the_engine_batches_a_quantized_moe(folder):
    llm = minillm.load(folder, quantize="int8", fast=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    alone = [collect(llm._steps(p, None, max_new_tokens=16, eos_token_ids=())).token_ids for p in prompts]
    engine = llm.engine_class(llm.model, llm.tokenizer, num_blocks=64, block_size=16)
    assert [o["token_ids"] for o in engine.generate(prompts, max_new_tokens=16, eos_token_ids=())] == alone


def test_load_refuses_what_is_not_built_for_experts(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for option in (dict(lora="adapter"), dict(tensor_parallel=1)):
            with pytest.raises(ValueError, match=f"{next(iter(option))}: not built for mixture-of-experts layers yet"):
                minillm.load(folder, **option)
