# Generated from notebooks/03_rope.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Rotary position embedding (RoPE): frequencies, cos/sin tables, the rotation, rope_scaling.

Built in notebooks/03_rope.ipynb, which explains every piece; tests/model/test_rope.py checks them
against Hugging Face transformers (Qwen2RotaryEmbedding, LlamaRotaryEmbedding,
apply_rotary_pos_emb).

Convention: Hugging Face's `rotate_half`, where dimension i of a head is paired with i + D/2
(what HF checkpoints of Qwen2, Qwen3 and Llama expect), not the paper's adjacent pairs (2i, 2i+1).

References:
- J. Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021),
  arXiv:2104.09864.
- S. Chen et al., "Extending Context Window of Large Language Models via Positional
  Interpolation" (2023), arXiv:2306.15595 (rope_type "linear").
- Meta, Llama 3.1 `apply_scaling` (2024) (rope_type "llama3"); transformers'
  modeling_rope_utils.py.
- B. Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models" (2023),
  arXiv:2309.00071 (rope_type "yarn"); transformers' `_compute_yarn_parameters`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from minillm.utils.validate import is_number, is_positive_int


def _validate_head_dim_theta(head_dim: int, rope_theta: float) -> float:
    """head_dim a positive even int and rope_theta > 1, or ValueError; returns rope_theta as a float."""
    if not is_positive_int(head_dim) or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even integer, got {head_dim!r}")
    rope_theta = float(rope_theta)
    if not rope_theta > 1.0:
        raise ValueError(f"rope_theta must be a number > 1, got {rope_theta!r}")
    return rope_theta


def _validate_even_last_dim(x: Tensor) -> None:
    if x.shape[-1] % 2:
        raise ValueError(f"rotate_half: the last dim must be even, got x of shape {tuple(x.shape)}")


def _validate_positions(positions: Tensor, inv_freq: Tensor) -> None:
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"rope_cos_sin: positions must be an integer tensor, got {positions.dtype}")
    if positions.ndim not in (1, 2):
        raise ValueError(f"rope_cos_sin: positions must be (T,) or (B, T), got shape {tuple(positions.shape)}")
    if inv_freq.ndim != 1:
        raise ValueError(f"rope_cos_sin: inv_freq must be (D/2,), got shape {tuple(inv_freq.shape)}")


def _validate_rope_shapes(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.ndim != 4 or cos.ndim != 3 or cos.shape != sin.shape:
        raise ValueError(
            f"apply_rope: expected x (B, H, T, D) and cos, sin (B, T, D), got x {tuple(x.shape)}, "
            f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    B, H, T, D = x.shape
    if cos.shape[1:] != (T, D) or cos.shape[0] not in (1, B):
        raise ValueError(
            f"apply_rope: x {tuple(x.shape)} = (B, H, T, D) needs cos, sin of shape ({B} or 1, {T}, {D}), "
            f"got {tuple(cos.shape)}"
        )


def _rope_type(rope_scaling: dict) -> str:
    """The config's rope type, under "rope_type" or the legacy key "type"; TypeError if not a dict."""
    if not isinstance(rope_scaling, dict):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def _scaling_value(rope_scaling: dict, key: str, rope_type: str) -> float:
    """rope_scaling[key] as a positive float, or a ValueError naming the key."""
    value = rope_scaling.get(key)
    if not is_number(value) or not value > 0:
        raise ValueError(f"rope_scaling[{key!r}] must be a positive number for rope_type {rope_type!r}, got {value!r}")
    return float(value)


def _llama3_params(rope_scaling: dict) -> tuple[float, float, float, float]:
    """factor, low_freq_factor, high_freq_factor, original_max_position_embeddings, each checked."""
    factor, low, high, old_context = (
        _scaling_value(rope_scaling, key, "llama3")
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    if not high > low:
        raise ValueError(f"rope_scaling: high_freq_factor ({high}) must be greater than low_freq_factor ({low})")
    return factor, low, high, old_context


def _yarn_params(rope_scaling: dict, max_position_embeddings: int | None) -> tuple[float, float, float, float]:
    """factor, original_max_position_embeddings (default: the model's context, as transformers),
    beta_fast (default 32), beta_slow (default 1), each checked."""
    scaling = {"beta_fast": 32.0, "beta_slow": 1.0, **{k: v for k, v in rope_scaling.items() if v is not None}}
    scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
    factor, old_context, fast, slow = (_scaling_value(scaling, key, "yarn") for key in
                                       ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"))
    if not fast > slow:
        raise ValueError(f"rope_scaling: beta_fast ({fast}) must be greater than beta_slow ({slow})")
    return factor, old_context, fast, slow


def _base_inv_freq(head_dim: int, rope_theta: float) -> Tensor:
    """theta^(-2i/D) for i = 0..D/2-1, float32, with the same operations as transformers."""
    rope_theta = _validate_head_dim_theta(head_dim, rope_theta)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # 2i/D, (D/2,)
    return 1.0 / (rope_theta**exponents)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: pair (i, i + D/2) turned by 90 degrees."""
    _validate_even_last_dim(x)
    x1, x2 = x.chunk(2, dim=-1)  # (..., D) -> two (..., D/2)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(
    positions: Tensor, inv_freq: Tensor, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """cos and sin of position * inv_freq, each (B, T, D) with both halves equal (like HF).

    positions: (T,) or (B, T) integers (a 1-D input gives B = 1); inv_freq: (D/2,).
    The angles are computed in float32; only the results are cast to `dtype`. scale multiplies
    both (YaRN's attention factor, rope_attention_factor; 1 for every other type).
    """
    _validate_positions(positions, inv_freq)
    if positions.ndim == 1:
        positions = positions[None]  # (T,) -> (1, T)
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
    freqs = positions[..., None].float() * inv_freq  # (B, T, 1) * (D/2,) -> (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D): pair (i, i + D/2) shares one angle
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, *, check: bool = True) -> Tensor:
    """Rotate every pair (i, i + D/2) of x by its angle: x * cos + rotate_half(x) * sin.

    x: (B, H, T, D) queries or keys; cos, sin: (B, T, D) or (1, T, D) from rope_cos_sin.
    Returns (B, H, T, D) in x's dtype. check=False skips the shape checks (the model's layers:
    their shapes were fixed once, at the model's entry).
    """
    if check:
        _validate_rope_shapes(x, cos, sin)
    cos = cos[:, None].to(x.dtype)  # (B, T, D) -> (B, 1, T, D): the same angles for every head
    sin = sin[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None = None,
                  max_position_embeddings: int | None = None) -> Tensor:
    """RoPE's angular speeds theta^(-2i/D), i = 0..D/2-1, with `rope_scaling` applied: (D/2,) float32.

    rope_scaling is the config's dict, its type under "rope_type" (or the legacy "type"):
    None or "default"; "linear" (factor); "llama3" (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings); "yarn" (factor; original_max_position_embeddings, default
    max_position_embeddings; beta_fast, beta_slow). Other keys are ignored; other types raise ValueError.
    """
    inv_freq = _base_inv_freq(head_dim, rope_theta)
    if rope_scaling is None:
        return inv_freq
    rope_type = _rope_type(rope_scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / _scaling_value(rope_scaling, "factor", rope_type)
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, rope_scaling, max_position_embeddings)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported; supported types: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)} (or rope_scaling None)"
    )


def _llama3_inv_freq(inv_freq: Tensor, rope_scaling: dict) -> Tensor:
    """Llama 3.1's scaling: long wavelengths / factor, short ones kept, a smooth blend in between."""
    factor, low, high, old_context = _llama3_params(rope_scaling)
    wavelength = 2 * math.pi / inv_freq  # tokens per turn, (D/2,)
    low_freq_wavelength, high_freq_wavelength = old_context / low, old_context / high
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)  # 0 at the long end .. 1 at the short end
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict, max_position_embeddings: int | None) -> Tensor:
    """YaRN's speeds: pairs turning more than beta_fast times in the original context kept, fewer than
    beta_slow divided by factor, a ramp linear in the pair index between (its ends rounded outward)."""
    factor, old_context, fast, slow = _yarn_params(rope_scaling, max_position_embeddings)
    half = head_dim // 2  # D/2 pairs

    def pair_turning(turns: float) -> float:  # the (fractional) index of the pair that turns `turns` times
        return half * math.log(old_context / (2 * math.pi * turns)) / math.log(rope_theta)

    low, high = pair_turning(fast), pair_turning(slow)
    if rope_scaling.get("truncate", True):  # the ends rounded outward (gpt-oss's configs say false)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(half, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)  # 0 keep .. 1 slow
    per_speed = rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # 1 / omega_i
    keep = 1 - ramp  # transformers' order of operations: the angles then agree at 128K positions too
    return 1.0 / (factor * per_speed) * (1 - keep) + 1.0 / per_speed * keep  # (D/2,)


def rope_attention_factor(rope_scaling: dict | None, max_position_embeddings: int | None = None) -> float:
    """What cos and sin are multiplied by: 1, but for YaRN 0.1 ln(factor) + 1 (or the config's
    attention_factor, or the ratio of mscale and mscale_all_dim terms), as transformers computes it."""
    if rope_scaling is None or _rope_type(rope_scaling) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return _scaling_value(rope_scaling, "attention_factor", "yarn")
    factor = _yarn_params(rope_scaling, max_position_embeddings)[0]
    m = lambda k: 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0  # noqa: E731
    if rope_scaling.get("mscale") and rope_scaling.get("mscale_all_dim"):
        return m(_scaling_value(rope_scaling, "mscale", "yarn")) / m(_scaling_value(rope_scaling, "mscale_all_dim", "yarn"))
    return m(1.0)
