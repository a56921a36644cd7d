# Generated from notebooks/A7_moe_gguf.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Loading llama.cpp's mixture-of-experts GGUF files: Qwen3-MoE (`qwen3moe`) and Qwen3.5-MoE (`qwen35moe`).

Built in notebooks/A7_moe_gguf.ipynb, an appendix to notebook 23, on notebook 06's GGUF loader (a
qwen3moe file is a Qwen3 decoder with experts) and appendix A5's (a qwen35moe file is Qwen3.5's
hybrid with experts): the experts' names and metadata keys added. llama.cpp stacks each layer's
experts per projection (ffn_gate_exps (E, I, h), ffn_up_exps, ffn_down_exps (E, h, I)); they land in
notebook 23's stacked parameters through `place_expert`.

Sources (llama.cpp as vendored in the llama-cpp-python 0.3.36 sdist): conversion/qwen.py
(Qwen2MoeModel's stacking, Qwen3MoeModel, Qwen3_5MoeTextModel) and gguf-py's constants.py
(MODEL_ARCH.QWEN3MOE, QWEN35MOE); llama.cpp's src/models/qwen3moe.cpp (the weights renormalised).
"""

from __future__ import annotations

from pathlib import Path

import torch

from minillm.model.devices import default_dtype, pick_device
from minillm.model.moe import HybridMoeCausalLM, HybridMoeConfig, MoeCausalLM, MoeConfig
from minillm.weights.gguf_file import WeightsError, check_gguf_header
from minillm.weights.hybrid_gguf import hybrid_gguf_tensors, open_hybrid_gguf, qwen35_config, qwen35_to_hf_name
from minillm.weights.loading import _build, gguf_config, gguf_tensors, gguf_to_hf_name, open_gguf
from minillm.weights.moe import fold_expert_shapes, place_expert

MOE_ARCHITECTURES = ("qwen3moe", "qwen35moe")


_MOE_BLOCK = {  # blk.{i}.<key> -> model.layers.{i}.<value>
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the router (E, h)
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",  # (E, I, h): every expert's gate rows
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",  # (E, h, I)
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",  # (1, h)
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}


def moe_to_hf_name(name: str, dense_to_hf_name) -> str | None:
    """An expert tensor's name in the model (blk.0.ffn_up_exps.weight -> model.layers.0.mlp.experts.up_proj.weight);
    any other name as the architecture's dense loader maps it (notebook 06's, or A5's)."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _MOE_BLOCK:
        return f"model.layers.{int(parts[1])}.{_MOE_BLOCK[parts[2]]}"
    return dense_to_hf_name(name)


def is_moe_gguf(path: str | Path) -> bool:
    """Whether a GGUF file is llama.cpp's qwen3moe or qwen35moe, from the header check alone."""
    return check_gguf_header(path).get("general.architecture") in MOE_ARCHITECTURES


def qwen3moe_fields(key) -> dict:
    """Qwen3-MoE's fields from qwen3moe.* keys; renormalised, as llama.cpp's qwen3moe graph always is."""
    return {"model_type": "qwen3_moe", "num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
            "moe_intermediate_size": key("expert_feed_forward_length"), "norm_topk_prob": True}


def qwen35moe_fields(count) -> dict:
    """Qwen3.5-MoE's fields from qwen35moe.* keys, each a checked count: experts, a shared expert, no dense MLP."""
    return {"model_type": "qwen3_5_moe_text", "num_experts": count("expert_count"),
            "num_experts_per_tok": count("expert_used_count"), "moe_intermediate_size": count("expert_feed_forward_length"),
            "shared_expert_intermediate_size": count("expert_shared_feed_forward_length")}


def load_moe_gguf(path: str | Path, dtype: torch.dtype | None = None,
                  device: str | torch.device | None = None) -> MoeCausalLM | HybridMoeCausalLM:
    """A Qwen3-MoE or Qwen3.5-MoE text model from llama.cpp's qwen3moe or qwen35moe GGUF file."""
    device = pick_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    path = Path(path)
    arch = check_gguf_header(path).get("general.architecture")
    if arch == "qwen3moe":  # Qwen3's decoder with experts: notebook 06's loader
        read = lambda reader, p: gguf_config(reader, p, mlp_fields=qwen3moe_fields, config_class=MoeConfig)  # noqa: E731
        config, shapes, infos = open_gguf(path, read, lambda name: moe_to_hf_name(name, gguf_to_hf_name))
        tensors, model_class = gguf_tensors(config, shapes, infos), MoeCausalLM
    elif arch == "qwen35moe":  # Qwen3.5's hybrid with experts: appendix A5's
        read = lambda reader, p: qwen35_config(reader, p, arch, qwen35moe_fields, HybridMoeConfig)  # noqa: E731
        config, shapes, infos = open_hybrid_gguf(path, arch, read, lambda name: moe_to_hf_name(name, qwen35_to_hf_name))
        tensors, model_class = hybrid_gguf_tensors(config, infos, str(path)), HybridMoeCausalLM
    else:
        raise WeightsError(f"{path}: architecture {arch!r} is not a mixture of experts minillm has; "
                           f"supported: {', '.join(MOE_ARCHITECTURES)}")
    return _build(config, fold_expert_shapes(shapes, str(path)), tensors, dtype, device, str(path),
                  model_class=model_class, place=place_expert)
