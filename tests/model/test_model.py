"""minillm.model.decoder against the stored transformers logits of the tiny checkpoints in data/.

Besides matching the reference, the tests plant known bugs and check that the same
comparison then fails: a reference that cannot catch a bug proves nothing.
"""

import itertools

import pytest
import torch
from safetensors.torch import load_file

from support import DATA, TINY
import minillm.model.decoder as model_module
from minillm.model.attention import causal_mask
from minillm.model.layers import RMSNorm
from minillm.model.decoder import CausalLM, ModelConfig, from_folder, load_weights, rope_frequencies
from minillm.model.rope import apply_rope, rope_cos_sin
from support import assert_logits_close


@pytest.fixture(scope="module", params=TINY)
def fixture(request):
    name = request.param
    return name, from_folder(DATA / name), load_file(DATA / name / "reference.safetensors")


def logits_of(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids[None], **kwargs)[0]


def test_logits_match_transformers(fixture):
    name, model, ref = fixture
    for i in range(3):
        assert_logits_close(logits_of(model, ref[f"input_ids_{i}"]), ref[f"logits_{i}"])


def test_rope_speeds_stay_float32_when_the_model_is_cast():
    """inv_freq is computed, not loaded; model.to(bfloat16) rounds it, and forward recomputes it."""
    model = from_folder(DATA / "tiny-llama")
    assert "inv_freq" not in model.state_dict()
    exact = rope_frequencies(model.config)
    model = model.to(torch.bfloat16)
    assert model.inv_freq.dtype == torch.bfloat16  # rounded by the cast
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, exact)


def test_padded_batch_equals_each_prompt_alone():
    model = from_folder(DATA / "tiny-qwen3")
    ref = load_file(DATA / "tiny-qwen3" / "reference.safetensors")
    prompts = [ref["input_ids_2"][:17], ref["input_ids_0"], ref["input_ids_1"]]
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], mask[b, T - len(p) :] = p, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
    for b, p in enumerate(prompts):
        assert torch.isfinite(batched[b]).all()
        assert_logits_close(batched[b, T - len(p) :], logits_of(model, p))


# --- planted bugs: each must make the comparison with transformers fail -------------------


def fails_reference(model, ref, **kwargs):
    ids = ref["input_ids_2"]  # 80 tokens: position and mask bugs need more than one token
    try:
        assert_logits_close(logits_of(model, ids, **kwargs), ref["logits_2"])
    except AssertionError:
        return True
    return False


def test_uniform_position_shift_is_invisible(fixture):
    """RoPE scores depend only on relative positions: shifting every position changes nothing."""
    name, model, ref = fixture
    assert not fails_reference(model, ref, positions=torch.arange(80) + 7)


def test_planted_rope_query_offset_is_caught(fixture, monkeypatch):
    """Queries rotated one position ahead of their keys (the classic cached-decode bug)."""
    name, model, ref = fixture
    shifted = rope_cos_sin(torch.arange(80) + 1, model.inv_freq)
    calls = itertools.count()

    def buggy_apply_rope(x, cos, sin, check=True):
        if next(calls) % 2 == 0:  # Attention.forward rotates q first, then k
            cos, sin = shifted
        return apply_rope(x, cos, sin, check=check)

    monkeypatch.setattr(model_module, "apply_rope", buggy_apply_rope)
    assert fails_reference(model, ref)


def test_planted_causal_mask_off_by_one_is_caught(fixture, monkeypatch):
    name, model, ref = fixture

    def leaky_mask(T, S, start, attention_mask, device):  # each query also sees the next token
        return causal_mask(T, S + 1, start=start + 1, device=device)[:, :S]

    monkeypatch.setattr(model_module, "build_attention_mask", leaky_mask)
    assert fails_reference(model, ref)


@pytest.mark.parametrize("name", ["tiny-qwen2-tied", "tiny-qwen2-untied"])
def test_planted_missing_qkv_bias_is_caught(name):
    model = from_folder(DATA / name)
    ref = load_file(DATA / name / "reference.safetensors")
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    assert fails_reference(model, ref)


def test_planted_missing_qk_norm_is_caught():
    model = from_folder(DATA / "tiny-qwen3")
    ref = load_file(DATA / "tiny-qwen3" / "reference.safetensors")
    for layer in model.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    assert fails_reference(model, ref)


def test_planted_wrong_rms_norm_eps_is_caught():
    """The subtlest planted bug, and the one that bounds the tolerance from above: RMSNorm's eps
    at 1e-5 (a common default) instead of tiny-qwen3's 1e-6 moves the logits by about
    1.5e-4 x std, five times the tolerance (tests/support.py)."""
    model = from_folder(DATA / "tiny-qwen3")
    ref = load_file(DATA / "tiny-qwen3" / "reference.safetensors")
    assert model.config.rms_norm_eps == 1e-6
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.eps = 1e-5
    assert fails_reference(model, ref)


def test_planted_untied_head_is_caught():
    """Using a random lm_head instead of the tied embeddings must be visible."""
    model = from_folder(DATA / "tiny-llama")
    ref = load_file(DATA / "tiny-llama" / "reference.safetensors")
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    assert fails_reference(model, ref)


# --- config and weight errors --------------------------------------------------------------


def test_config_fields_are_read_not_derived():
    qwen3 = ModelConfig.from_json(DATA / "configs" / "Qwen3-0.6B.json")
    assert (qwen3.head_dim, qwen3.hidden_size // qwen3.num_attention_heads) == (128, 64)
    assert qwen3.qk_norm and not qwen3.attention_bias
    qwen25 = ModelConfig.from_json(DATA / "configs" / "Qwen2.5-0.5B-Instruct.json")
    assert qwen25.attention_bias and qwen25.tie_word_embeddings and qwen25.num_key_value_heads == 2
    assert not ModelConfig.from_json(DATA / "configs" / "Qwen2.5-7B-Instruct.json").tie_word_embeddings


def test_config_transformers5_rope_parameters_accepted():
    cfg = {**_llama_dict(), "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    del cfg["rope_theta"]
    assert ModelConfig.from_dict(cfg).rope_theta == 5e5


def _llama_dict():
    import json

    return json.loads((DATA / "tiny-llama" / "config.json").read_text())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, r"model_type 'mistral' is not supported; supported: qwen2, qwen3, llama"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "qwen3"}, "missing field.*head_dim"),
        ({"vocab_size": None}, "missing field.*vocab_size"),
    ],
)
def test_bad_config_names_the_field(change, message):
    cfg = {**_llama_dict(), **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(cfg, source="test config.json")


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "config.json")):
        ModelConfig.from_json(tmp_path)


def test_bad_weights_name_the_tensor():
    config = ModelConfig.from_json(DATA / "tiny-llama")
    good = load_file(DATA / "tiny-llama" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight has shape \(3, 3\), expected \(160, 64\)"):
        load_weights(CausalLM(config), {**good, "model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="missing tensor.*model.norm.weight"):
        load_weights(CausalLM(config), {k: v for k, v in good.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="unexpected tensor.*model.layers.0.self_attn.q_proj.bias"):
        load_weights(CausalLM(config), {**good, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    skipped = load_weights(CausalLM(config), {**good, "lm_head.weight": good["model.embed_tokens.weight"]})
    assert skipped == ["lm_head.weight"]


def test_bad_input_ids_are_rejected():
    model = from_folder(DATA / "tiny-llama")
    with pytest.raises(ValueError, match=r"input_ids must be \(B, T\)"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 320\)"):
        model(torch.tensor([[1, 320]]))
    with pytest.raises(ValueError, match="257 tokens exceed max_position_embeddings 256"):
        model(torch.zeros(1, 257, dtype=torch.long))
