"""minillm/weights/moe_gguf.py (appendix A7): llama.cpp's qwen3moe and qwen35moe GGUF files of the tiny MoE
checkpoints, made by llama.cpp's OWN converter (tests/support.py's llama_cpp_convert), loaded and held to
the folder's model and to transformers' stored logits and greedy tokens.

The converter gets a tokenizer of 191 of Qwen's tokens and merges, and <|endoftext|> (192, the tiny
models' vocabulary) and is told the pre-tokenizer (`qwen2` for Qwen3-MoE, `qwen35` for Qwen3.5-MoE), as
tests/weights/test_hybrid_gguf.py explains; the Qwen3.5-MoE is converted with --no-mtp (it has no
multi-token-prediction layer). Every tensor and every other metadata key is the converter's own.
"""

from __future__ import annotations

import struct
import warnings

import pytest
import torch
from safetensors.torch import load_file

import minillm
import minillm.weights.moe_gguf as moe_gguf
from minillm.model.moe import HybridMoeCausalLM, MoeCausalLM
from minillm.runtime.generate import collect
from minillm.weights.gguf_file import WeightsError
from minillm.weights.embedded import embedded_gguf_path
from minillm.weights.moe import load_moe_folder
from minillm.weights.moe_gguf import is_moe_gguf, load_moe_gguf
from support import DATA, HYBRID_REL, TINY_REL, assert_logits_close, convert_tiny_moe

FILES = {"qwen3_moe-tiny": ("qwen3moe", "qwen2", (), MoeCausalLM, TINY_REL),
         "qwen3_5_moe-tiny": ("qwen35moe", "qwen35", ("--no-mtp",), HybridMoeCausalLM, HYBRID_REL)}


@pytest.fixture(scope="module", params=list(FILES))
def converted(request, tmp_path_factory):
    """(name, GGUF path): a tiny MoE checkpoint through llama.cpp's convert_hf_to_gguf.py, in float32."""
    name = request.param
    _, pre, args, _, _ = FILES[name]
    return name, convert_tiny_moe(tmp_path_factory.mktemp("moe-gguf"), name, pre, *args)


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_moe_gguf(path, dtype=torch.float32, device="cpu")


def folder_model(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the vision tower
        return load_moe_folder(DATA / name, dtype=torch.float32, device="cpu")


def test_the_header_tells_a_moe_file(converted):
    name, path = converted
    assert is_moe_gguf(path) and not is_moe_gguf(embedded_gguf_path())  # SmolLM2: llama


def test_config_and_weights_are_the_folders(converted):
    name, path = converted
    model, reference = load(path), folder_model(name)
    assert type(model) is FILES[name][3]
    differ = {f for f in reference.config.__dataclass_fields__ if getattr(reference.config, f) != getattr(model.config, f)}
    assert differ <= {"rms_norm_eps", "bos_token_id", "eos_token_id"}, differ  # eps: stored as float32
    assert model.config.norm_topk_prob  # llama.cpp's qwen3moe and qwen35moe graphs always renormalise
    theirs = reference.state_dict()
    for n, w in model.state_dict().items():
        torch.testing.assert_close(w, theirs[n], rtol=0, atol=1e-6, msg=n)  # qwen35moe's norms: + 1 - 1


@pytest.mark.parametrize("i", range(3))
def test_logits_and_greedy_tokens_match_transformers(converted, i):
    name, path = converted
    model, ref = load(path), load_file(DATA / name / "reference.safetensors")
    with torch.no_grad():
        assert_logits_close(model(ref[f"input_ids_{i}"][None])[0], ref[f"logits_{i}"], rel=FILES[name][4])


def test_planted_gate_and_up_swapped_is_caught(converted, monkeypatch):
    name, path = converted
    table = dict(moe_gguf._MOE_BLOCK)
    table["ffn_gate_exps.weight"], table["ffn_up_exps.weight"] = table["ffn_up_exps.weight"], table["ffn_gate_exps.weight"]
    monkeypatch.setattr(moe_gguf, "_MOE_BLOCK", table)
    ref = load_file(DATA / name / "reference.safetensors")
    with torch.no_grad(), pytest.raises(AssertionError, match="beyond the tolerance"):
        assert_logits_close(load(path)(ref["input_ids_2"][None])[0], ref["logits_2"], rel=FILES[name][4])


def gguf_string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()  # a GGUF key: u64 length, then the bytes


@pytest.mark.parametrize("key", ["expert_count", "expert_used_count", "expert_feed_forward_length"])
def test_a_missing_expert_key_is_named(converted, tmp_path, key):
    name, path = converted
    key = f"{FILES[name][0]}.{key}"
    data = path.read_bytes()
    assert data.count(gguf_string(key)) == 1
    edited = tmp_path / "edited.gguf"
    edited.write_bytes(data.replace(gguf_string(key), gguf_string(key.upper())))  # same length: still a valid file
    with pytest.raises(WeightsError, match=rf"'{key}' is missing"):
        load(edited)


def test_another_architecture_is_refused_by_name(tmp_path):
    from support import tokenizer_gguf

    path = tokenizer_gguf(tmp_path / "llama.gguf")
    with pytest.raises(WeightsError, match="architecture 'llama' is not a mixture of experts minillm has"):
        load_moe_gguf(path)


def test_minillm_load_takes_the_file(converted):
    """The front door (notebook 24): the .gguf gives the MoE model, its own tokenizer and transformers'
    greedy tokens; quantize="gguf" (the file's blocks) is refused by name."""
    name, path = converted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = minillm.load(path, dtype="float32", device="cpu")
    assert type(llm.model) is FILES[name][3] and llm.tokenizer.backend.get_vocab_size() == 192
    ref = load_file(DATA / name / "reference.safetensors")
    done = collect(llm._steps(ref["input_ids_1"].tolist(), None, max_new_tokens=32, eos_token_ids=()))
    assert done.token_ids == ref["greedy_1"].tolist()
    layers = "mixture-of-experts" if name == "qwen3_moe-tiny" else "Qwen3.5's hybrid"  # its experts quantize, not the file's blocks
    with pytest.raises(ValueError, match=f"quantize: not built for {layers} layers"):
        minillm.load(path, quantize="gguf")
