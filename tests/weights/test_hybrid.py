"""minillm/weights/hybrid.py: Qwen3.5's text model out of its checkpoint layouts.

The hub's layout (Qwen3_5ForConditionalGeneration: the decoder under model.language_model., a
vision tower under model.visual.), the text-only one (Qwen3_5ForCausalLM: model.X), untied and
sharded copies all give the same model; a broken checkpoint fails by the tensor's name, and the
plain decoder's loader refuses the folder by its model_type.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from minillm.weights.gguf_file import WeightsError
from minillm.weights.hybrid import load_hybrid_folder, text_model_name
from minillm.weights.loading import load_folder
from support import DATA, HYBRID_REL, assert_logits_close

FOLDER = DATA / "qwen3_5-tiny"
REF = load_file(FOLDER / "reference.safetensors")
IDS = REF["input_ids_2"]  # 80 tokens: every layer, a chunk boundary crossed


def tensors() -> dict[str, torch.Tensor]:
    return load_file(FOLDER / "model.safetensors")


def config() -> dict:
    return json.loads((FOLDER / "config.json").read_text())


def load(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_hybrid_folder(folder, dtype=torch.float32, device="cpu")


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS[None])[0]


@pytest.fixture(scope="module")
def reference_logits():
    return logits(load(FOLDER))


def write(folder, cfg: dict, weights: dict[str, torch.Tensor]):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    return folder


def text_only(weights: dict) -> dict:
    """model.language_model.X -> model.X; the vision tower dropped (Qwen3_5ForCausalLM's names)."""
    out = {}
    for name, value in weights.items():
        if name.startswith("model.language_model."):
            out["model." + name[len("model.language_model."):]] = value
        elif not name.startswith("model.visual."):
            out[name] = value
    return out


def test_the_checkpoint_has_a_vision_tower_and_a_nested_decoder():
    names = set(tensors())
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    assert not any(n.startswith("model.layers.") for n in names)


def test_vision_tower_is_skipped_with_a_warning():
    with pytest.warns(UserWarning, match=r"skipped \d+ tensors of model\.visual") as record:
        model = load_hybrid_folder(FOLDER, dtype=torch.float32, device="cpu")
    skipping = [w for w in record if "skipped" in str(w.message)]
    assert len(skipping) == 1  # once, not once per tensor
    visual = [n for n in tensors() if n.startswith("model.visual.")]
    assert f"skipped {len(visual)} tensors" in str(skipping[0].message)
    names = set(model.state_dict())
    assert not any("visual" in n for n in names)
    assert names == {text_model_name(n) for n in tensors() if not n.startswith("model.visual.")}
    assert_logits_close(logits(model), REF["logits_2"], rel=HYBRID_REL)


def test_text_model_names():
    assert text_model_name("model.language_model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert text_model_name("model.visual.blocks.0.attn.qkv.weight") is None
    assert text_model_name("mtp.layers.0.mlp.up_proj.weight") is None
    assert text_model_name("lm_head.weight") == "lm_head.weight"
    assert text_model_name("model.norm.weight") == "model.norm.weight"


def test_mtp_head_is_skipped_and_named(tmp_path, reference_logits):
    weights = tensors() | {"mtp.fc.weight": torch.zeros(64, 128)}
    folder = write(tmp_path / "mtp", config(), weights)
    with pytest.warns(UserWarning, match="model.visual, mtp"):
        model = load_hybrid_folder(folder, dtype=torch.float32, device="cpu")
    torch.testing.assert_close(logits(model), reference_logits, atol=0, rtol=0)


def test_text_only_layout_gives_the_same_logits(tmp_path, reference_logits):
    cfg = dict(config()["text_config"], model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"])
    folder = write(tmp_path / "text", cfg, text_only(tensors()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to skip, nothing to say
        model = load_hybrid_folder(folder, dtype=torch.float32, device="cpu")
    torch.testing.assert_close(logits(model), reference_logits, atol=0, rtol=0)  # the same weights, the same code


def test_untied_copy_gives_the_same_logits_and_reads_lm_head(tmp_path, reference_logits):
    weights = tensors()
    embed = weights["model.language_model.embed_tokens.weight"]
    cfg = config()
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = False
    model = load(write(tmp_path / "untied", cfg, weights | {"lm_head.weight": embed.clone()}))
    assert model.lm_head is not None
    torch.testing.assert_close(logits(model), reference_logits, atol=1e-5, rtol=0)  # F.linear vs nn.Linear
    other = embed.clone()
    other[:, 0] += 1.0  # a head that differs from the embeddings must show
    model = load(write(tmp_path / "untied-other", cfg, weights | {"lm_head.weight": other}))
    assert (logits(model) - reference_logits).abs().max() > 0.1


def test_sharded_copy_loads(tmp_path, reference_logits):
    weights = tensors()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(FOLDER / "config.json", folder / "config.json")
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, folder / file)
    index = {"metadata": {}, "weight_map": {n: file for file, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load(folder)
    torch.testing.assert_close(logits(model), reference_logits, atol=0, rtol=0)


def test_missing_tensor_is_named(tmp_path):
    weights = tensors()
    del weights["model.language_model.layers.1.linear_attn.A_log"]
    with pytest.raises(WeightsError, match=r"missing tensor.*model\.layers\.1\.linear_attn\.A_log"):
        load(write(tmp_path / "missing", config(), weights))


def test_wrong_shape_is_named(tmp_path):
    weights = tensors()
    weights["model.language_model.layers.3.self_attn.q_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(WeightsError, match=r"model\.layers\.3\.self_attn\.q_proj\.weight has shape \(3, 64\)"):
        load(write(tmp_path / "shape", config(), weights))


def test_unexpected_tensor_is_named(tmp_path):
    weights = tensors() | {"model.language_model.layers.0.self_attn.q_proj.weight": torch.zeros(256, 64)}
    with pytest.raises(WeightsError, match=r"unexpected tensor.*model\.layers\.0\.self_attn\.q_proj\.weight"):
        load(write(tmp_path / "unexpected", config(), weights))


def test_the_decoder_loader_refuses_qwen3_5_by_model_type():
    with pytest.raises(ValueError, match="model_type 'qwen3_5'"):
        load_folder(FOLDER, dtype=torch.float32, device="cpu")
