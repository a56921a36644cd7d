"""minillm/weights/hybrid_gguf.py: llama.cpp's qwen35 GGUF of data/qwen3_5-tiny, loaded into HybridCausalLM.

The file is made by llama.cpp's OWN converter (convert_hf_to_gguf.py of the llama-cpp-python 0.3.36
sdist, unpacked into .venv/llama-cpp/ by tools/fetch_llama_cpp_vocab.py, which `make test` runs; its
gguf-py first on the path, --outtype f32), so the loader is checked against llama.cpp's
conversion, not against our own inverse of it. The converter needs a tokenizer, and only the
tokenizer is ours:

- the folder gets a tokenizer.json of 319 of Qwen's tokens (287 bytes, then 32 of its merges), plus
  <|endoftext|> as id 319 (tests/support.py's small_qwen_tokenizer): the converter asserts that every
  token id is below the model's vocab_size (320), so Qwen's full 151,665-token tokenizer is refused;
- it recognises a pre-tokenizer by hashing the token ids of a test string, and no real tokenizer
  has a 320-token vocabulary, so the run replaces one method, `get_vocab_base_pre`, to name
  Qwen3.5's pre-tokenizer (`qwen35`, what Qwen3.5's own tokenizer hashes to). Every tensor and every
  other metadata key is the converter's own work;
- a multi-token-prediction layer is added to the copy of the checkpoint (random: layer 3's tensors
  and four small ones), as Qwen3.5's real checkpoints have one, so the file comes out of the
  converter's default path (blocks 0-3 the model, block 4 its `nextn` layer); the converter refuses a
  Qwen3.5 checkpoint without one unless told --no-mtp. The loader skips it, with a warning; the
  model's own tensors are those of data/qwen3_5-tiny.

The file is converted once per module (about 6 s, support.llama_cpp_convert), into a session temp folder.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import warnings
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from minillm.model.qwen3_5 import HybridConfig
from minillm.weights import hybrid_gguf
from minillm.weights.embedded import embedded_gguf_path
from minillm.weights.gguf_file import WeightsError, read_gguf
from minillm.weights.hybrid import load_hybrid_folder
from minillm.weights.hybrid_gguf import is_hybrid_gguf, load_hybrid_gguf, qwen35_config
from support import (DATA, HYBRID_REL, TINY_REL, assert_logits_close, greedy_by_teacher_forcing, gguf_with_metadata,
                     llama_cpp_convert, small_qwen_tokenizer)

FOLDER = DATA / "qwen3_5-tiny"
REF = load_file(FOLDER / "reference.safetensors")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    """data/qwen3_5-tiny, with a multi-token-prediction layer, converted by llama.cpp's convert_hf_to_gguf.py."""
    work = tmp_path_factory.mktemp("qwen35-gguf")
    folder, out = work / "qwen3_5-tiny", work / "qwen3_5-tiny-f32.gguf"
    folder.mkdir()
    cfg = json.loads((FOLDER / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    weights, h, layer = load_file(FOLDER / "model.safetensors"), 64, "model.language_model.layers.3."
    weights |= {"mtp.layers.0." + k[len(layer):]: v.clone() for k, v in weights.items() if k.startswith(layer)}
    weights |= {"mtp.fc.weight": torch.randn(h, 2 * h) * 0.02, "mtp.pre_fc_norm_embedding.weight": torch.zeros(h),
                "mtp.pre_fc_norm_hidden.weight": torch.zeros(h), "mtp.norm.weight": torch.zeros(h)}
    save_file(weights, folder / "model.safetensors")
    small_qwen_tokenizer(folder, 319)
    return llama_cpp_convert(folder, out, "qwen35")


def load(path: Path):
    """load_hybrid_gguf in float32 on the CPU; the warning about the skipped layer checked."""
    with pytest.warns(UserWarning, match=r"skipped 15 tensors of the multi-token-prediction layers"):
        return load_hybrid_gguf(path, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def model(gguf_file):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped layer: load() checks it
        return load_hybrid_gguf(gguf_file, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def folder_model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the vision tower, skipped
        return load_hybrid_folder(FOLDER, dtype=torch.float32, device="cpu")


def logits(model, i: int) -> torch.Tensor:
    with torch.no_grad():
        return model(REF[f"input_ids_{i}"][None])[0]


def test_the_header_tells_a_qwen35_file(gguf_file):
    assert is_hybrid_gguf(gguf_file)
    assert not is_hybrid_gguf(embedded_gguf_path())  # SmolLM2: llama


def test_config_is_the_checkpoints(gguf_file):
    config = qwen35_config(read_gguf(gguf_file), gguf_file)
    expected = HybridConfig.from_json(FOLDER / "config.json")
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-7)  # stored as float32
    assert dataclasses.replace(config, rms_norm_eps=expected.rms_norm_eps) == expected


def test_weights_are_the_checkpoints(model, folder_model):
    """Every parameter back in Hugging Face's layout: only float32 rounding of the +1 and of log(exp())."""
    mine, theirs = model.state_dict(), folder_model.state_dict()
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, atol=1e-7, rtol=0, msg=name)


@pytest.mark.parametrize("i", range(4))
def test_logits_match_transformers(model, folder_model, i):
    """Against the stored transformers logits at the hybrid fixture's level (tests/support.py's HYBRID_REL),
    and against our own loader of the same checkpoint at TINY_REL (in practice: equal)."""
    mine = logits(model, i)
    assert_logits_close(mine, REF[f"logits_{i}"], rel=HYBRID_REL, msg=f"prompt {i}")
    assert_logits_close(mine, logits(folder_model, i), rel=TINY_REL, msg=f"prompt {i}, folder")


@pytest.mark.parametrize("i", [1, 2])
def test_greedy_tokens_match_transformers(model, i):
    greedy = REF[f"greedy_{i}"]
    assert greedy_by_teacher_forcing(model, REF[f"input_ids_{i}"], greedy) == greedy.tolist()


@pytest.mark.parametrize("bug, planted", [
    ("V heads left tiled", ("tiled_to_grouped", lambda w, dim, k, d: w)),
    ("norms keep the +1", ("zero_centred", lambda w: w)),
    ("ssm_a taken for A_log", ("a_log", lambda ssm_a, where: ssm_a)),
])
def test_a_planted_bug_fails(gguf_file, monkeypatch, bug, planted):
    monkeypatch.setattr(hybrid_gguf, *planted)
    broken = load(gguf_file)
    with pytest.raises(AssertionError, match="beyond the tolerance"):
        assert_logits_close(logits(broken, 2), REF["logits_2"], rel=HYBRID_REL, msg=bug)


def edited(gguf_file: Path, tmp_path: Path, old: bytes, new: bytes) -> Path:
    data = gguf_file.read_bytes()
    assert data.count(old) == 1, old
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "edited.gguf"
    path.write_bytes(data.replace(old, new))
    return path


def gguf_string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()  # a GGUF key or tensor name: u64 length, then the bytes


@pytest.mark.parametrize("key", ["ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank",
                                 "ssm.inner_size", "rope.dimension_count", "attention.key_length",
                                 "attention.layer_norm_rms_epsilon", "rope.freq_base", "embedding_length",
                                 "block_count", "attention.head_count", "attention.head_count_kv"])
def test_a_missing_metadata_key_is_named(gguf_file, tmp_path, key):
    key = f"qwen35.{key}"
    path = edited(gguf_file, tmp_path, gguf_string(key), gguf_string(key.upper()))  # same length: still a valid file
    with pytest.raises(WeightsError, match=rf"'{key}' is missing"):  # before any tensor: no warning
        load_hybrid_gguf(path, dtype=torch.float32, device="cpu")


def test_layer_types_come_from_the_interval_without_the_array(gguf_file, tmp_path):
    key, interval = "qwen35.attention.recurrent_layers", "qwen35.full_attention_interval"
    path = edited(gguf_file, tmp_path, gguf_string(key), gguf_string(key.upper()))
    assert qwen35_config(read_gguf(path), path).layer_types == qwen35_config(read_gguf(gguf_file)).layer_types
    path = edited(path, tmp_path / "neither", gguf_string(interval), gguf_string(interval.upper()))
    with pytest.raises(WeightsError, match=f"'{interval}' is missing"):
        qwen35_config(read_gguf(path), path)


def test_yarn_is_refused_as_in_a_config_json(gguf_file, tmp_path):
    """Notebook 06's gguf_rope_scaling reads llama.cpp's YaRN keys into rope_parameters, and HybridConfig.from_dict
    refuses them with the words it has for a config.json: minillm's Qwen3.5 runs unscaled RoPE."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = json.loads((FOLDER / "config.json").read_text())
    cfg["text_config"]["rope_parameters"] |= yarn
    words = "rope_type 'yarn' is not supported for Qwen3.5; supported: 'default'"
    with pytest.raises(ValueError, match=words):
        HybridConfig.from_dict(cfg)
    keys = {"qwen35.rope.scaling.type": (gguf.GGUFValueType.STRING, "yarn"),
            "qwen35.rope.scaling.factor": (gguf.GGUFValueType.FLOAT32, 4.0),
            "qwen35.rope.scaling.original_context_length": (gguf.GGUFValueType.UINT32, 64)}
    path = gguf_with_metadata(gguf_file, tmp_path / "yarn.gguf", keys)  # gguf-py's own metadata editor
    with pytest.raises(WeightsError, match=words):
        qwen35_config(read_gguf(path), path)


def test_a_wrong_shaped_tensor_is_named(gguf_file, tmp_path):
    """blk.0.ssm_out.weight's dims swapped in its tensor info: the same bytes, the wrong shape."""
    info = gguf_string("blk.0.ssm_out.weight") + struct.pack("<I", 2)
    path = edited(gguf_file, tmp_path, info + struct.pack("<QQ", 32, 64), info + struct.pack("<QQ", 64, 32))
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.linear_attn\.out_proj\.weight has shape \(32, 64\)"):
        load(path)


def test_the_multi_token_prediction_layer_is_skipped(gguf_file):
    model = load(gguf_file)
    assert model.config.num_hidden_layers == 4 and qwen35_config(read_gguf(gguf_file)).num_hidden_layers == 4


def test_minillm_load_takes_a_qwen35_file(gguf_file):
    """The front door (notebook 24): a qwen35 .gguf gives a HybridCausalLM with its hybrid cache, its
    own tokenizer (pre-tokenizer qwen35), transformers' greedy tokens; decoder options are refused."""
    import minillm
    from minillm.cache.hybrid import make_hybrid_cache
    from minillm.model.qwen3_5 import HybridCausalLM
    from minillm.runtime.generate import collect

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped layer: load() checks the message
        llm = minillm.load(gguf_file, dtype="float32", device="cpu")
    assert isinstance(llm.model, HybridCausalLM) and llm.cache_factory is make_hybrid_cache
    assert llm.tokenizer.encode("hi") and llm.tokenizer.backend.get_vocab_size() == 320
    done = collect(llm._steps(REF["input_ids_1"].tolist(), None, max_new_tokens=32, eos_token_ids=()))
    assert done.token_ids == REF["greedy_1"].tolist()
    with pytest.raises(ValueError, match="quantize: not built for Qwen3.5"):
        minillm.load(gguf_file, quantize="gguf")
