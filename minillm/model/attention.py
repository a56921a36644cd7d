# Generated from notebooks/02_attention.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Scaled dot-product attention with causal and padding masks and grouped-query attention.

Built in notebooks/02_attention.ipynb, which explains every piece; checked there and in
tests/model/test_attention.py against torch.nn.functional.scaled_dot_product_attention and
transformers' repeat_kv and eager attention.

Shapes: B batch, H query heads, Hkv key/value heads, T queries, S keys, D head dim.
Masks are boolean, True = this query may attend to this key (torch's convention for
scaled_dot_product_attention; nn.MultiheadAttention uses the opposite).

References:
- Vaswani et al., "Attention Is All You Need" (2017): scaled dot-product and multi-head attention.
- Shazeer, "Fast Transformer Decoding: One Write-Head is All You Need" (2019): multi-query attention.
- Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
  Checkpoints" (2023).
- transformers, models/qwen2/modeling_qwen2.py: `repeat_kv` and `eager_attention_forward`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from minillm.model.devices import on_host
from minillm.utils.validate import is_int, is_positive_int


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, Hkv, S, D) -> (B, Hkv * n_rep, S, D): kv head g serves query heads g*n_rep .. g*n_rep + n_rep - 1."""
    if x.ndim != 4:
        raise ValueError(f"repeat_kv: x must be 4-D (B, Hkv, S, D), got shape {tuple(x.shape)}")
    if not is_positive_int(n_rep):
        raise ValueError(f"repeat_kv: n_rep must be an int >= 1, got {n_rep!r}")
    if n_rep == 1:
        return x
    B, Hkv, S, D = x.shape
    x = x[:, :, None, :, :].expand(B, Hkv, n_rep, S, D)   # (B, Hkv, S, D) -> (B, Hkv, n_rep, S, D), no copy
    return x.reshape(B, Hkv * n_rep, S, D)                # -> (B, H, S, D), copies


def causal_mask(T: int, S: int, start: int = 0, device: torch.device | str | None = None) -> Tensor:
    """Bool (T, S), True = may attend: query i, at absolute position start + i, sees keys 0 .. start + i.

    `start` is the number of keys before the query block (the tokens already in the KV cache), so
    normally S = start + T; a larger S (a preallocated cache) masks the keys past start + T - 1.
    """
    for name, value in (("T", T), ("S", S), ("start", start)):
        if not is_int(value) or value < 0:
            raise ValueError(f"causal_mask: {name} must be an int >= 0, got {value!r}")
    if start + T > S:
        raise ValueError(f"causal_mask: start + T = {start} + {T} = {start + T} queries need S >= {start + T} keys, got S = {S}")
    rows = torch.arange(start, start + T, device=device)[:, None]   # (T, 1) absolute query positions
    cols = torch.arange(S, device=device)[None, :]                  # (1, S) key positions
    return cols <= rows                                             # (T, S)


def _validate_shapes(q: Tensor, k: Tensor, v: Tensor | None = None, mask: Tensor | None = None) -> None:
    """Raise ValueError/TypeError naming the bad tensor unless q (B, H, T, D), k and v (B, Hkv, S, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and t.ndim != 4:
            shape = "(B, H, T, D)" if name == "q" else "(B, Hkv, S, D)"
            raise ValueError(f"attention: {name} must be 4-D {shape}, got shape {tuple(t.shape)}")
    B, H, T, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in B and D")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"attention: query heads H = {H} (q {tuple(q.shape)}) must be a multiple of "
                         f"kv heads Hkv = {Hkv} (k {tuple(k.shape)})")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"attention: k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.dtype != q.dtype or (v is not None and v.dtype != q.dtype):
        raise TypeError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {None if v is None else v.dtype}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"attention: mask must be a bool tensor (True = may attend), got {mask.dtype}")
        try:
            fits = mask.ndim <= 4 and torch.broadcast_shapes(mask.shape, (B, H, T, S)) == (B, H, T, S)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"attention: mask of shape {tuple(mask.shape)} does not broadcast to (B, H, T, S) = {(B, H, T, S)}")


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None = None, scale: float | None = None,
                      *, check: bool = True) -> Tensor:
    """softmax(q k^T * scale) over the keys: (B, H, T, S) in q's dtype, the softmax done in float32.

    q (B, H, T, D); k (B, Hkv, S, D) with H % Hkv == 0; mask bool, broadcastable to (B, H, T, S),
    True = may attend; scale defaults to 1 / sqrt(D). Masked keys get weight exactly 0, and a
    query row with no allowed key gets all zeros (softmax of all -inf would be NaN).
    check=False skips the shape checks: for a caller that checked its inputs once, at its own entry.
    """
    if check:
        _validate_shapes(q, k, mask=mask)
    B, H, T, D = q.shape
    k = repeat_kv(k, H // k.shape[1])                          # (B, Hkv, S, D) -> (B, H, S, D)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale                 # (B, H, T, D) @ (B, H, D, S) -> (B, H, T, S)
    scores = scores.float()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:
        weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)   # rows with no key: NaN -> 0
    return weights.to(q.dtype)


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None, *, check: bool = True
) -> Tensor:
    """softmax(q k^T / sqrt(D)) v -> (B, H, T, D).

    q (B, H, T, D); k, v (B, Hkv, S, D) with H % Hkv == 0 (grouped-query attention); mask bool,
    broadcastable to (B, H, T, S), True = may attend. Computes in the input dtype with the softmax
    in float32. A query with no allowed key gets a zero output, not NaN. check=False skips the
    shape checks: the model's layers pass it, their shapes fixed by the config and its inputs
    checked once per forward (notebook 05), so a decode step does no per-layer validation.
    """
    if check:
        _validate_shapes(q, k, v, mask)
    weights = attention_weights(q, k, mask, scale, check=False)  # (B, H, T, S)
    return weights @ repeat_kv(v, q.shape[1] // v.shape[1])    # (B, H, T, S) @ (B, H, S, D) -> (B, H, T, D)


def padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, S) with 1 = real token, 0 = padding -> bool (B, 1, 1, S), True = real key (for every head and query)."""
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"padding_mask: attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.ndim != 2:
        raise ValueError(f"padding_mask: attention_mask must be 2-D (B, S), got shape {tuple(attention_mask.shape)}")
    if attention_mask.dtype != torch.bool and on_host(attention_mask) and not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("padding_mask: attention_mask must hold only 0 (padding) and 1 (real token)")
    return attention_mask.bool()[:, None, None, :]            # (B, S) -> (B, 1, 1, S)


def attention_mask(
    T: int,
    S: int,
    start: int = 0,
    attention_mask: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Causal mask for T queries at positions start .. start + T - 1 over S keys, AND the padding mask.

    Bool, True = may attend: (1, 1, T, S) without `attention_mask`; with a (B, S) 1/0
    `attention_mask` over all S keys (cached and new), (B, 1, T, S). Broadcasts to (B, H, T, S).
    """
    if attention_mask is None:
        return causal_mask(T, S, start, device)[None, None]   # (T, S) -> (1, 1, T, S)
    pad = padding_mask(attention_mask)                        # (B, 1, 1, S)
    if pad.shape[-1] != S:
        raise ValueError(f"attention_mask: attention_mask has shape {tuple(attention_mask.shape)}, "
                         f"expected (B, S) with S = {S} keys")
    device = attention_mask.device if device is None else device
    causal = causal_mask(T, S, start, device)[None, None]     # (1, 1, T, S)
    return causal & pad.to(device)                            # (1, 1, T, S) & (B, 1, 1, S) -> (B, 1, T, S)
