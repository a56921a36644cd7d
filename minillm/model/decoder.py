# Generated from notebooks/05_model.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The Qwen2 / Qwen3 / Llama decoder, config-driven, with Hugging Face parameter names.

Built in notebooks/05_model.ipynb from the parts of notebooks 02-04. One implementation covers
Qwen2 and Qwen2.5 (q/k/v bias), Qwen3 (q/k RMSNorm, explicit head_dim) and the Llama family
(SmolLM2, Llama 2/3), switched by explicit config flags.

Shape legend: B batch, T tokens, S keys, H heads, Hkv kv heads, D head dim, V vocab.

References:
- Qwen2 technical report (arXiv:2407.10671); Qwen3 technical report (arXiv:2505.09388).
- transformers' modeling_qwen2.py, modeling_qwen3.py, modeling_llama.py (same parameter names).
- gpt-fast model.py and nanoGPT (style).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from minillm.model.attention import attention_mask as build_attention_mask
from minillm.model.attention import scaled_dot_product_attention
from minillm.model.devices import on_host
from minillm.model.layers import MLP, RMSNorm
from minillm.model.rope import apply_rope, rope_attention_factor, rope_cos_sin, rope_inv_freq
from minillm.utils.files import read_json_object
from minillm.utils.validate import is_number, is_positive_int

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
MAX_CONTEXT = 2**24  # positions; the longest real contexts (1M-10M tokens) fit


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shape and flags, with Hugging Face config.json field names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: always)
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        validate_config(self)  # sizes are positive ints, head_dim even, eps and theta positive (Plumbing)

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> ModelConfig:
        """Build from a config.json dict; errors name the field and `source` (e.g. the file)."""
        validate_config_dict(cfg, source)  # a supported model_type and every field we read (Plumbing)
        try:
            return cls(**hf_config_fields(cfg))
        except (TypeError, ValueError, ArithmeticError) as exc:  # a field of the wrong type or value
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """From a config.json file, or a folder holding one."""
        cfg, path = read_config_json(path)
        return cls.from_dict(cfg, source=str(path))


def hf_config_fields(cfg: dict) -> dict:
    """ModelConfig's fields from a config.json dict: each family's rule written out, nothing guessed."""
    model_type, heads = cfg["model_type"], cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps rope_theta and the scaling here
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return dict(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,  # HF: absent means no GQA
        head_dim=cfg.get("head_dim") or _ratio(cfg["hidden_size"], heads),  # HF rule for llama/qwen2
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg.get("rope_theta", rope.get("rope_theta")),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "rms_norm_eps",
    "max_position_embeddings",
)


def validate_config(config: ModelConfig) -> None:
    """Every config, from config.json or a GGUF file, is checked here: sizes are positive ints
    (a head_dim of 1e-30, "llama" or NaN would fail deep inside torch.empty), and the context
    stays within what a position table can hold."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = getattr(config, name)
        if not is_positive_int(value):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if config.head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {config.head_dim}")
    if config.max_position_embeddings > MAX_CONTEXT:
        raise ValueError(f"max_position_embeddings {config.max_position_embeddings} is over {MAX_CONTEXT}")
    for name in ("rms_norm_eps", "rope_theta"):
        value = getattr(config, name)
        if not is_number(value) or not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def validate_config_dict(cfg: dict, source: str) -> None:
    """A raw config.json dict: a supported model_type and every field from_dict reads; errors name `source`."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: a model config must be a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    missing = [name for name in _REQUIRED if name not in cfg]
    if model_type == "qwen3" and "head_dim" not in cfg:
        missing.append("head_dim")
    if missing:
        raise ValueError(f"{source}: missing field(s) {', '.join(missing)} for model_type {model_type!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported; supported: 'silu'")
    if cfg.get("use_sliding_window", False):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (full attention only)")
    rope = cfg.get("rope_parameters") or {}
    if cfg.get("rope_theta", rope.get("rope_theta")) is None:
        raise ValueError(f"{source}: missing field rope_theta (or rope_parameters.rope_theta)")


def read_config_json(path: str | Path) -> tuple[dict, Path]:
    """The dict in a config.json file (or in a folder's config.json), and the file's path."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {path}")
    return read_json_object(path), path  # UTF-8, valid JSON and an object, or ValueError naming the file


def _ratio(hidden_size, heads):
    """hidden_size // heads when both are positive ints, else hidden_size (the check then names the bad field)."""
    ok = all(is_positive_int(v) for v in (hidden_size, heads))
    return hidden_size // heads if ok else hidden_size


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, RoPE, optional q/k/v bias and q/k norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, H, Hkv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        if H % Hkv:
            raise ValueError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {Hkv}")
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
        self.q_proj = nn.Linear(h, H * D, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, Hkv * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, Hkv * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(H * D, h, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(D, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache=None, pos: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # (B, T, H*D) -> (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        if self.q_norm is not None:  # Qwen3: normalise each head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, T, H, D) -> (B, H, T, D)
        q, k = apply_rope(q, cos, sin, check=False), apply_rope(k, cos, sin, check=False)  # shapes checked at entry
        if hasattr(cache, "attend"):  # a paged or packed cache (notebooks 16, 17) attends itself
            out = cache.attend(q, k, v)  # (B, H, T, D)
        else:
            if cache is not None:  # keys/values of tokens 0..pos-1 are cached: append ours, attend to all
                k, v = cache.update(pos, k, v)  # (B, Hkv, pos + T, D)
            out = scaled_dot_product_attention(q, k, v, mask, check=False)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, H, T, D) -> (B, T, H*D)
        return self.o_proj(out)  # (B, T, h)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache=None, pos: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, pos)  # (B, T, h)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, h)


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm: HF's `model.` prefix."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """RoPE's inv_freq (D/2,) float32 for a config: with rope_scale, the one place that reads its RoPE fields."""
    return rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)


def rope_scale(config: ModelConfig) -> float:
    """What RoPE's cos and sin are multiplied by: YaRN's attention factor (notebook 03), 1 otherwise."""
    return rope_attention_factor(config.rope_scaling, config.max_position_embeddings)


def padded_positions(attention_mask: torch.Tensor, start_pos: int) -> torch.Tensor:
    """RoPE positions (B, T) of the new tokens under left padding: the count of real tokens before each one."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start_pos:]


def validate_forward_inputs(config: ModelConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                         cache: list | None, start_pos: int, logits_to_keep: int | torch.Tensor) -> tuple[int, int, int]:
    """The checks of forward's arguments, once per call (shared with the fast path of notebook 13);
    returns (B, T, S). Nothing inside the layers checks again.

    The id range is read only from ids on the CPU: reading ids on a GPU would stall it once per
    token. There, the boundaries that make the ids check them: the tokenizer, generate's and the
    engine's prompt check, the server."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    S = start_pos + T  # keys: cached and new
    if cache is None and start_pos != 0:
        raise ValueError(f"start_pos {start_pos} needs a cache holding the first {start_pos} tokens")
    if cache is not None and len(cache) != config.num_hidden_layers:
        raise ValueError(f"cache has {len(cache)} layers, the model has {config.num_hidden_layers}")
    if S > config.max_position_embeddings:
        raise ValueError(f"{S} tokens exceed max_position_embeddings {config.max_position_embeddings}")
    if on_host(input_ids) and (int(input_ids.min()) < 0 or int(input_ids.max()) >= config.vocab_size):
        raise ValueError(f"input_ids must be in [0, {config.vocab_size}), got min {int(input_ids.min())} max {int(input_ids.max())}")
    if attention_mask is not None and tuple(attention_mask.shape) != (B, S):
        raise ValueError(f"attention_mask must be (B, start_pos + T) = {(B, S)}, got {tuple(attention_mask.shape)}")
    if isinstance(logits_to_keep, torch.Tensor):  # the columns to keep (packed sequences' last tokens)
        if logits_to_keep.ndim != 1 or logits_to_keep.dtype != torch.long:
            raise ValueError(f"logits_to_keep as a tensor must be 1-D int64 column indices, got "
                             f"{tuple(logits_to_keep.shape)} {logits_to_keep.dtype}")
        if on_host(logits_to_keep) and len(logits_to_keep) and not 0 <= int(logits_to_keep.min()) <= int(logits_to_keep.max()) < T:
            raise ValueError(f"logits_to_keep columns must be in [0, T={T}), got {logits_to_keep.tolist()}")
    elif not 0 <= logits_to_keep <= T:
        raise ValueError(f"logits_to_keep must be in [0, T={T}] (0 = all), got {logits_to_keep}")
    return B, T, S


def keep_columns(x: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The columns of x (B, T, h) whose logits are wanted: all (0), the last n (an int n), or the
    listed ones (a 1-D tensor of column indices, as transformers takes it: packed sequences' ends)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return x[:, logits_to_keep]  # (B, n, h)
    return x[:, -logits_to_keep:] if logits_to_keep else x  # (B, n, h) or (B, T, h)


class CausalLM(nn.Module):
    """A decoder-only language model: forward(input_ids (B, T)) -> logits (B, T, V)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)  # (D/2,), not a weight
        self.rope_scale = rope_scale(config)  # 1, or YaRN's attention factor

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """inv_freq computed afresh in float32 on `device` (default: where it is), after a cast or to_empty()."""
        self.inv_freq = rope_frequencies(self.config).to(self.inv_freq.device if device is None else device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: list | None = None,
                start_pos: int = 0, logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """Logits (B, T, V) for T new tokens that follow `start_pos` cached ones.

        positions (B, T) or (T,); attention_mask (B, start_pos + T), 1 = token, 0 = padding; cache: one
        object per layer with `update(pos, k, v)`; logits_to_keep = n > 0: the last n positions only
        (a 1-D tensor: those columns)."""
        B, T, S = validate_forward_inputs(self.config, input_ids, attention_mask, cache, start_pos, logits_to_keep)
        if positions is None:
            if attention_mask is None:
                positions = torch.arange(start_pos, S, device=input_ids.device)  # (T,)
            else:  # left padding: count real tokens before each position
                positions = padded_positions(attention_mask, start_pos)  # (B, T)
        if self.inv_freq.dtype != torch.float32:  # model.to(bf16) rounded it: RoPE angles need fp32
            self.reset_rope()
        x = self.model.embed_tokens(input_ids)  # (B, T, h)
        cos, sin = rope_cos_sin(positions, self.inv_freq, dtype=x.dtype, scale=self.rope_scale)  # (B or 1, T, D)
        mask = build_attention_mask(T, S, start_pos, attention_mask, x.device)  # bool, (B or 1, 1, T, S)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, None if cache is None else cache[i], start_pos)
        x = self.model.norm(x)  # (B, T, h)
        x = keep_columns(x, logits_to_keep)  # (B, n, h): the head is the largest matrix; skip unneeded rows
        if self.lm_head is None:  # tied: the embedding matrix is the head
            return F.linear(x, self.model.embed_tokens.weight)  # (B, T, h) @ (h, V) -> (B, T, V)
        return self.lm_head(x)  # (B, T, V); a module, so a quantized head (notebook 12) fits here too


def load_weights(model: CausalLM, state_dict: dict[str, torch.Tensor], source: str = "state dict") -> list[str]:
    """Copy HF-named tensors into `model` (cast to its dtype); return the names skipped on purpose.

    Raises ValueError naming every missing, unexpected or wrong-shaped tensor.
    """
    expected = model.state_dict()
    skipped = []
    for name in state_dict:
        if name not in expected:
            tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings
            if tied_head or name.endswith("rotary_emb.inv_freq"):
                skipped.append(name)
    unexpected = sorted(set(state_dict) - set(expected) - set(skipped))
    missing = sorted(set(expected) - set(state_dict))
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"missing tensor(s): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected tensor(s): {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        raise ValueError(f"{source}: " + "; ".join(parts))
    for name, target in expected.items():
        tensor = state_dict[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(state_dict[name])
    return skipped


def from_folder(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """A model from a folder with config.json and a single model.safetensors (shards: see the weights notebook)."""
    folder = Path(folder)
    config = ModelConfig.from_json(folder / "config.json")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"weights not found: {weights}")
    model = CausalLM(config).to(dtype=dtype, device=device)
    load_weights(model, load_file(weights, device=str(device)), source=str(weights))
    return model.eval()
