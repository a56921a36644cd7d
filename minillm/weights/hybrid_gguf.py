# Generated from notebooks/A5_qwen35_gguf.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Loading llama.cpp's Qwen3.5 GGUF files (architecture `qwen35`) into HybridCausalLM.

Built in notebooks/A5_qwen35_gguf.ipynb, an appendix to notebook 22, with the checked reader of
notebook 06 (read_gguf, the per-tensor and layout checks, `_build`): Qwen3.5's llama.cpp names, its
config from the file's metadata, and the inverse of each change llama.cpp's converter made to the
Hugging Face tensors (the norms' + 1, ssm_a = -exp(A_log), the conv squeezed, the value heads
reordered from grouped to tiled). Multi-token-prediction layers (`nextn_predict_layers`) are
skipped, once, with a message, as load_hybrid_folder skips `mtp.`.

Sources (llama.cpp as vendored in the llama-cpp-python 0.3.36 sdist): convert_hf_to_gguf.py and
conversion/qwen.py (Qwen3NextModel, _LinearAttentionVReorderBase, Qwen3_5TextModel);
gguf-py/gguf/constants.py (MODEL_ARCH.QWEN35's names and keys); src/models/qwen35.cpp (what the
runtime reads: head_v_dim = ssm.inner_size / ssm.time_step_rank, the q/gate layout).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import gguf
import torch

from minillm.model.devices import default_dtype, pick_device
from minillm.model.qwen3_5 import HybridCausalLM, HybridConfig
from minillm.weights.gguf_file import WeightsError, check_gguf_header, read_gguf
from minillm.weights.gguf_types import _validate_gguf_layout, _validate_gguf_tensor, gguf_float
from minillm.weights.loading import _MISSING, _build, _meta, gguf_rope_scaling

ARCHITECTURE = "qwen35"
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = {  # blk.{i}.<key> -> model.layers.{i}.<value>
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def qwen35_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> HybridCausalLM's (blk.0.ssm_a -> model.layers.0.linear_attn.A_log), or None."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK:
        return f"model.layers.{int(parts[1])}.{_BLOCK[parts[2]]}"
    return None


def is_hybrid_gguf(path: str | Path) -> bool:
    """Whether a GGUF file is llama.cpp's `qwen35`, from the header check alone (no vocabulary decoded)."""
    return check_gguf_header(path).get("general.architecture") == ARCHITECTURE


def tiled_to_grouped(w: torch.Tensor, dim: int, num_k_heads: int, head_dim: int) -> torch.Tensor:
    """Undo the converter's V-head reorder along `dim`: heads (v_per_k, k) tiled back to (k, v_per_k) grouped."""
    shape = w.shape
    w = w.reshape(*shape[:dim], -1, num_k_heads, head_dim, *shape[dim + 1:])  # (..., v_per_k, Hk, d, ...)
    return w.transpose(dim, dim + 1).reshape(shape)


def zero_centred(w: torch.Tensor) -> torch.Tensor:
    """A norm weight as the model stores it: the converter wrote 1 + weight."""
    return w - 1


def a_log(ssm_a: torch.Tensor, where: str) -> torch.Tensor:
    """A_log = log(-ssm_a): the converter wrote ssm_a = -exp(A_log), always negative."""
    if not (ssm_a < 0).all():
        raise WeightsError(f"{where}: ssm_a must be negative (it is -exp(A_log)), got {ssm_a.max().item()}")
    return torch.log(-ssm_a)


def hf_tensor(config: HybridConfig, name: str, w: torch.Tensor, source: str = "GGUF") -> torch.Tensor:
    """One GGUF tensor (float32, GGUF's row order) as HybridCausalLM's parameter: the converter's changes undone."""
    leaf, Hk, Dv = name.split(".", 2)[-1], config.linear_num_key_heads, config.linear_value_head_dim
    qk = 2 * Hk * config.linear_key_head_dim  # in_proj_qkv's and conv1d's q and k rows, never reordered
    if leaf in ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight") \
            or name == "output_norm.weight":
        return zero_centred(w)
    if leaf == "ssm_a":
        return a_log(tiled_to_grouped(w, 0, Hk, 1), f"{source}: tensor {name}")
    if leaf in ("ssm_dt.bias", "ssm_beta.weight", "ssm_alpha.weight"):
        return tiled_to_grouped(w, 0, Hk, 1)
    if leaf == "attn_gate.weight":
        return tiled_to_grouped(w, 0, Hk, Dv)
    if leaf == "ssm_out.weight":
        return tiled_to_grouped(w, 1, Hk, Dv)
    if leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):
        w = torch.cat([w[:qk], tiled_to_grouped(w[qk:], 0, Hk, Dv)])
        return w.unsqueeze(1) if leaf == "ssm_conv1d.weight" else w  # conv1d: (C, K) -> (C, 1, K)
    return w


def open_hybrid_gguf(path: str | Path, arch: str = ARCHITECTURE, read_config=None,
                     to_hf_name=qwen35_to_hf_name) -> tuple[HybridConfig, dict[str, tuple[int, ...]], list]:
    """Check a qwen35 GGUF file; return its config, {HF name: shape} and [(HF name, tensor info)], no data read.
    arch, read_config(reader, path), to_hf_name(name): Qwen3.5-MoE's (`qwen35moe`, notebook 23)."""
    path = Path(path)
    if check_gguf_header(path).get("general.architecture") != arch:  # the header alone, before a vocabulary
        raise WeightsError(f"{path}: general.architecture is not {arch!r}")
    reader = read_gguf(path)
    config = (read_config or qwen35_config)(reader, path)
    mtp = range(config.num_hidden_layers, config.num_hidden_layers + _meta(reader, f"{arch}.nextn_predict_layers", path, 0))
    shapes, infos, every, skipped = {}, [], [], 0
    for t in reader.tensors:
        every.append((t.name, t))
        layer = t.name.split(".")[1] if t.name.startswith("blk.") else ""
        if layer.isdigit() and int(layer) in mtp:  # a multi-token-prediction layer: minillm runs the text model only
            skipped += 1
            continue
        name, shape = to_hf_name(t.name), tuple(int(n) for n in reversed(t.shape.tolist()))
        _validate_gguf_tensor(path, reader, t, name, shape, shapes, config)  # a known name, once; its bytes
        shapes[name] = (shape[0], 1, shape[1]) if t.name.endswith("ssm_conv1d.weight") and len(shape) == 2 else shape
        infos.append((name, t))
    _validate_gguf_layout(path, reader, every)  # all tensors back to back, skipped ones included
    if skipped:
        warnings.warn(f"{path}: skipped {skipped} tensors of the multi-token-prediction layers "
                      f"(minillm runs the text model only)", stacklevel=2)
    return config, shapes, infos


def hybrid_gguf_tensors(config: HybridConfig, infos: list, source: str = "GGUF") -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor), one at a time: dequantized, the converter's changes undone."""
    for name, t in infos:
        w = gguf_float(t, tuple(int(n) for n in reversed(t.shape.tolist())))  # GGUF lists dims fastest-first
        yield name, hf_tensor(config, t.name, w, source)


def load_hybrid_gguf(path: str | Path, dtype: torch.dtype | None = None,
                     device: str | torch.device | None = None) -> HybridCausalLM:
    """A Qwen3.5 text model from llama.cpp's qwen35 GGUF file. device: pick_device(); dtype: default_dtype(device)."""
    device = pick_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    config, shapes, infos = open_hybrid_gguf(path)
    return _build(config, shapes, hybrid_gguf_tensors(config, infos, str(path)), dtype, device, str(path),
                  model_class=HybridCausalLM)


# ---------------------------------------------------------------- Plumbing


def qwen35_config(reader: gguf.GGUFReader, path: str | Path = "GGUF", arch: str = ARCHITECTURE, mlp_fields=None,
                  config_class=HybridConfig) -> HybridConfig:
    """A HybridConfig from a qwen35 GGUF's metadata; WeightsError naming the key that is missing or wrong.
    arch, mlp_fields(count) -> {field: value}, config_class: Qwen3.5-MoE's experts instead (notebook 23)."""
    path = Path(path)
    if (found := _meta(reader, "general.architecture", path)) != arch:
        raise WeightsError(f"{path}: architecture {found!r} is not {arch!r}")
    key = lambda name, default=_MISSING: _meta(reader, f"{arch}.{name}", path, default)  # noqa: E731

    def count(name: str, default=_MISSING, least: int = 1) -> int:
        value = key(name, default)
        if type(value) is not int or value < least:
            raise WeightsError(f"{path}: GGUF metadata key '{arch}.{name}' must be an integer >= {least}, got {value!r}")
        return value

    blocks, mtp = count("block_count"), count("nextn_predict_layers", 0, least=0)
    layers, head_dim, v_heads = blocks - mtp, count("attention.key_length"), count("ssm.time_step_rank")
    if layers < 1:
        raise WeightsError(f"{path}: '{arch}.nextn_predict_layers' {mtp} leaves no layers of {blocks}")
    if count("attention.value_length") != head_dim:
        raise WeightsError(f"{path}: '{arch}.attention.value_length' differs from attention.key_length {head_dim}")
    if (inner := count("ssm.inner_size")) % v_heads:
        raise WeightsError(f"{path}: '{arch}.ssm.inner_size' {inner} is not a multiple of ssm.time_step_rank {v_heads}")
    recurrent = key("attention.recurrent_layers", None)
    if recurrent is None:  # the runtime's rule without the array: every interval-th layer attends
        interval = count("full_attention_interval")
        recurrent = [(i + 1) % interval != 0 for i in range(blocks)]
    if not isinstance(recurrent, list) or len(recurrent) != blocks or any(type(r) is not bool for r in recurrent):
        raise WeightsError(f"{path}: '{arch}.attention.recurrent_layers' must be {blocks} booleans")
    scaling = gguf_rope_scaling(key, arch, path) or {}  # YaRN's keys as config.json's, refused below as there
    tokens, rotary = reader.fields.get("tokenizer.ggml.tokens"), count("rope.dimension_count")
    cfg = {
        "model_type": "qwen3_5_text",
        "vocab_size": len(tokens.data) if tokens is not None else count("vocab_size"),
        "hidden_size": count("embedding_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": count("attention.head_count"),
        "num_key_value_heads": count("attention.head_count_kv"),
        "head_dim": head_dim,
        "max_position_embeddings": count("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_parameters": {"rope_theta": key("rope.freq_base"), "partial_rotary_factor": rotary / head_dim, **scaling},
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        "linear_conv_kernel_dim": count("ssm.conv_kernel"),
        "linear_key_head_dim": count("ssm.state_size"),
        "linear_num_key_heads": count("ssm.group_count"),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": inner // v_heads,
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id", path, None),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id", path, None),
    }
    cfg |= {"intermediate_size": count("feed_forward_length")} if mlp_fields is None else mlp_fields(count)
    try:
        config = config_class.from_dict(cfg, source=str(path))
    except ValueError as exc:
        raise WeightsError(str(exc)) from None
    if config.rotary_dim != rotary:
        raise WeightsError(f"{path}: '{arch}.rope.dimension_count' {rotary} is not a whole share of head_dim {head_dim}")
    return config
