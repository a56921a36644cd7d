"""minillm/weights/moe_gguf_write.py (appendix A7): the qwen3moe GGUF writer, held to llama.cpp's OWN converter.

data/qwen3_moe-tiny goes through convert_hf_to_gguf.py (tests/support.py's llama_cpp_convert, as in
tests/weights/test_moe_gguf.py) and through write_qwen3moe_gguf, from both layouts the writer takes: the
checkpoint's one tensor per expert, and the packed experts of a loaded model's state_dict (what the
benchmark writes). Each file must hold the converter's tensors (names, types, shapes, bytes) and its
qwen3moe.* keys; read back by A7's loader, it must give transformers' stored logits.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from minillm.model.moe import MoeConfig
from minillm.weights.moe import load_moe_folder
from minillm.weights.moe_gguf import load_moe_gguf
from minillm.weights.moe_gguf_write import gguf_tensors_of, write_qwen3moe_gguf
from support import DATA, assert_logits_close, convert_tiny_moe

NAME = "qwen3_moe-tiny"


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    """llama.cpp's converter's GGUF of the checkpoint."""
    return convert_tiny_moe(tmp_path_factory.mktemp("moe-converter"), NAME, "qwen2")


def packed_state() -> dict:
    """A loaded model's weights: experts packed (gate_up_proj, down_proj), the tied head left out."""
    model = load_moe_folder(DATA / NAME, dtype=torch.float32, device="cpu")
    return {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}


@pytest.fixture(scope="module", params=["per expert", "packed"])
def files(request, converter, tmp_path_factory):
    """(llama.cpp's converter's GGUF, minillm's GGUF from one layout) of the same checkpoint."""
    config = MoeConfig.from_json(DATA / NAME)
    checkpoint = load_file(DATA / NAME / "model.safetensors") if request.param == "per expert" else packed_state()
    assert any(".experts.0." in n for n in checkpoint) == (request.param == "per expert")
    out = tmp_path_factory.mktemp("moe-writer") / "minillm.gguf"
    return converter, write_qwen3moe_gguf(config, gguf_tensors_of(checkpoint, config.num_experts), out)


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def arch_keys(path) -> dict:
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("qwen3moe.")}


def test_the_tensors_are_the_converters(files):
    theirs, ours = map(tensors, files)
    assert sorted(ours) == sorted(theirs) and len(ours) == 26  # embedding, norm, 2 x (attention 7, MoE 5)
    for name, t in theirs.items():
        assert ours[name].tensor_type == t.tensor_type == gguf.GGMLQuantizationType.F32, name
        assert list(ours[name].shape) == list(t.shape), name
        assert np.array_equal(ours[name].data, t.data), name


def test_the_metadata_is_the_converters(files):
    theirs, ours = map(arch_keys, files)
    assert ours.pop("qwen3moe.vocab_size") == 192  # ours alone: no tokenizer, so llama.cpp reads the size here
    assert ours == theirs
    assert gguf.GGUFReader(files[1]).fields["tokenizer.ggml.model"].contents() == "none"


def test_read_back_it_gives_transformers_logits(files):
    model, ref = load_moe_gguf(files[1], dtype=torch.float32, device="cpu"), load_file(DATA / NAME / "reference.safetensors")
    with torch.no_grad():
        assert_logits_close(model(ref["input_ids_2"][None])[0], ref["logits_2"])


def test_planted_gate_and_up_swapped_differs_from_the_converter(converter, tmp_path, monkeypatch):
    """The comparison above can fail: the packed rows split the other way round change the bytes."""
    split = torch.Tensor.chunk
    monkeypatch.setattr(torch.Tensor, "chunk", lambda t, n, dim=0: split(t, n, dim)[::-1])
    config = MoeConfig.from_json(DATA / NAME)
    planted = tensors(write_qwen3moe_gguf(config, gguf_tensors_of(packed_state(), config.num_experts),
                                          tmp_path / "planted.gguf"))
    theirs = tensors(converter)
    assert not np.array_equal(planted["blk.0.ffn_gate_exps.weight"].data, theirs["blk.0.ffn_gate_exps.weight"].data)


def test_a_model_without_renormalisation_is_refused(tmp_path):
    config = dataclasses.replace(MoeConfig.from_json(DATA / NAME), norm_topk_prob=False)
    with pytest.raises(ValueError, match="always renormalises"):
        write_qwen3moe_gguf(config, {}, tmp_path / "x.gguf")
