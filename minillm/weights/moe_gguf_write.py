# Generated from notebooks/A7_moe_gguf.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Writing a Qwen3-MoE as llama.cpp's qwen3moe GGUF file, as its converter does (float32, no tokenizer).

Built in notebooks/A7_moe_gguf.ipynb: the forward direction of that appendix's loader, its name tables
(and notebook 06's) read backwards. The benchmark's moe section writes its random weights with it for
llama.cpp to run (minillm/bench/moe.py); tests/weights/test_moe_gguf_write.py holds its files to what
llama.cpp's own convert_hf_to_gguf.py writes, tensor by tensor and key by key.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import torch

from minillm.model.moe import MoeConfig
from minillm.weights.loading import _GGUF_BLOCK, _GGUF_GLOBAL
from minillm.weights.moe_gguf import _MOE_BLOCK

DENSE = {hf: g for g, hf in _GGUF_BLOCK.items()}  # self_attn.q_proj -> attn_q
EXPERTS = {hf: g for g, hf in _MOE_BLOCK.items()}  # mlp.experts.gate_proj.weight -> ffn_gate_exps.weight
GLOBAL = {f"{hf}.weight": f"{g}.weight" for g, hf in _GGUF_GLOBAL.items()}  # model.norm.weight -> output_norm.weight


def gguf_tensors_of(checkpoint: dict, E: int) -> dict:
    """{GGUF name: tensor}: dense tensors renamed, each layer's experts stacked per projection (E, rows, cols),
    from one tensor per expert or from transformers 5's packed gate_up_proj (E, 2I, h) and down_proj (E, h, I)."""
    out, stacks = {}, {}
    for name, w in checkpoint.items():
        if not name.startswith("model.layers."):
            out[GLOBAL[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # packed: every expert's gate rows, then its up rows
            gate, up = w.chunk(2, dim=1)  # (E, I, h) each
            out[f"blk.{layer}.{EXPERTS['mlp.experts.gate_proj.weight']}"] = gate
            out[f"blk.{layer}.{EXPERTS['mlp.experts.up_proj.weight']}"] = up
        elif rest == "mlp.experts.down_proj":  # packed: already (E, h, I)
            out[f"blk.{layer}.{EXPERTS['mlp.experts.down_proj.weight']}"] = w
        elif ".experts." in rest:  # one expert's: mlp.experts.{e}.gate_proj.weight
            e, proj = rest.split(".")[2], rest.split(".")[3]
            stacks.setdefault((layer, f"mlp.experts.{proj}.weight"), {})[int(e)] = w
        elif rest in EXPERTS:  # the router
            out[f"blk.{layer}.{EXPERTS[rest]}"] = w
        else:  # mlp.up_proj.weight -> ffn_up.weight
            module, leaf = rest.rsplit(".", 1)
            out[f"blk.{layer}.{DENSE[module]}.{leaf}"] = w
    for (layer, stacked), by_expert in stacks.items():
        out[f"blk.{layer}.{EXPERTS[stacked]}"] = torch.stack([by_expert[e] for e in range(E)])
    return out


def write_qwen3moe_gguf(config: MoeConfig, tensors: dict, path: str | Path) -> Path:
    """{GGUF name: tensor} and the config's keys, written as a float32 qwen3moe GGUF file at `path`."""
    if not config.norm_topk_prob:
        raise ValueError("llama.cpp's qwen3moe always renormalises the chosen experts' weights: "
                         "a model with norm_topk_prob=False has no qwen3moe GGUF form")
    a, path = "qwen3moe", Path(path)
    writer = gguf.GGUFWriter(str(path), a)
    for key, value in {"block_count": config.num_hidden_layers, "context_length": config.max_position_embeddings,
                       "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
                       "attention.head_count": config.num_attention_heads,
                       "attention.head_count_kv": config.num_key_value_heads,
                       "attention.key_length": config.head_dim, "attention.value_length": config.head_dim,
                       "expert_count": config.num_experts, "expert_used_count": config.num_experts_per_tok,
                       "expert_feed_forward_length": config.moe_intermediate_size, "vocab_size": config.vocab_size}.items():
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{a}.rope.freq_base", config.rope_theta)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("none")  # llama.cpp: vocab_size placeholder tokens
    for name, w in tensors.items():
        writer.add_tensor(name, w.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
