# Generated from notebooks/22_linear_attention.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Qwen3.5: three Gated DeltaNet layers, then one gated-attention layer, repeated; HF parameter names.

Built in notebooks/22_linear_attention.ipynb on the decoder of notebook 05 and the gated delta
rule (minillm/model/gated_delta.py). What differs from Qwen3:

- `layer_types`: "linear_attention" layers hold a Gated DeltaNet (a state of fixed size per
  sequence), "full_attention" layers a KV cache; one layer in four attends.
- gated attention: q_proj is twice as wide (per head, the query then a gate), the attention
  output is multiplied by sigmoid(gate); q/k RMSNorm; RoPE on the first 25% of each head only.
- RMSNorm scales by (1 + weight) (zero-centred weights), except the DeltaNet's gated norm.
- checkpoints (Qwen3_5ForConditionalGeneration) keep the decoder under `model.language_model.`
  beside a vision tower (`model.visual.`), which a text model skips.

Shape legend: B batch, T tokens, S keys, H heads, Hkv kv heads, D head dim, R rotated dims,
Hk/Hv linear key/value heads, Dk/Dv their dims, C conv channels, K conv kernel, h hidden.

References:
- transformers' models/qwen3_5/modeling_qwen3_5.py and configuration_qwen3_5.py (names, rounding);
  Qwen3-Next (the same layers, with MoE); llama.cpp's src/models/qwen35.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minillm.model.attention import attention_mask as build_attention_mask
from minillm.model.attention import scaled_dot_product_attention
from minillm.model.decoder import ModelConfig, hf_config_fields, keep_columns, padded_positions
from minillm.model.decoder import validate_forward_inputs
from minillm.model.gated_delta import causal_conv1d, chunked_gated_delta_rule, gated_rms_norm, l2norm
from minillm.model.gated_delta import recurrent_gated_delta_rule
from minillm.model.layers import MLP
from minillm.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from minillm.utils.validate import is_positive_int

HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """ModelConfig and the fields of the linear-attention layers, with config.json's names."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25

    def __post_init__(self):
        super().__post_init__()
        validate_hybrid_config(self)  # layer_types, the linear sizes, the rotated dims (Plumbing)

    @property
    def conv_channels(self) -> int:
        """C: the DeltaNet's q, k and v channels side by side (2 Hk Dk + Hv Dv), which its short conv mixes."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def rotary_dim(self) -> int:
        """R: the dims of each head that RoPE turns (the first R; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> HybridConfig:
        """From a Qwen3.5 config.json dict: the text model's fields, nested under text_config or not."""
        text = validate_hybrid_config_dict(cfg, source)  # the dict the text fields are in (Plumbing)
        try:
            return cls(**hybrid_config_fields(cfg, text))
        except (TypeError, ValueError, ArithmeticError) as exc:
            raise ValueError(f"{source}: {exc}") from None


def hybrid_config_fields(cfg: dict, text: dict) -> dict:
    """HybridConfig's fields: Qwen3's rules for the shared ones (explicit head_dim, q/k norm), then the hybrid's."""
    rope = text.get("rope_parameters") or {}
    return hf_config_fields(dict(text, model_type="qwen3")) | dict(
        model_type="qwen3_5",
        rope_scaling=None,  # the M-RoPE sections: text has one position per token, so plain RoPE
        tie_word_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        layer_types=tuple(text.get("layer_types") or default_layer_types(text)),
        partial_rotary_factor=rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)),
        **{name: text[name] for name in LINEAR_FIELDS if name in text},
    )


LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim")


def default_layer_types(text: dict) -> list[str]:
    """transformers' rule when a config lists no layer_types: every full_attention_interval-th layer attends."""
    interval = text.get("full_attention_interval", 4)
    if not is_positive_int(interval):
        raise ValueError(f"full_attention_interval must be a positive integer, got {interval!r}")
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(text["num_hidden_layers"])]


# ---------------------------------------------------------------- Plumbing


def validate_hybrid_config(config: HybridConfig) -> None:
    """A config's hybrid fields: one known layer type per layer, positive linear sizes, R even and > 0."""
    if len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(f"layer_types lists {len(config.layer_types)} layers, num_hidden_layers is {config.num_hidden_layers}")
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    for name in LINEAR_FIELDS:
        if not is_positive_int(getattr(config, name)):
            raise ValueError(f"{name} must be a positive integer, got {getattr(config, name)!r}")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads {config.linear_num_value_heads} is not a multiple of "
                         f"linear_num_key_heads {config.linear_num_key_heads}")
    factor = config.partial_rotary_factor
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1 or config.rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {factor!r} must be in (0, 1] and leave an even number "
                         f"of rotated dims (head_dim {config.head_dim})")


def validate_hybrid_config_dict(cfg: dict, source: str) -> dict:
    """The dict a Qwen3.5 config's text fields are in (text_config, or the config itself), checked."""
    if not isinstance(cfg, dict) or cfg.get("model_type") not in HYBRID_MODEL_TYPES:
        got = cfg.get("model_type") if isinstance(cfg, dict) else type(cfg).__name__
        raise ValueError(f"{source}: model_type {got!r} is not a hybrid model; supported: {', '.join(HYBRID_MODEL_TYPES)}")
    text = cfg.get("text_config", cfg) if cfg["model_type"] == "qwen3_5" else cfg
    if not isinstance(text, dict):
        raise ValueError(f"{source}: text_config must be an object")
    missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "head_dim", "rms_norm_eps", "max_position_embeddings") if n not in text]
    if missing:
        raise ValueError(f"{source}: missing field(s) {', '.join(missing)} in the text config")
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {text['hidden_act']!r} is not supported; supported: 'silu'")
    if not text.get("attn_output_gate", True):
        raise ValueError(f"{source}: attn_output_gate=false is not supported (Qwen3.5 gates its attention)")
    rope = text.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope_type {rope['rope_type']!r} is not supported for Qwen3.5; supported: 'default'")
    if text.get("rope_theta", rope.get("rope_theta")) is None:
        raise ValueError(f"{source}: missing field rope_theta (or rope_parameters.rope_theta)")
    return text


def linear_states(config: HybridConfig, cache: list) -> list[LinearState]:
    """The cache's entries for the DeltaNet layers, checked to be states (a KV cache there is a mistake):
    LinearStates, or an engine's views that run `convolve` and `delta_rule` per sequence (appendix A6)."""
    states = [entry for entry, t in zip(cache, config.layer_types) if t == "linear_attention"]
    if not all(hasattr(state, "convolve") and hasattr(state, "delta_rule") for state in states):
        raise ValueError("a hybrid model's cache holds a LinearState for each linear_attention layer: "
                         "make it with minillm.cache.hybrid.make_hybrid_cache")
    return states


def start_states(states: list[LinearState], start_pos: int) -> None:
    """A forward at position 0 starts each DeltaNet state afresh; a later one must continue it exactly."""
    for state in states:
        if not isinstance(state, LinearState):
            continue  # an engine's view: each of its sequences keeps its own count (appendix A6)
        if start_pos == 0:
            state.conv.zero_()
            state.recurrent.zero_()
            state.tokens = 0
        elif state.tokens != start_pos:
            raise ValueError(f"a linear-attention state holds {state.tokens} tokens; a forward at start_pos "
                             f"{start_pos} must continue it exactly (or start again at 0)")


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm that scales by (1 + weight): weights stored around 0 (initialised to zeros)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., h) -> same; all in float32, one rounding at the end
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first R dims of each head, the other D - R unchanged. x (B, H, T, D); cos, sin (B, T, R)."""
    R = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :R], cos, sin, check=False), x[..., R:]], dim=-1)


def output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention's output times sigmoid(gate): each of its H*D dims opened or closed by the token itself."""
    return out * torch.sigmoid(gate)


class GatedAttention(nn.Module):
    """Qwen3's attention (GQA, q/k norm), RoPE on R of D dims, and an output gate: out * sigmoid(gate)."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        h, H, Hkv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
        self.q_proj = nn.Linear(h, H * D * 2, bias=config.attention_bias)  # per head: D query, then D gate
        self.k_proj = nn.Linear(h, Hkv * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, Hkv * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(H * D, h, bias=config.attention_bias)
        self.q_norm = ZeroCentredRMSNorm(D, eps=config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(D, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache=None, pos: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # 2x (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)  # (B, H or Hkv, T, D)
        v = v.transpose(1, 2)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if hasattr(cache, "attend"):  # a paged or packed cache attends itself
            out = cache.attend(q, k, v)
        else:
            if cache is not None:
                k, v = cache.update(pos, k, v)  # (B, Hkv, pos + T, D)
            out = scaled_dot_product_attention(q, k, v, mask, check=False)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(output_gate(out, gate.reshape(B, T, -1)))  # (B, T, H*D) -> (B, T, h)


class LinearState:
    """One DeltaNet layer's memory of a batch of sequences: conv (B, C, K-1), recurrent (B, Hv, Dk, Dv).

    Its size does not grow with the context. `tokens` counts what it has absorbed: a forward must
    continue exactly there (start_pos == tokens), or start again at 0."""

    def __init__(self, config: HybridConfig, batch_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device | None = None):
        Hv, Dk, Dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
        self.conv = torch.zeros(batch_size, config.conv_channels, config.linear_conv_kernel_dim - 1, dtype=dtype,
                                device=device)
        self.recurrent = torch.zeros(batch_size, Hv, Dk, Dv, dtype=torch.float32, device=device)  # always fp32
        self.tokens = 0

    def convolve(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """causal_conv1d continuing these sequences' inputs: x (B, C, T) -> (B, C, T); the state moves on."""
        out, self.conv[:] = causal_conv1d(x, weight, self.conv)
        return out

    def delta_rule(self, q, k, v, g, beta) -> torch.Tensor:
        """The gated delta rule from this state, recurrent for one token and chunked for more: out (B, T, Hv, Dv)."""
        rule = recurrent_gated_delta_rule if q.shape[1] == 1 else chunked_gated_delta_rule
        out, self.recurrent[:] = rule(q, k, v, g, beta, self.recurrent)
        return out

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()

    def snapshot(self) -> tuple:
        """A copy to return to: speculative decoding (notebook 19) keeps one before it verifies drafts."""
        return self.conv.clone(), self.recurrent.clone(), self.tokens

    def restore(self, saved: tuple) -> None:
        self.conv[:], self.recurrent[:], self.tokens = saved


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Per token and value head: g = -exp(A_log) * softplus(a + dt_bias), the log of the decay (<= 0,
    so the decay exp(g) is in (0, 1]), and beta = sigmoid(b), the write's step size in (0, 1)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # float32: exp(A_log) can overflow fp16
    return g, torch.sigmoid(b)


class GatedDeltaNet(nn.Module):
    """The linear-attention layer: projections, a causal conv on q/k/v, the gated delta rule, a gated norm."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        h = config.hidden_size
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        channels = config.conv_channels  # C: q, k and v side by side
        self.in_proj_qkv = nn.Linear(h, channels, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)  # the output gate
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)  # beta, per head: the write's step size
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)  # the decay's input, per head
        K = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(channels, channels, K, groups=channels, bias=False, padding=K - 1)  # weight (C, 1, K)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))  # log of the decay rate, per head
        self.norm = GatedNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def forward(self, x: torch.Tensor, state: LinearState | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        conv_in, weight = self.in_proj_qkv(x).transpose(1, 2), self.conv1d.weight[:, 0]  # (B, C, T), (C, K)
        mixed = causal_conv1d(conv_in, weight)[0] if state is None else state.convolve(conv_in, weight)  # (B, C, T)
        q, k, v = mixed.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(B, T, self.num_k_heads, self.head_k_dim).float())  # (B, T, Hk, Dk), unit length
        k = l2norm(k.reshape(B, T, self.num_k_heads, self.head_k_dim).float())
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)  # (B, T, Hv, Dv)
        group = self.num_v_heads // self.num_k_heads  # each key head serves `group` value heads
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)  # (B, T, Hv, Dk)
        g, beta = decay_and_beta(self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias)  # (B, T, Hv) each
        if state is None:  # a whole sequence, no state kept: the chunked form from zeros
            out = chunked_gated_delta_rule(q, k, v, g, beta)[0]  # (B, T, Hv, Dv) float32
        else:  # the state runs the rule from where it stopped, and keeps the result
            out = state.delta_rule(q, k, v, g, beta)
        z = self.in_proj_z(x).view(B, T, self.num_v_heads, self.head_v_dim)
        out = self.norm(out.to(x.dtype), z)  # (B, T, Hv, Dv)
        return self.out_proj(out.reshape(B, T, self.value_dim))  # (B, T, h)


class GatedNorm(nn.Module):
    """RMSNorm(x) * weight * silu(z), per value head (a plain weight, initialised to ones)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)


class HybridDecoderLayer(nn.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x)); the mixer is a GatedDeltaNet or a GatedAttention."""

    def __init__(self, config: HybridConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, mask, padding, cache=None, pos: int = 0) -> torch.Tensor:
        h = self.input_layernorm(x)  # (B, T, h)
        if self.layer_type == "linear_attention":
            if padding is not None:  # left padding must not enter the state: its inputs become zeros
                h = h * padding[:, :, None].to(h.dtype)
            x = x + self.linear_attn(h, cache)
        else:
            x = x + self.self_attn(h, cos, sin, mask, cache, pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridModel(nn.Module):
    """Embeddings, hybrid layers and the final norm: HF's `model.` prefix (of the text model)."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, t) for t in config.layer_types)
        self.norm = ZeroCentredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class HybridCausalLM(nn.Module):
    """Qwen3.5's text model: forward(input_ids (B, T)) -> logits (B, T, V), the decoder's signature.

    cache: one object per layer (minillm/cache/hybrid.py's make_hybrid_cache): a KV cache for an
    attention layer, a LinearState for a DeltaNet layer."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.config = config
        self.model = HybridModel(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)  # (R/2,)

    def _inv_freq(self) -> torch.Tensor:
        return rope_inv_freq(self.config.rotary_dim, self.config.rope_theta)  # RoPE over R dims, not D

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        self.inv_freq = self._inv_freq().to(self.inv_freq.device if device is None else device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: list | None = None,
                start_pos: int = 0, logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """Logits (B, T, V) for T new tokens after `start_pos` cached ones (as CausalLM.forward)."""
        B, T, S = validate_forward_inputs(self.config, input_ids, attention_mask, cache, start_pos, logits_to_keep)
        states = [] if cache is None else linear_states(self.config, cache)  # the DeltaNet layers' (Plumbing)
        start_states(states, start_pos)  # zeroed at position 0; otherwise each continues where it stopped
        if positions is None:
            positions = (torch.arange(start_pos, S, device=input_ids.device) if attention_mask is None
                         else padded_positions(attention_mask, start_pos))
        if self.inv_freq.dtype != torch.float32:
            self.reset_rope()
        x = self.model.embed_tokens(input_ids)  # (B, T, h)
        cos, sin = rope_cos_sin(positions, self.inv_freq, dtype=x.dtype)  # (B or 1, T, R)
        mask = build_attention_mask(T, S, start_pos, attention_mask, x.device)
        padding = None if attention_mask is None or T == 1 else attention_mask[:, start_pos:]  # (B, T)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, padding, None if cache is None else cache[i], start_pos)
        for state in states:
            state.tokens = S
        x = keep_columns(self.model.norm(x), logits_to_keep)
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight)  # (B, n, V)
        return self.lm_head(x)
