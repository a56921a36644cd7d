"""minillm/weights/moe.py (notebook 23): MoE checkpoints with one tensor per expert (the hub's Qwen3-30B-A3B,
and what transformers saves) or all experts stacked (transformers' own in-memory names), whole or
sharded, Qwen3.5-MoE's text model out of its vision-language folder; damaged expert tensors refused
with the file and the expert named before a byte is allocated.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from minillm.model.moe import HybridMoeCausalLM, MoeCausalLM
from minillm.weights.gguf_file import WeightsError
from minillm.weights.moe import expert_piece, fold_expert_shapes, is_moe_folder, load_moe_folder
from support import DATA, HYBRID_REL, TINY_REL, assert_logits_close

QWEN3_MOE, QWEN3_5_MOE = DATA / "qwen3_moe-tiny", DATA / "qwen3_5_moe-tiny"


def load(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_moe_folder(folder, dtype=torch.float32, device="cpu")


def assert_reference(model, folder, rel):
    ref = load_file(folder / "reference.safetensors")
    for i in range(3):
        with torch.no_grad():
            assert_logits_close(model(ref[f"input_ids_{i}"][None])[0], ref[f"logits_{i}"], rel=rel, msg=f"prompt {i}")


def copy_with(folder, tmp_path, tensors: dict, config: dict | None = None, shards: int = 1):
    """A copy of `folder` with these tensors (split over `shards` files with an index) and config."""
    out = tmp_path / folder.name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config or json.loads((folder / "config.json").read_text())))
    shutil.copy(folder / "reference.safetensors", out)
    if shards == 1:
        save_file(tensors, out / "model.safetensors")
        return out
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, out / file)
        weight_map |= {n: file for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def stacked(tensors: dict) -> dict:
    """The checkpoint with each layer's experts stacked under transformers' names (gate_up_proj, down_proj)."""
    out, pieces = {}, {}
    for name, t in tensors.items():
        piece = expert_piece(name)
        if piece is None:
            out[name] = t
        else:
            pieces.setdefault(piece[0], {}).setdefault(piece[1], {})[piece[2]] = t
    for name, by_proj in pieces.items():
        E = len(next(iter(by_proj.values())))
        if name.endswith("gate_up_proj"):
            out[name] = torch.stack([torch.cat([by_proj["gate_proj"][e], by_proj["up_proj"][e]]) for e in range(E)])
        else:
            out[name] = torch.stack([by_proj["down_proj"][e] for e in range(E)])
    return out


def test_per_expert_tensors_as_saved():
    names = load_file(QWEN3_MOE / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert_reference(load(QWEN3_MOE), QWEN3_MOE, TINY_REL)
    assert_reference(load(QWEN3_5_MOE), QWEN3_5_MOE, HYBRID_REL)


@pytest.mark.parametrize("folder, rel", [(QWEN3_MOE, TINY_REL), (QWEN3_5_MOE, HYBRID_REL)], ids=["qwen3_moe", "qwen3_5_moe"])
def test_stacked_experts_and_shards(folder, rel, tmp_path):
    packed = stacked(load_file(folder / "model.safetensors"))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in packed)
    assert_reference(load(copy_with(folder, tmp_path, packed, shards=3)), folder, rel)


def test_the_vision_tower_is_skipped_with_a_message():
    with pytest.warns(UserWarning, match="skipped 21 tensors of model.visual"):
        model = load_moe_folder(QWEN3_5_MOE, dtype=torch.float32, device="cpu")
    assert type(model) is HybridMoeCausalLM


def test_expert_piece_names_every_layout():
    assert expert_piece("model.layers.3.mlp.experts.12.up_proj.weight") == ("model.layers.3.mlp.experts.gate_up_proj", "up_proj", 12)
    assert expert_piece("model.layers.3.mlp.experts.down_proj.weight") == ("model.layers.3.mlp.experts.down_proj", "down_proj", None)
    assert expert_piece("model.layers.3.mlp.experts.gate_up_proj") is None  # already the parameter's name
    assert expert_piece("model.layers.3.mlp.shared_expert.gate_proj.weight") is None
    assert expert_piece("model.layers.3.mlp.gate.weight") is None


def damaged(tmp_path, edit):
    tensors = load_file(QWEN3_MOE / "model.safetensors")
    edit(tensors)
    return copy_with(QWEN3_MOE, tmp_path, tensors)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.0.mlp.experts.3.gate_proj.weight"), r"gate_proj of expert\(s\) \[3\] missing"),
    (lambda t: [t.pop(f"model.layers.1.mlp.experts.7.{p}_proj.weight") for p in ("gate", "up", "down")],
     r"model.layers.1.mlp.experts.gate_up_proj has shape \(7, 32, 64\), expected \(8, 32, 64\)"),
    (lambda t: t.update({"model.layers.0.mlp.experts.2.up_proj.weight": torch.zeros(17, 64)}),
     "the experts' up_proj tensors must be 2-D and of one shape"),
    (lambda t: [t.pop(f"model.layers.0.mlp.experts.{e}.up_proj.weight") for e in range(8)],
     r"gate_proj \(8, 16, 64\) and up_proj None must both be there"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_proj.weight": torch.zeros(8, 16, 64)}),
     "must be one .E, rows, cols. tensor, or one per expert"),
    (lambda t: t.update({"model.layers.0.mlp.experts.999999999999.down_proj.weight": torch.zeros(64, 16)}),
     r"down_proj of expert\(s\) \[8, 9\] missing"),  # a hostile index: named at once, no range of 10**12 walked
])
def test_damaged_experts_are_named(tmp_path, edit, message):
    with pytest.raises(WeightsError, match=message):
        load(damaged(tmp_path, edit))


def test_fold_keeps_other_names_and_stacks_the_rest():
    shapes = {"a.mlp.experts.0.gate_proj.weight": (4, 6), "a.mlp.experts.1.gate_proj.weight": (4, 6),
              "a.mlp.experts.0.up_proj.weight": (4, 6), "a.mlp.experts.1.up_proj.weight": (4, 6),
              "a.mlp.experts.down_proj.weight": (2, 6, 4), "a.mlp.gate.weight": (2, 6)}
    assert fold_expert_shapes(shapes, "f") == {"a.mlp.gate.weight": (2, 6), "a.mlp.experts.gate_up_proj": (2, 8, 6),
                                               "a.mlp.experts.down_proj": (2, 6, 4)}


def test_a_config_with_more_experts_than_the_file_is_named(tmp_path):
    config = json.loads((QWEN3_MOE / "config.json").read_text()) | {"num_experts": 9}
    folder = copy_with(QWEN3_MOE, tmp_path, load_file(QWEN3_MOE / "model.safetensors"), config)
    with pytest.raises(WeightsError, match=r"model.safetensors: tensor model.layers.0.mlp.gate.weight has shape \(8, 64\), "
                                           r"expected \(9, 64\)"):
        load(folder)


def test_transformers_5_saves_num_experts_as_num_local_experts(tmp_path):
    config = json.loads((QWEN3_MOE / "config.json").read_text())
    config["num_local_experts"] = config.pop("num_experts")
    folder = copy_with(QWEN3_MOE, tmp_path, load_file(QWEN3_MOE / "model.safetensors"), config)
    model = load(folder)
    assert type(model) is MoeCausalLM and model.config.num_experts == 8
    assert_reference(model, QWEN3_MOE, TINY_REL)


def test_is_moe_folder():
    assert is_moe_folder(QWEN3_MOE) and is_moe_folder(QWEN3_5_MOE)
    assert not is_moe_folder(DATA / "tiny-qwen3") and not is_moe_folder(DATA / "qwen3_5-tiny")
    assert not is_moe_folder(DATA / "nowhere")
