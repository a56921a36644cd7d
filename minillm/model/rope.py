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
    positions: Tensor, inv_freq: Tensor, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos and sin of position * inv_freq, each (B, T, D) with both halves equal (like HF).

    positions: (T,) or (B, T) integers (a 1-D input gives B = 1); inv_freq: (D/2,).
    The angles are computed in float32; only the results are cast to `dtype`.
    """
    _validate_positions(positions, inv_freq)
    if positions.ndim == 1:
        positions = positions[None]  # (T,) -> (1, T)
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
    freqs = positions[..., None].float() * inv_freq  # (B, T, 1) * (D/2,) -> (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D): pair (i, i + D/2) shares one angle
    return emb.cos().to(dtype), emb.sin().to(dtype)


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


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None = None) -> Tensor:
    """RoPE's angular speeds theta^(-2i/D), i = 0..D/2-1, with `rope_scaling` applied: (D/2,) float32.

    rope_scaling is the config's dict, its type under "rope_type" (or the legacy "type"):
    None or "default"; "linear" (factor); "llama3" (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings). Other keys are ignored; other types raise ValueError.
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
