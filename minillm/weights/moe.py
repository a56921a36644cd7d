# Generated from notebooks/23_moe.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Loading Qwen3-MoE and Qwen3.5-MoE checkpoints: experts one tensor each, or stacked.

Built in notebooks/23_moe.ipynb with notebook 06's streaming loader: an expert's tensor
(experts.{e}.gate_proj.weight (I, h), or llama.cpp's stacked experts.gate_proj.weight (E, I, h))
lands in its slice of the stacked parameter (gate_up_proj (E, 2I, h): gate rows, then up rows;
down_proj (E, h, I)), through `_build`'s `place`. Qwen3.5-MoE's text model is read from under
`model.language_model.` as notebook 22's loader does.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from minillm.model.decoder import read_config_json
from minillm.model.devices import default_dtype, pick_device
from minillm.model.moe import MOE_MODEL_TYPES, HybridMoeCausalLM, HybridMoeConfig, MoeCausalLM, MoeConfig
from minillm.weights.gguf_file import WeightsError
from minillm.weights.hybrid import _renamed, text_model_tensors
from minillm.weights.loading import _build, open_folder

EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?:(?P<e>\d+)\.)?(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def expert_piece(name: str) -> tuple[str, str, int | None] | None:
    """(stacked parameter, projection, expert) for an expert's tensor: experts.5.gate_proj.weight ->
    (experts.gate_up_proj, gate_proj, 5); expert None for llama.cpp's all-experts tensor. Else None."""
    match = EXPERT_TENSOR.match(name)
    if match is None:
        return None
    stacked = "down_proj" if match["proj"] == "down_proj" else "gate_up_proj"
    return f"{match['experts']}.{stacked}", match["proj"], None if match["e"] is None else int(match["e"])


def place_expert(params: dict, name: str) -> torch.Tensor | None:
    """_build's `place`: an expert's tensor lands in its rows of the stacked parameter (gate rows
    first, then up); any other tensor in the parameter of its name (None: not the model's, skipped)."""
    piece = expert_piece(name)
    if piece is None:
        return params.get(name)
    stacked, proj, e = piece
    target = params[stacked] if e is None else params[stacked][e]  # (E, 2I, h) or (2I, h); down (E, h, I) or (h, I)
    if proj == "down_proj":
        return target
    I = target.shape[-2] // 2
    return target[..., :I, :] if proj == "gate_proj" else target[..., I:, :]


def fold_expert_shapes(shapes: dict, source: str) -> dict:
    """{name: shape} with the expert tensors folded into the stacked parameters they fill: every
    expert 0..E-1 there once, of one shape, gate and up alike (else WeightsError naming them)."""
    folded, pieces = {}, {}
    for name, shape in shapes.items():
        piece = expert_piece(name)
        if piece is None:
            folded[name] = shape
        else:
            stacked, proj, e = piece
            pieces.setdefault(stacked, {}).setdefault(proj, {})[e] = tuple(shape)
    for stacked, by_proj in pieces.items():
        stacks = {proj: _stack_shape(stacked, proj, by_expert, source) for proj, by_expert in by_proj.items()}
        if stacked.endswith("down_proj"):
            folded[stacked] = stacks["down_proj"]
        elif stacks.get("gate_proj") is None or stacks.get("gate_proj") != stacks.get("up_proj"):
            raise WeightsError(f"{source}: {stacked}: gate_proj {stacks.get('gate_proj')} and up_proj "
                               f"{stacks.get('up_proj')} must both be there, of one shape")
        else:
            E, rows, h = stacks["gate_proj"]
            folded[stacked] = (E, 2 * rows, h)  # gate rows, then up rows
    return folded


def load_moe_folder(folder: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None) -> MoeCausalLM | HybridMoeCausalLM:
    """A Qwen3-MoE or Qwen3.5-MoE text model from a Hugging Face folder (whole or sharded safetensors)."""
    device = pick_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    hybrid = read_config_json(folder)[0].get("model_type") != "qwen3_moe"
    config_class, model_class = (HybridMoeConfig, HybridMoeCausalLM) if hybrid else (MoeConfig, MoeCausalLM)
    config, shapes, tensors, source = open_folder(folder, config_class=config_class)
    if hybrid:  # the text model, from under model.language_model. (notebook 22)
        shapes, tensors = text_model_tensors(shapes, source), _renamed(tensors)
    return _build(config, fold_expert_shapes(shapes, source), tensors, dtype, device, source,
                  model_class=model_class, place=place_expert)


def is_moe_folder(folder: str | Path) -> bool:
    """Whether a model folder holds a Qwen3-MoE or Qwen3.5-MoE: config.json's model_type alone decides."""
    folder = Path(folder)
    if not (folder.is_dir() and (folder / "config.json").is_file()):
        return False
    return read_config_json(folder)[0].get("model_type") in MOE_MODEL_TYPES


def _stack_shape(stacked: str, proj: str, by_expert: dict, source: str) -> tuple:
    """The (E, rows, cols) that one projection's tensors fill: one stacked tensor, or one per expert 0..E-1."""
    if None in by_expert:  # llama.cpp's: all experts in one tensor
        if len(by_expert) > 1 or len(by_expert[None]) != 3:
            raise WeightsError(f"{source}: {stacked}: {proj} must be one (E, rows, cols) tensor, or one per expert")
        return by_expert[None]
    if max(by_expert) + 1 != len(by_expert):  # some expert below the largest index is absent
        missing = [e for e in range(len(by_expert) + 1) if e not in by_expert][:8]  # bounded by the file's tensors
        raise WeightsError(f"{source}: {stacked}: {proj} of expert(s) {missing} missing")
    shapes = set(by_expert.values())
    if len(shapes) > 1 or len(next(iter(shapes))) != 2:
        raise WeightsError(f"{source}: {stacked}: the experts' {proj} tensors must be 2-D and of one shape, got {sorted(shapes)}")
    return (len(by_expert), *shapes.pop())
