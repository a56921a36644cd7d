"""minillm/model/moe.py (notebook 23) against transformers: the router, the experts (the loop and the
grouped fast path), the MoE blocks of Qwen3-MoE and Qwen3.5-MoE (its shared expert), and the two
models, on the stored logits of data/qwen3_moe-tiny and data/qwen3_5_moe-tiny and on random configs
run live (a dense layer among sparse ones, norm_topk_prob false, bfloat16).

Planted bugs each make a comparison with transformers fail: the renormalisation dropped, the top k
taken from the logits before the softmax (which only a model without renormalisation can show),
and the shared expert's gate dropped.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

import minillm.model.moe as moe
from minillm.cache.hybrid import make_hybrid_cache
from minillm.model.moe import (HybridMoeCausalLM, HybridMoeConfig, MoeCausalLM, MoeConfig, SparseMoeBlock,
                               experts_grouped, experts_loop, grouped_matmul, route)
from minillm.runtime.generate import generate
from minillm.weights.moe import load_moe_folder
from support import DATA, HYBRID_REL, TINY_REL, ByteTokenizer, assert_logits_close, logits_tolerance

QWEN3_MOE, QWEN3_5_MOE = DATA / "qwen3_moe-tiny", DATA / "qwen3_5_moe-tiny"
REL = {QWEN3_MOE: TINY_REL, QWEN3_5_MOE: HYBRID_REL}  # the hybrid's DeltaNet rounds more (tests/support.py)


def load(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Qwen3.5-MoE's vision tower, skipped: tests/weights/test_moe_checkpoints.py checks it
        return load_moe_folder(folder, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module", params=[QWEN3_MOE, QWEN3_5_MOE], ids=["qwen3_moe", "qwen3_5_moe"])
def folder(request):
    return request.param


def max_error(model, folder) -> float:
    """The largest |logit - transformers'| over the stored prompts, in units of each one's tolerance."""
    ref, worst = load_file(folder / "reference.safetensors"), 0.0
    for i in range(3):
        with torch.no_grad():
            got = model(ref[f"input_ids_{i}"][None])[0]
        worst = max(worst, float((got - ref[f"logits_{i}"]).abs().max()) / logits_tolerance(ref[f"logits_{i}"], REL[folder]))
    return worst


# --- the stored references ------------------------------------------------------------------


@pytest.mark.parametrize("i", range(3), ids=["T1", "T9", "T80"])
def test_logits_match_transformers(folder, i):
    model, ref = load(folder), load_file(folder / "reference.safetensors")
    with torch.no_grad():
        got = model(ref[f"input_ids_{i}"][None])[0]
    assert_logits_close(got, ref[f"logits_{i}"], rel=REL[folder], msg=f"{folder.name} prompt {i}")


@pytest.mark.parametrize("i", range(3), ids=["T1", "T9", "T80"])
def test_32_greedy_tokens_with_the_cache(folder, i):
    """transformers recomputed the whole sequence per token; here the KV cache (and the DeltaNet state)
    carries it, and every decode step routes one token alone."""
    model, ref = load(folder), load_file(folder / "reference.safetensors")
    cache = make_hybrid_cache if folder == QWEN3_5_MOE else None
    done = generate(model, ByteTokenizer(), ref[f"input_ids_{i}"].tolist(), max_new_tokens=32, eos_token_ids=(),
                    **({"cache_factory": cache} if cache else {}))
    assert done.token_ids == ref[f"greedy_{i}"].tolist()


def test_the_models_are_what_the_folders_say():
    assert type(load(QWEN3_MOE)) is MoeCausalLM and type(load(QWEN3_5_MOE)) is HybridMoeCausalLM
    assert load(QWEN3_MOE).config.norm_topk_prob and load(QWEN3_5_MOE).config.norm_topk_prob
    assert load(QWEN3_5_MOE).config.shared_expert_intermediate_size == 32


# --- planted bugs -------------------------------------------------------------------------


def test_the_correct_models_are_well_within_the_tolerance(folder):
    assert max_error(load(folder), folder) < 0.5


def no_renormalisation(x, weight, top_k, norm_topk_prob=True):
    return route(x, weight, top_k, norm_topk_prob=False)


def top_k_of_the_logits(x, weight, top_k, norm_topk_prob=True):
    """The top k logits first, then a softmax over those k: renormalised weights whatever norm_topk_prob says."""
    logits, experts = F.linear(x, weight).topk(top_k, dim=-1)
    return torch.softmax(logits.float(), dim=-1).to(x.dtype), experts


@pytest.mark.parametrize("bug", [no_renormalisation])
def test_planted_router_bug_is_caught(folder, bug, monkeypatch):
    monkeypatch.setattr(moe, "route", bug)
    assert max_error(load(folder), folder) > 3


def test_top_k_before_the_softmax_hides_when_renormalising(folder, monkeypatch):
    """Both tiny checkpoints renormalise, as Qwen3-30B-A3B and every Qwen3.5-MoE do: there the wrong
    order gives the same weights, which is why the next test runs a model that does not."""
    monkeypatch.setattr(moe, "route", top_k_of_the_logits)
    assert max_error(load(folder), folder) < 0.5


def test_planted_top_k_before_the_softmax_is_caught_without_renormalisation(monkeypatch):
    theirs = transformers_qwen3_moe(norm_topk_prob=False)
    ours = ours_from(theirs)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
        assert_logits_close(ours(ids), expected)
        monkeypatch.setattr(moe, "route", top_k_of_the_logits)
        assert (ours(ids) - expected).abs().max() > 10 * logits_tolerance(expected)


def test_planted_shared_expert_gate_dropped_is_caught(monkeypatch):
    def ungated(self, x):
        flat = x.reshape(-1, x.shape[-1])
        return (self.experts(flat, *self.gate(flat)) + self.shared_expert(flat)).view_as(x)

    monkeypatch.setattr(SparseMoeBlock, "forward", ungated)
    assert max_error(load(QWEN3_5_MOE), QWEN3_5_MOE) > 3


# --- live against transformers ---------------------------------------------------------------


def transformers_qwen3_moe(**overrides):
    """A random Qwen3MoeForCausalLM with spread weights (as tools/make_reference_data.py makes them)."""
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=6, num_experts_per_tok=2,
               moe_intermediate_size=12, norm_topk_prob=True, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**(cfg | overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn(p.shape) if name.endswith("norm.weight")
                    else torch.randn(p.shape) * (0.5 if p.ndim == 2 and "embed" in name else 1.2 / p.shape[-1] ** 0.5))
    return model


def ours_from(theirs) -> MoeCausalLM:
    """Our model from transformers' config dict and state dict (same names: stacked experts)."""
    config = MoeConfig.from_dict(theirs.config.to_dict(), source="transformers")
    ours = MoeCausalLM(config).eval()
    ours.load_state_dict(theirs.state_dict())
    return ours


@pytest.mark.parametrize("overrides", [dict(), dict(norm_topk_prob=False), dict(mlp_only_layers=[1]),
                                       dict(decoder_sparse_step=2), dict(num_experts_per_tok=6)],
                         ids=["all-sparse", "no-renorm", "a-dense-layer", "every-second-layer", "k-equals-E"])
def test_random_qwen3_moe_matches_transformers(overrides):
    theirs = transformers_qwen3_moe(**overrides)
    ours = ours_from(theirs)
    sparse = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert sparse == [type(layer.mlp).__name__.removeprefix("Qwen3Moe") for layer in theirs.model.layers]
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_close(ours(ids), theirs(ids).logits)


@pytest.mark.parametrize("norm", [True, False])
def test_route_equals_transformers_router(norm):
    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(50, 32)
    _, their_weights, their_experts = router(x)
    weights, experts = route(x, router.weight, 4, norm)
    assert torch.equal(experts, their_experts)
    torch.testing.assert_close(weights, their_weights, rtol=0, atol=1e-6)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_loop_and_grouped_equal_transformers_experts(implementation, dtype, tokens):
    """transformers' two experts implementations on CPU: its eager loop and its default, grouped_mm."""
    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16)
    cfg._experts_implementation = implementation
    experts = Qwen3MoeExperts(cfg).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    x = torch.randn(tokens, 32).to(dtype)
    weights, chosen = route(x, torch.randn(8, 32).to(dtype), 3)
    with torch.no_grad():
        expected = experts(x, chosen, weights)
        for form in (experts_loop, experts_grouped):
            got = form(x, experts.gate_up_proj, experts.down_proj, weights, chosen)
            tolerance = 1e-6 if dtype == torch.float32 else 2e-2 * float(expected.abs().max())
            torch.testing.assert_close(got, expected, rtol=0, atol=tolerance, msg=form.__name__)


@pytest.mark.parametrize("a, b", [(8, 4), (6, 5)], ids=["aligned", "strides-off-16-bytes"])
def test_grouped_matmul_with_and_without_grouped_mm(a, b, monkeypatch):
    """grouped_mm where it takes the strides, the loop elsewhere (and on CUDA before Hopper): one result,
    empty groups included."""
    x, w = torch.randn(10, a), torch.randn(4, a, b)
    ends = torch.tensor([2, 2, 7, 10], dtype=torch.int32)
    expected = torch.cat([x[:2] @ w[0], x[2:7] @ w[2], x[7:] @ w[3]])
    assert moe._grouped_mm_takes(x, w) == (a == 8)
    torch.testing.assert_close(grouped_matmul(x, w, ends), expected)
    monkeypatch.delattr(F, "grouped_mm")
    torch.testing.assert_close(grouped_matmul(x, w, ends), expected)


def test_qwen3_5_moe_block_equals_transformers():
    """The MoE block with its gated shared expert, weights copied from transformers' (same names)."""
    cfg = Qwen3_5MoeTextConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
                               shared_expert_intermediate_size=20)
    theirs = Qwen3_5MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    ours = SparseMoeBlock(HybridMoeConfig.from_dict(dict(cfg.to_dict(), intermediate_size=1, layer_types=None,
                                                         num_hidden_layers=4), source="transformers"))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)


# --- configs ------------------------------------------------------------------------------


def test_hybrid_config_reads_the_nested_text_config():
    config = HybridMoeConfig.from_json(QWEN3_5_MOE)
    assert (config.model_type, config.layer_types) == ("qwen3_5_moe", ("linear_attention", "full_attention"))
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 3, 16)
    assert config.intermediate_size == 16 and config.norm_topk_prob  # none in the file: every layer is sparse


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 is more than num_experts 8"),
    (dict(num_experts=0), "num_experts must be a positive integer"),
    (dict(moe_intermediate_size="16"), "moe_intermediate_size must be a positive integer"),
    (dict(mlp_only_layers=[2]), r"mlp_only_layers \[2\] are not layers of this model"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer"),
    (dict(model_type="qwen3"), "model_type 'qwen3' is not qwen3_moe"),
])
def test_bad_config_names_the_field(change, message):
    base = json.loads((QWEN3_MOE / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        MoeConfig.from_dict(base | change, source="config.json")


def test_missing_moe_fields_are_named():
    base = json.loads((QWEN3_MOE / "config.json").read_text())
    del base["num_experts"], base["moe_intermediate_size"]
    with pytest.raises(ValueError, match="missing field.*num_experts, moe_intermediate_size"):
        MoeConfig.from_dict(base, source="config.json")
    hybrid = json.loads((QWEN3_5_MOE / "config.json").read_text())
    del hybrid["text_config"]["num_experts_per_tok"]
    with pytest.raises(ValueError, match="missing field.*num_experts_per_tok"):
        HybridMoeConfig.from_dict(hybrid, source="config.json")
