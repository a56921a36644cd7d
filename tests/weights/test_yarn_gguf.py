"""RoPE scaling in GGUF files (notebook 06's gguf_rope_scaling): a tiny Qwen3 checkpoint with YaRN (or linear)
scaling, converted by llama.cpp's OWN converter, loaded by minillm and held to transformers.

data/tiny-qwen3 (context 256) gets a rope_scaling line in its config (tests/support.py's with_rope_scaling):
Qwen3's model-card YaRN scaled down to an original context of 64, as in tests/model/test_yarn_model.py; the
same with every optional key the converter carries over (beta_fast, beta_slow, attention_factor); and linear.
convert_hf_to_gguf.py (tests/support.py's llama_cpp_convert: a 319-token Qwen tokenizer, the `qwen2`
pre-tokenizer named, as tests/weights/test_hybrid_gguf.py explains) writes it as `qwen3.rope.scaling.type`,
`.factor`, `.original_context_length`, `.yarn_beta_fast`, `.yarn_beta_slow` and `.yarn_attn_factor`
(conversion/base.py, TextModel.set_gguf_parameters). Checked: the loaded config's rope_scaling is the
config.json's; RoPE's speeds and attention factor are transformers'; the logits over 200 tokens, far past the
original context, are transformers' logits of the folder. Planted bug: the keys ignored (plain RoPE) leaves
the tolerance. Hostile files, made from the converted one by gguf-py's own metadata editor
(tests/support.py's gguf_with_metadata): each is refused with a WeightsError that names the key.
"""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGUFValueType as T
from transformers import AutoModelForCausalLM

from minillm.model.decoder import ModelConfig
from minillm.model.rope import rope_inv_freq
from minillm.weights.gguf_file import WeightsError
from minillm.weights.loading import from_gguf
from support import DATA, assert_logits_close, gguf_with_metadata, llama_cpp_convert, small_qwen_tokenizer, with_rope_scaling

SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn, every key": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                        "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25},
    "linear": {"rope_type": "linear", "factor": 2.0},
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (folder, GGUF file, transformers' model of the folder, 200 seeded ids, its logits over them);
    each scaling converted once, when a test first asks for it."""
    done = {}

    def get(name: str):
        if name not in done:
            work = tmp_path_factory.mktemp("scaled-gguf")
            folder = with_rope_scaling(DATA / "tiny-qwen3", work / "tiny-qwen3-scaled", SCALINGS[name])
            small_qwen_tokenizer(folder, 319)
            path = llama_cpp_convert(folder, work / "tiny-qwen3-scaled.gguf", "qwen2")
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            ids = torch.randint(3, hf.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                done[name] = folder, path, hf, ids, hf(ids).logits[0]
        return done[name]

    return get


@pytest.mark.parametrize("name", list(SCALINGS))
def test_config_and_rope_are_the_folders(converted, name):
    folder, path, hf, _, _ = converted(name)
    model, reference = from_gguf(path), ModelConfig.from_json(folder)
    written = json.loads((folder / "config.json").read_text())["rope_scaling"]
    assert model.config.rope_scaling == pytest.approx(written)  # float32 in the file
    differ = {f for f in reference.__dataclass_fields__ if getattr(reference, f) != getattr(model.config, f)}
    assert differ <= {"rms_norm_eps", "bos_token_id", "eos_token_id", "rope_scaling"}, differ  # eps: float32
    rotary = hf.model.rotary_emb
    torch.testing.assert_close(model.inv_freq, rotary.inv_freq.float(), rtol=1e-6, atol=0)
    assert model.rope_scale == pytest.approx(rotary.attention_scaling, rel=1e-6)
    assert (model.rope_scale > 1.1) == (name != "linear")  # YaRN's attention factor, read or computed


@pytest.mark.parametrize("name", list(SCALINGS))
def test_logits_match_transformers(converted, name):
    _, path, _, ids, logits = converted(name)
    with torch.no_grad():
        assert_logits_close(from_gguf(path)(ids)[0], logits)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_the_keys_ignored_leave_the_tolerance(converted, name):
    """What a loader that skipped the keys would run: plain RoPE, no attention factor."""
    _, path, _, ids, logits = converted(name)
    model = from_gguf(path)
    model.inv_freq, model.rope_scale = rope_inv_freq(model.config.head_dim, model.config.rope_theta), 1.0
    with torch.no_grad(), pytest.raises(AssertionError, match="beyond the tolerance"):
        assert_logits_close(model(ids)[0], logits)


KEY = "qwen3.rope.scaling."
HOSTILE = {  # id: (keys set {key: (type, value)}, keys removed, the error's words)
    "longrope": ({KEY + "type": (T.STRING, "longrope")}, (),
                 "'qwen3.rope.scaling.type' 'longrope' is not supported; supported: none, linear, yarn"),
    "no factor": ({}, (KEY + "factor",), "'qwen3.rope.scaling.factor' is missing"),
    "no original context": ({}, (KEY + "original_context_length",),
                            "'qwen3.rope.scaling.original_context_length' is missing"),
    "factor a string": ({KEY + "factor": (T.STRING, "4")}, (), "'qwen3.rope.scaling.factor' is a STRING, not a float"),
    "factor negative": ({KEY + "factor": (T.FLOAT32, -4.0)}, (), r"rope_scaling\['factor'\] must be a positive number"),
    "betas crossed": ({KEY + "yarn_beta_fast": (T.FLOAT32, 0.5)}, (),
                      r"beta_fast \(0.5\) must be greater than beta_slow \(2.0\)"),
    "ext_factor": ({KEY + "yarn_ext_factor": (T.FLOAT32, 0.5)}, (),
                   r"'qwen3.rope.scaling.yarn_ext_factor' 0.5 is not supported \(only 1.0\)"),
    "log_multiplier": ({KEY + "yarn_log_multiplier": (T.FLOAT32, 0.5)}, (),
                       r"'qwen3.rope.scaling.yarn_log_multiplier' 0.5 is not supported \(only 0.0\)"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_file_is_refused_naming_the_key(converted, tmp_path, case):
    new, remove, words = HOSTILE[case]
    path = gguf_with_metadata(converted("yarn, every key")[1], tmp_path / "hostile.gguf", new, remove)
    with pytest.raises(WeightsError, match=words):
        from_gguf(path)


def test_an_explicit_none_is_plain_rope(converted, tmp_path):
    """type "none" (what llama.cpp's converter writes for some models, with other scaling keys left beside it)."""
    path = gguf_with_metadata(converted("yarn")[1], tmp_path / "none.gguf", {KEY + "type": (T.STRING, "none")})
    model = from_gguf(path)
    assert model.config.rope_scaling is None and model.rope_scale == 1.0
