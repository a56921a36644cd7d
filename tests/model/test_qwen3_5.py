"""minillm/model/qwen3_5.py (Qwen3.5's hybrid text model) against transformers' stored logits and
greedy tokens for the tiny checkpoint data/qwen3_5-tiny (tools/make_reference_data.py).

The stored prompts are 1, 9, 80 and 140 tokens long: the two long ones cross the DeltaNet's
64-token chunk boundary (140 crosses two). Besides matching the reference, the tests plant bugs
specific to Qwen3.5 and check that the same comparison then fails, as tests/model/test_model.py
does for the plain decoder; then the cache's misuse, the config's errors and the real
Qwen3.5-0.8B config (its parameter count against transformers' on the meta device).
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

import minillm.model.qwen3_5 as qwen3_5
from minillm.cache.dense import make_cache
from minillm.cache.hybrid import make_hybrid_cache
from minillm.model.gated_delta import CHUNK_SIZE
from minillm.model.qwen3_5 import HybridCausalLM, HybridConfig, ZeroCentredRMSNorm
from minillm.runtime.generate import generate
from minillm.weights.hybrid import load_hybrid_folder
from support import DATA, HYBRID_REL, ByteTokenizer, assert_logits_close, logits_tolerance

FOLDER = DATA / "qwen3_5-tiny"
REF = load_file(FOLDER / "reference.safetensors")
PROMPTS = [REF[f"input_ids_{i}"] for i in range(4)]
LENGTHS = (1, 9, 80, 140)


def load():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped vision tower: tests/weights/test_hybrid.py checks it
        return load_hybrid_folder(FOLDER, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def model():
    """Shared and read-only; a test that changes the model loads its own (load())."""
    return load()


def logits_of(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids[None], **kwargs)[0]


def test_stored_prompts_are_the_expected_lengths():
    assert [len(p) for p in PROMPTS] == list(LENGTHS)
    assert CHUNK_SIZE == 64


@pytest.mark.parametrize("i", range(4), ids=[f"T{n}" for n in LENGTHS])
def test_logits_match_transformers(model, i):
    assert_logits_close(logits_of(model, PROMPTS[i]), REF[f"logits_{i}"], msg=f"prompt {i}", rel=HYBRID_REL)


@pytest.mark.parametrize("i", range(4), ids=[f"T{n}" for n in LENGTHS])
def test_32_greedy_tokens_through_the_hybrid_cache(model, i):
    """generate(): the prompt prefilled (chunked rule), then 31 single-token steps (recurrent rule)
    through the LinearStates and KV caches, equal transformers' full-recompute greedy tokens."""
    done = generate(model, ByteTokenizer(), PROMPTS[i].tolist(), max_new_tokens=32, eos_token_ids=(),
                    cache_factory=make_hybrid_cache)
    assert done.token_ids == REF[f"greedy_{i}"].tolist()


def test_direct_decode_loop_matches_a_full_forward(model):
    """Each cached decode step's logits equal one full forward over prompt + tokens so far (teacher forced)."""
    prompt, greedy = PROMPTS[1], REF["greedy_1"]
    cache = make_hybrid_cache(model.config, 1, len(prompt) + 32)
    full = logits_of(model, torch.cat([prompt, greedy[:-1]]))  # (9 + 31, V)
    with torch.no_grad():
        steps = [model(prompt[None], cache=cache, start_pos=0)[0, -1]]
        for t in range(31):
            steps.append(model(greedy[t].view(1, 1), cache=cache, start_pos=len(prompt) + t)[0, -1])
    assert_logits_close(torch.stack(steps), full[len(prompt) - 1 :], rel=HYBRID_REL)
    assert torch.stack(steps).argmax(-1).tolist() == greedy.tolist()


def test_chunked_prefill_across_calls(model):
    """140 tokens as 50 + 90 (the second call starts inside a chunk from a carried state and crosses
    a boundary, so its chunk grid is not the one call's) give the one call's last logits.

    Every position, at the hybrid's tolerance (HYBRID_REL, tests/support.py: float32 rounding alone
    moves some middle positions by up to 2 x TINY_REL between these two correct paths; computed in
    float64, the split equals the whole to 1e-13)."""
    ids = PROMPTS[3]
    cache = make_hybrid_cache(model.config, 1, len(ids))
    with torch.no_grad():
        first = model(ids[None, :50], cache=cache, start_pos=0)[0]
        second = model(ids[None, 50:], cache=cache, start_pos=50)[0]
    assert second.shape == (90, model.config.vocab_size)
    whole = logits_of(model, ids)
    assert_logits_close(torch.cat([first, second]), whole, rel=HYBRID_REL)
    assert_logits_close(torch.cat([first, second]), REF["logits_3"], rel=HYBRID_REL)
    assert all(s.tokens == 140 for s in qwen3_5.linear_states(model.config, cache))


def test_a_new_prompt_at_position_0_resets_the_states(model):
    cache = make_hybrid_cache(model.config, 1, 140)
    with torch.no_grad():
        model(PROMPTS[3][None, :70], cache=cache, start_pos=0)
        again = model(PROMPTS[2][None], cache=cache, start_pos=0)[0]
    assert_logits_close(again, REF["logits_2"], rel=HYBRID_REL)


def test_left_padded_batch_equals_each_prompt_alone(model):
    """Padding must neither reach the attention nor enter a DeltaNet state (nor its conv window)."""
    prompts = [PROMPTS[2], PROMPTS[1]]
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], mask[b, T - len(p) :] = p, 1
        ids[b, : T - len(p)] = 7  # a pad id whose embedding is not zero
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
    for b, p in enumerate(prompts):
        assert torch.isfinite(batched[b]).all()
        assert_logits_close(batched[b, T - len(p) :], logits_of(model, p), msg=f"row {b}", rel=HYBRID_REL)
    assert_logits_close(batched[0], REF["logits_2"], rel=HYBRID_REL)
    assert_logits_close(batched[1, T - 9 :], REF["logits_1"], rel=HYBRID_REL)


def test_left_padded_batch_with_the_cache_then_decode(model):
    """A padded prefill into the hybrid cache, then a step for both rows, equals each alone."""
    prompts, nxt = [PROMPTS[2], PROMPTS[1]], torch.tensor([[5], [9]])
    T = 80
    ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T + 1, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], mask[b, T - len(p) :] = p, 1
    cache = make_hybrid_cache(model.config, 2, T + 1)
    with torch.no_grad():
        model(ids, attention_mask=mask[:, :T], cache=cache)
        step = model(nxt, attention_mask=mask, cache=cache, start_pos=T)[:, -1]
    for b, p in enumerate(prompts):
        assert_logits_close(step[b], logits_of(model, torch.cat([p, nxt[b]]))[-1], msg=f"row {b}", rel=HYBRID_REL)


# --- planted bugs: each must make the comparison with transformers fail -------------------


def max_error_over_tolerance(model, i: int) -> float:
    """max |ours - transformers'| on stored prompt i, in units of the hybrid tolerance (> 1 fails)."""
    ref = REF[f"logits_{i}"]
    return float((logits_of(model, PROMPTS[i]) - ref).abs().max()) / logits_tolerance(ref, HYBRID_REL)


def fails_reference(model, i: int = 2) -> bool:
    try:
        assert_logits_close(logits_of(model, PROMPTS[i]), REF[f"logits_{i}"], rel=HYBRID_REL)
    except AssertionError:
        return True
    return False


def test_the_correct_model_is_well_within_the_tolerance(model):
    """The other side of the planted bugs: the correct model sits below the tolerance everywhere."""
    assert max(max_error_over_tolerance(model, i) for i in range(4)) < 1


def test_planted_no_decay_is_caught():
    """A_log = -inf: exp(A_log) = 0, so g = 0 and the states never forget."""
    model = load()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.layer_type == "linear_attention":
                layer.linear_attn.A_log.fill_(float("-inf"))
    assert fails_reference(model, 2)
    assert max_error_over_tolerance(model, 2) > 10


def lossy_chunk_boundaries(rule):
    """chunked_gated_delta_rule run chunk by chunk, passing on to the next chunk the state after only
    the first 63 tokens of each 64: the write of each chunk's last token is lost."""

    def buggy(q, k, v, g, beta, state=None, chunk_size=CHUNK_SIZE):
        outs = []
        for start in range(0, q.shape[1], chunk_size):
            part = [x[:, start : start + chunk_size] for x in (q, k, v, g, beta)]
            out, final = rule(*part, state)
            outs.append(out)
            state = rule(*[x[:, : chunk_size - 1] for x in part], state)[1] if out.shape[1] == chunk_size else final
        return torch.cat(outs, dim=1), state

    return buggy


def test_planted_chunk_boundary_off_by_one_is_caught(monkeypatch):
    """Prompts that fit in one chunk (1, 9 tokens) cannot see it; those that cross (80, 140) must."""
    model = load()
    monkeypatch.setattr(qwen3_5, "chunked_gated_delta_rule", lossy_chunk_boundaries(qwen3_5.chunked_gated_delta_rule))
    assert not fails_reference(model, 0)
    assert not fails_reference(model, 1)
    assert fails_reference(model, 2)
    assert fails_reference(model, 3)
    assert max_error_over_tolerance(model, 3) > 10


def test_planted_missing_output_gate_is_caught(monkeypatch):
    model = load()
    monkeypatch.setattr(qwen3_5, "output_gate", lambda out, gate: out)
    assert fails_reference(model, 2)
    assert max_error_over_tolerance(model, 2) > 10


def test_planted_rope_on_the_whole_head_is_caught(monkeypatch):
    """RoPE on all D dims instead of the first 25%."""
    model = load()
    monkeypatch.setattr(HybridConfig, "rotary_dim", property(lambda self: self.head_dim))
    model.reset_rope()
    assert model.inv_freq.shape == (model.config.head_dim // 2,)
    assert fails_reference(model, 2)
    assert max_error_over_tolerance(model, 2) > 10


def test_planted_norm_without_the_one_is_caught(monkeypatch):
    """RMSNorm scaling by w instead of (1 + w) (the zero-centred weights read as plain ones)."""

    def plain(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)

    model = load()
    monkeypatch.setattr(ZeroCentredRMSNorm, "forward", plain)
    assert fails_reference(model, 2)
    assert max_error_over_tolerance(model, 2) > 10


# --- cache misuse ----------------------------------------------------------------------------


def test_forward_must_continue_where_the_state_stopped(model):
    cache = make_hybrid_cache(model.config, 1, 32)
    with torch.no_grad():
        model(PROMPTS[1][None], cache=cache, start_pos=0)  # 9 tokens
        for wrong in (8, 10):
            with pytest.raises(ValueError, match=f"holds 9 tokens; a forward at start_pos {wrong}"):
                model(torch.tensor([[3]]), cache=cache, start_pos=wrong)
        model(torch.tensor([[3]]), cache=cache, start_pos=9)  # the right one still works


def test_a_kv_only_cache_is_refused(model):
    cache = make_cache(model.config, 1, 32)
    with pytest.raises(ValueError, match="make_hybrid_cache"):
        with torch.no_grad():
            model(PROMPTS[1][None], cache=cache, start_pos=0)


# --- config ----------------------------------------------------------------------------------


def tiny_config() -> dict:
    return json.loads((FOLDER / "config.json").read_text())


def test_tiny_config_reads_the_nested_text_config():
    config = HybridConfig.from_json(FOLDER)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (config.hidden_size, config.head_dim, config.rotary_dim) == (64, 32, 8)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (16, 8)
    assert config.tie_word_embeddings and config.rope_theta == 1e7 and config.rope_scaling is None


def changed(change: dict, drop: tuple = ()) -> dict:
    cfg = tiny_config()
    cfg["text_config"] |= change
    for name in drop:
        del cfg["text_config"][name]
    return cfg


@pytest.mark.parametrize("cfg, message", [
    (changed({"layer_types": ["linear_attention"] * 3}), "layer_types lists 3 layers, num_hidden_layers is 4"),
    (changed({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]}),
     r"layer_types \['sliding_attention'\] are not supported"),
    (changed({"linear_num_value_heads": 3}), "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    (changed({}, drop=("hidden_size",)), r"missing field\(s\) hidden_size"),
    (changed({}, drop=("head_dim",)), r"missing field\(s\) head_dim"),
    (changed({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0}}), "rope_type 'yarn'"),
    ({**tiny_config(), "model_type": "qwen3_next"}, "model_type 'qwen3_next'"),
], ids=["layer_types-length", "unknown-layer-type", "value-heads", "missing-hidden_size", "missing-head_dim",
        "rope_type", "model_type"])
def test_bad_config_names_the_field(cfg, message):
    with pytest.raises(ValueError, match=message) as info:
        HybridConfig.from_dict(cfg, source="test config.json")
    assert "test config.json" in str(info.value)


def test_text_only_config_is_read_too():
    text = tiny_config()["text_config"]
    assert text["model_type"] == "qwen3_5_text"
    assert HybridConfig.from_dict(text) == HybridConfig.from_json(FOLDER)


@pytest.mark.parametrize("layers, interval", [(4, 4), (8, 4), (6, 2), (3, 1)])
def test_missing_layer_types_follow_transformers_rule(layers, interval):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    text = {k: v for k, v in tiny_config()["text_config"].items() if k != "layer_types"}
    text |= {"num_hidden_layers": layers, "full_attention_interval": interval}
    ours = HybridConfig.from_dict(copy.deepcopy(text)).layer_types
    theirs = Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "model_type"}).layer_types
    assert list(ours) == list(theirs)
    assert ours.count("full_attention") == layers // interval


# --- the real Qwen3.5-0.8B -------------------------------------------------------------------

QWEN3_5_0_8B = {  # the hub's config.json of Qwen/Qwen3.5-0.8B, its text part (vision_config left out)
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
        "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attn_output_gate": True,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": True, "eos_token_id": 248044,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    },
}


def test_qwen3_5_0_8b_config_parses():
    config = HybridConfig.from_dict(copy.deepcopy(QWEN3_5_0_8B))
    assert config.rotary_dim == 64
    assert config.layer_types.count("linear_attention") == 18 and config.layer_types.count("full_attention") == 6
    assert all(t == "full_attention" for t in config.layer_types[3::4])
    assert config.tie_word_embeddings and config.rope_theta == 1e7 and config.head_dim == 256


def test_qwen3_5_0_8b_parameter_count_equals_transformers():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    config = HybridConfig.from_dict(copy.deepcopy(QWEN3_5_0_8B))
    text = {k: v for k, v in QWEN3_5_0_8B["text_config"].items() if k != "model_type"}
    with torch.device("meta"):
        ours = HybridCausalLM(config)
        theirs = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())  # both tied: the embedding counted once
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in theirs.named_parameters()}
    assert 700e6 < count < 800e6  # "0.8B" with 254M of tied embeddings
