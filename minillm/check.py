"""Automatic checks for the classroom exercises (plumbing, not a lesson).

Each check takes a student's function or class, runs it on small inputs, compares with torch
(or with a few lines of reference math written here), prints PASS or FAIL with the first wrong
element and the likely cause, and returns True or False. The same checks grade the reference
package: `check.rms_norm(minillm.layers.rms_norm)` passes.

In an exercise notebook:      from minillm import check; check.rms_norm(rms_norm)
From the command line:        python -m minillm.check exercises/04_norm_mlp.ipynb
                              python -m minillm.check submissions/        (every notebook in a folder)
                              python -m minillm.check my_layers.py        (a student's module)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import traceback
import types
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from minillm.kv_cache import KVCache
from minillm.model import ModelConfig
from minillm.paged_cache import BlockManager, PagedKVCache
from minillm.tensor import Tensor, narrow
from minillm.tensor import transpose as _transpose  # `transpose` here is the check of a student's transpose

__all__ = [
    "contiguous_strides", "transpose", "expand", "matmul",
    "causal_mask", "attention_weights", "scaled_dot_product_attention",
    "rotate_half", "rope_cos_sin", "apply_rope",
    "rms_norm", "mlp_forward", "attention_forward", "decoder_layer_forward",
    "kv_cache_update", "top_k_filter", "top_p_filter", "min_p_filter", "quantize_int4", "dequantize_q4_1",
    "CHECKS", "check_namespace", "check_path", "main",
]


class CheckFailed(Exception):
    """A check's assertion failed; the message is the feedback shown to the student."""


def _fail(message: str, hint: str | None = None):
    raise CheckFailed(message + (f"\n    hint: {hint}" if hint else ""))


def _run(name: str, body: Callable[[], None]) -> bool:
    """Run one check body: print PASS, or FAIL with feedback; return whether it passed."""
    try:
        with torch.no_grad():
            body()
    except CheckFailed as exc:
        print(f"FAIL {name}: {exc}")
        return False
    except NotImplementedError as exc:
        print(f"FAIL {name}: not implemented yet (NotImplementedError: {exc})")
        return False
    except Exception as exc:  # the student's code crashed: show where
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (in {frames[-1].name}, line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
        print(f"FAIL {name}: your code raised {type(exc).__name__}: {exc}{where}")
        return False
    print(f"PASS {name}")
    return True


def _same(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-6) -> bool:
    """Whether a matches b in shape and values (dtype-agnostic; used to recognise known mistakes)."""
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    if a.dtype == torch.bool or b.dtype == torch.bool:
        return bool((a.bool() == b.bool()).all())
    return torch.allclose(a.double(), b.double(), atol=atol, rtol=0, equal_nan=True)


def _compare(what: str, got, expected: torch.Tensor, atol: float = 1e-6, rtol: float = 0.0,
             mistakes: list[tuple[str, torch.Tensor]] = (), hint: str | None = None) -> None:
    """Fail unless got matches expected; name the first wrong element and the likely cause.

    mistakes: (hint, what that mistake would have produced); the first one that got matches
    becomes the hint. `hint` is the fallback.
    """
    if not isinstance(got, torch.Tensor):
        _fail(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    if got.shape != expected.shape:
        for h, wrong in mistakes:
            if isinstance(wrong, torch.Tensor) and got.shape == wrong.shape and got.shape != expected.shape:
                _fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}", h)
        _fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}", hint)
    if got.dtype != expected.dtype:
        _fail(f"{what}: dtype {got.dtype}, expected {expected.dtype}",
              "return the input's dtype" if expected.dtype != torch.bool else "return a bool tensor (True = may attend)")
    if expected.dtype == torch.bool:
        bad = got != expected
    else:
        g, e = got.double(), expected.double()
        bad = ~torch.isclose(g, e, atol=atol, rtol=rtol, equal_nan=False)
    if not bad.any():
        return
    idx = tuple(int(i) for i in bad.nonzero()[0])
    n_bad = int(bad.sum())
    message = (f"{what}: {n_bad} of {bad.numel()} elements wrong; first at index {idx}: "
               f"expected {expected[idx].item():.6g}, got {got[idx].item():.6g}")
    for h, wrong in mistakes:
        if _same(got, wrong, atol=max(atol, 1e-6)):
            _fail(message, h)
    _fail(message, hint)


def _expect_raises(what: str, exc_type: type[Exception], call: Callable[[], object], hint: str) -> None:
    try:
        call()
    except exc_type:
        return
    except NotImplementedError:
        raise
    except Exception as exc:
        _fail(f"{what}: raised {type(exc).__name__} ({exc}), expected {exc_type.__name__}", hint)
    _fail(f"{what}: did not raise {exc_type.__name__}", hint)


# ------------------------------------------------------------------ 01 tensors


def _tensor(t: torch.Tensor):
    return Tensor.from_torch(t)


def _check_view(what: str, got, expected: torch.Tensor, source=None, hint_stride: str | None = None) -> None:
    """got is a minillm-style Tensor (duck-typed) that should equal the torch view `expected`."""
    for attr in ("shape", "stride", "tolist"):
        if not hasattr(got, attr):
            _fail(f"{what}: expected a Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        _fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if tuple(got.stride()) != tuple(expected.stride()):
        _fail(f"{what}: strides {tuple(got.stride())}, expected {tuple(expected.stride())}", hint_stride)
    if source is not None and getattr(got, "storage", None) is not source.storage:
        _fail(f"{what}: the result has its own storage", "a view must not copy: build a new Layout over the same Storage")
    if got.tolist() != expected.tolist():
        _fail(f"{what}: values {got.tolist()}, expected {expected.tolist()}",
              "keep the layout's offset (a view of a view starts where its source starts)")


def contiguous_strides(fn) -> bool:
    """contiguous_strides(shape) -> row-major strides, as torch gives a contiguous tensor."""
    def body():
        for shape in [(2, 3, 4), (5,), (), (3, 1, 2), (4, 5)]:
            expected = torch.empty(shape).stride()
            got = fn(shape)
            if not isinstance(got, tuple):
                _fail(f"contiguous_strides({shape}) returned a {type(got).__name__}, expected a tuple {expected}")
            if got == tuple(reversed(expected)) and got != expected:
                _fail(f"contiguous_strides({shape}) = {got}, expected {expected}",
                      "you built them from the last dimension: reverse the list at the end")
            if got != expected:
                including = tuple(s * n for s, n in zip(expected, shape))
                _fail(f"contiguous_strides({shape}) = {got}, expected {expected}",
                      "each stride is the product of the sizes AFTER that dimension (not including it)"
                      if got == including else "the last dimension moves by 1, each earlier one by the size of what follows")
    return _run("contiguous_strides", body)


def transpose(fn) -> bool:
    """transpose(t, dim0, dim1): a view with two sizes and two strides swapped."""
    def body():
        base = torch.arange(24.0).view(2, 3, 4)
        t = _tensor(base)
        for d0, d1 in [(0, 2), (1, 2), (-1, -2), (1, 1)]:
            _check_view(f"transpose(t {tuple(base.shape)}, {d0}, {d1})", fn(t, d0, d1), base.transpose(d0, d1), t,
                        "swap the strides too, not only the sizes")
        part = narrow(t, 0, 1, 1)  # a view with offset 12
        _check_view("transpose of a view with offset 12", fn(part, 1, 2), base[1:2].transpose(1, 2), part)
    return _run("transpose", body)


def expand(fn) -> bool:
    """expand(t, shape): size-1 dims broadcast with stride 0, no copy."""
    def body():
        base = torch.arange(3.0).view(3, 1)
        t = _tensor(base)
        hint = "a broadcast dimension gets stride 0, and new leading dimensions too"
        _check_view("expand(t (3, 1), (3, 4))", fn(t, (3, 4)), base.expand(3, 4), t, hint)
        _check_view("expand(t (3, 1), (2, 3, 4))", fn(t, (2, 3, 4)), base.expand(2, 3, 4), t, hint)
        _check_view("expand(t (3, 1), (-1, 5))", fn(t, (-1, 5)), base.expand(-1, 5), t, "-1 keeps that dimension's size")
        _expect_raises("expand(t (3, 1), (4, 4))", ValueError, lambda: fn(t, (4, 4)),
                       "only size-1 dimensions can grow: raise ValueError for size 3 -> 4")
    return _run("expand", body)


def matmul(fn) -> bool:
    """matmul(a, b): (..., M, K) @ (..., K, N) with broadcast batch dims, reading any strides."""
    def body():
        g = torch.Generator().manual_seed(0)
        ints = lambda *shape: torch.randint(-4, 5, shape, generator=g).float()  # exact in fp32
        a, b, c, d = ints(2, 3), ints(3, 4), ints(2, 2, 3), ints(3, 2)
        cases = [("a (2, 3) @ b (3, 4)", _tensor(a), _tensor(b), a @ b, None),
                 ("a.T @ a (a transposed: not contiguous)", _transpose(_tensor(a), 0, 1), _tensor(a), a.t() @ a,
                  "read each element through layout.position(index) (the strides), not in storage order"),
                 ("batched (2, 2, 3) @ (3, 2)", _tensor(c), _tensor(d), c @ d,
                  "broadcast the batch dimensions (expand both sides)")]
        for what, x, y, expected, hint in cases:
            got = fn(x, y)
            if not hasattr(got, "tolist"):
                _fail(f"{what}: expected a Tensor, got {type(got).__name__}")
            if tuple(got.shape) != tuple(expected.shape):
                _fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}", hint)
            _compare(what, torch.tensor(got.tolist()), expected, atol=1e-5, hint=hint)
    return _run("matmul", body)


# ------------------------------------------------------------------ 02 attention


def _causal(T: int, S: int, start: int) -> torch.Tensor:
    return torch.ones(T, S, dtype=torch.bool).tril(diagonal=start)


def causal_mask(fn) -> bool:
    """causal_mask(T, S, start): bool (T, S), query i (at position start + i) sees keys 0..start+i."""
    def body():
        for T, S, start in [(4, 4, 0), (1, 5, 4), (3, 7, 4), (3, 8, 2), (1, 1, 0)]:
            expected = _causal(T, S, start)
            mistakes = [("True means 'may attend': you returned the masked-out positions", ~expected),
                        ("off by one: the query at position p sees keys 0..p, itself included", _causal(T, S, start - 1)),
                        ("off by one: the query at position p sees keys 0..p, not p + 1", _causal(T, S, start + 1))]
            if start:
                mistakes.insert(0, ("is the mask offset by the cache position? query i sits at absolute "
                                    "position start + i", _causal(T, S, 0)))
            _compare(f"causal_mask(T={T}, S={S}, start={start})", fn(T, S, start), expected, mistakes=mistakes)
    return _run("causal_mask", body)


def _attn_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, S, D = 2, 4, 2, 3, 5, 8
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    return q, k, v, _causal(T, S, S - T)


def _sdpa(q, k, v, mask=None):
    """torch's attention, the kv heads repeated for grouped-query attention (enable_gqa is torch >= 2.5)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _ref_weights(q, k, mask, scale=None, repeat=torch.repeat_interleave, softmax_dim=-1, use_mask=True):
    rep = q.shape[1] // k.shape[1]
    k = repeat(k, rep, dim=1) if repeat is torch.repeat_interleave else k.repeat(1, rep, 1, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, T, S)
    if use_mask and mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    w = torch.softmax(scores, dim=softmax_dim)
    if use_mask and mask is not None:
        w = w.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return w.to(q.dtype)


def _weight_mistakes(q, k, mask):
    return [("did you scale the scores by 1/sqrt(D)?", _ref_weights(q, k, mask, scale=1.0)),
            ("masked keys must get weight 0: fill their scores with -inf before the softmax",
             _ref_weights(q, k, mask, use_mask=False)),
            ("query head h uses kv head h // (H // Hkv): repeat_interleave the kv heads, not repeat",
             _ref_weights(q, k, mask, repeat=None)),
            ("softmax over the keys (the last dim)", _ref_weights(q, k, mask, softmax_dim=-2))]


def attention_weights(fn) -> bool:
    """attention_weights(q, k, mask): softmax(q k^T / sqrt(D)) over the keys, with GQA and a bool mask."""
    def body():
        q, k, v, mask = _attn_inputs()
        _compare("attention_weights(q, k, causal mask)", fn(q, k, mask), _ref_weights(q, k, mask),
                 atol=1e-6, mistakes=_weight_mistakes(q, k, mask))
        _compare("attention_weights(q, k) without a mask", fn(q, k), _ref_weights(q, k, None), atol=1e-6)
        empty = mask.clone()
        empty[0] = False  # query 0 may attend to nothing
        _compare("attention_weights with a query row that may attend to no key", fn(q, k, empty),
                 _ref_weights(q, k, empty), hint="a row with no allowed key must give zeros, not NaN")
        qb, kb, _, _ = _attn_inputs(torch.bfloat16)
        _compare("attention_weights in bfloat16", fn(qb, kb, mask), _ref_weights(qb, kb, mask), atol=1e-2,
                 hint="do the softmax in float32, return q's dtype")
    return _run("attention_weights", body)


def scaled_dot_product_attention(fn) -> bool:
    """scaled_dot_product_attention(q, k, v, mask) against torch's F.scaled_dot_product_attention."""
    def body():
        q, k, v, mask = _attn_inputs()
        expected = _sdpa(q, k, v, mask)
        rep = q.shape[1] // v.shape[1]
        v_rep = v.repeat_interleave(rep, dim=1)
        mistakes = [(h, w @ v_rep) for h, w in _weight_mistakes(q, k, mask)]
        mistakes += [(mistakes[2][0], _ref_weights(q, k, mask, repeat=None) @ v.repeat(1, rep, 1, 1)),
                     ("repeat_interleave v's heads like k's", _ref_weights(q, k, mask) @ v.repeat(1, rep, 1, 1))]
        _compare("scaled_dot_product_attention(q, k, v, causal mask)", fn(q, k, v, mask), expected,
                 atol=1e-5, mistakes=mistakes)
        expected = _sdpa(q, k, v)
        _compare("scaled_dot_product_attention(q, k, v) without a mask", fn(q, k, v), expected, atol=1e-5)
    return _run("scaled_dot_product_attention", body)


# ------------------------------------------------------------------ 03 RoPE


def _rot(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rot_interleaved(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


_PAIRS = "Qwen and Llama pair dim i with dim i + D/2 (the two halves), not neighbours 2i and 2i+1"


def rotate_half(fn) -> bool:
    """rotate_half(x): (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    def body():
        x = torch.randn(2, 3, 4, 8, generator=torch.Generator().manual_seed(0))
        x1, x2 = x.chunk(2, dim=-1)
        _compare("rotate_half(x (2, 3, 4, 8))", fn(x), _rot(x),
                 mistakes=[("signs: the first half becomes -x2, the second x1", torch.cat((x2, -x1), -1)),
                           ("the halves are swapped but one must be negated: (-x2, x1)", torch.cat((x2, x1), -1)),
                           (_PAIRS, _rot_interleaved(x))])
    return _run("rotate_half", body)


def _inv_freq(D: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))


def _cos_sin(positions, inv_freq, dtype=torch.float32):
    if positions.ndim == 1:
        positions = positions[None]
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_cos_sin(fn) -> bool:
    """rope_cos_sin(positions, inv_freq, dtype): cos, sin (B, T, D) of the angles, computed in float32."""
    def body():
        inv = _inv_freq(16)
        pos = torch.arange(6)
        cos, sin = fn(pos, inv)
        f = pos[None, :, None].float() * inv
        exp_cos, exp_sin = _cos_sin(pos, inv)
        half = "the angles are (B, T, D/2): repeat them for both halves, torch.cat((freqs, freqs), -1)"
        _compare("rope_cos_sin(arange(6), inv_freq): cos", cos, exp_cos,
                 mistakes=[(half, f.cos()), (_PAIRS, f.cos().repeat_interleave(2, -1)),
                           ("positions (T,) give B = 1: cos is (1, T, D)", exp_cos[0])])
        _compare("rope_cos_sin(arange(6), inv_freq): sin", sin, exp_sin, mistakes=[(half, f.sin())])
        batched = torch.tensor([[0, 1, 2], [5, 6, 7]])
        cos, sin = fn(batched, inv)
        _compare("rope_cos_sin((B, T) positions): cos", cos, _cos_sin(batched, inv)[0])
        far = torch.arange(4000, 4008)
        exp_cos = _cos_sin(far, inv, torch.bfloat16)[0]
        bad = torch.cat([(far[None, :, None].to(torch.bfloat16) * inv.to(torch.bfloat16))] * 2, -1).cos()
        _compare("rope_cos_sin(positions 4000.., dtype=bfloat16): cos", fn(far, inv, torch.bfloat16)[0], exp_cos,
                 atol=1e-2, mistakes=[("compute the angles in float32 and cast only cos and sin to dtype", bad)])
    return _run("rope_cos_sin", body)


def apply_rope(fn) -> bool:
    """apply_rope(x, cos, sin): x * cos + rotate_half(x) * sin, cos broadcast over the heads."""
    def body():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 4, 6, 8, generator=g)
        cos, sin = _cos_sin(torch.arange(3, 9), _inv_freq(8))  # (1, T, D), positions 3..8
        c, s = cos[:, None], sin[:, None]
        _compare("apply_rope(x (2, 4, 6, 8), cos, sin)", fn(x, cos, sin), x * c + _rot(x) * s,
                 mistakes=[("x * cos + rotate_half(x) * sin: a plus sign", x * c - _rot(x) * s),
                           ("cos goes with x, sin with rotate_half(x)", x * s + _rot(x) * c),
                           (_PAIRS, x * c + _rot_interleaved(x) * s)])
        xb = x.to(torch.bfloat16)
        _compare("apply_rope in bfloat16", fn(xb, cos, sin), xb * c.to(xb.dtype) + _rot(xb) * s.to(xb.dtype),
                 atol=3e-2, hint="cast cos and sin to x's dtype; return x's dtype")
    return _run("apply_rope", body)


# ------------------------------------------------------------------ 04 RMSNorm, SwiGLU


def _rms_ref(x, w, eps):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (w * normed.to(x.dtype)).to(x.dtype)


def rms_norm(fn) -> bool:
    """rms_norm(x, weight, eps): x / sqrt(mean(x^2) + eps) * weight, accumulated in float32."""
    def body():
        g = torch.Generator().manual_seed(0)
        x, w = 3 * torch.randn(2, 3, 64, generator=g), 1 + 0.3 * torch.randn(64, generator=g)
        eps = 1e-6
        inputdtype = "did you accumulate in fp32? x.pow(2).mean() in half precision overflows or rounds: cast x to float32 first"
        mistakes = [("normalise by the root MEAN square: mean over the last dim, not the sum",
                     x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w),
                    ("divide by the ROOT mean square: rsqrt, not 1/mean",
                     x / (x.pow(2).mean(-1, keepdim=True) + eps) * w),
                    ("multiply by the weight", x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)),
                    ("RMSNorm does not subtract the mean (that is LayerNorm)",
                     (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + eps) * w)]
        _compare("rms_norm(x fp32 (2, 3, 64))", fn(x, w, eps), _rms_ref(x, w, eps), atol=1e-5, mistakes=mistakes)
        tiny = 1e-4 * torch.randn(2, 64, generator=g)
        _compare("rms_norm at tiny activations (|x| ~ 1e-4, eps = 1e-5)", fn(tiny, w, 1e-5), _rms_ref(tiny, w, 1e-5),
                 atol=1e-5, mistakes=[("add eps inside the square root: rsqrt(mean(x^2) + eps)",
                                       tiny * torch.rsqrt(tiny.pow(2).mean(-1, keepdim=True)) * w)])
        big = (300 * torch.randn(2, 64, generator=g)).to(torch.float16)
        _compare("rms_norm(x float16 with |x| ~ 300)", fn(big, w.half(), eps), _rms_ref(big, w.half(), eps),
                 atol=1e-2, rtol=1e-2, hint=inputdtype)
        xb, wb = (3 * torch.randn(4, 16, 896, generator=g)).to(torch.bfloat16), (1 + 0.3 * torch.randn(896, generator=g)).to(torch.bfloat16)
        bad = wb * (xb * torch.rsqrt(xb.pow(2).mean(-1, keepdim=True) + eps))
        got = fn(xb, wb, eps)
        _compare("rms_norm(x bfloat16 (4, 16, 896)), exact like transformers", got, _rms_ref(xb, wb, eps),
                 atol=0, mistakes=[(inputdtype, bad)],
                 hint="normalise in float32, cast to x's dtype, THEN multiply by the weight (transformers' rounding)")
    return _run("rms_norm", body)


def mlp_forward(cls) -> bool:
    """MLP.forward: down_proj(silu(gate_proj(x)) * up_proj(x)) on the class's own projections."""
    def body():
        torch.manual_seed(0)
        mlp = cls(16, 40)
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
        x = torch.randn(2, 5, 16)
        gate, up, down = mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj
        _compare("MLP(16, 40).forward(x (2, 5, 16))", mlp(x), down(F.silu(gate) * up), atol=1e-5,
                 mistakes=[("SiLU goes on gate_proj's output, not up_proj's", down(gate * F.silu(up))),
                           ("the activation is SiLU, x * sigmoid(x)", down(F.relu(gate) * up)),
                           ("the activation is SiLU, x * sigmoid(x), not GELU", down(F.gelu(gate) * up)),
                           ("SiLU is x * sigmoid(x), not sigmoid(x) alone", down(torch.sigmoid(gate) * up)),
                           ("multiply the gate by up_proj(x) (the GLU)", down(F.silu(gate)))])
    return _run("MLP.forward", body)


# ------------------------------------------------------------------ 05 the decoder


def _tiny_config(qk_norm: bool = False):
    return ModelConfig(model_type="qwen3" if qk_norm else "qwen2", vocab_size=32, hidden_size=32,
                       intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                       attention_bias=not qk_norm, qk_norm=qk_norm)


def _ref_attention(m, x, cos, sin, mask, rope=True, norm=True):
    """Attention.forward in plain torch, on module m's own weights."""
    B, T, _ = x.shape
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    q = m.q_proj(x).view(B, T, H, D)
    k = m.k_proj(x).view(B, T, Hkv, D)
    v = m.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
    if norm and getattr(m, "q_norm", None) is not None:
        q = _rms_ref(q, m.q_norm.weight, m.q_norm.eps)
        k = _rms_ref(k, m.k_norm.weight, m.k_norm.eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if rope:
        c, s = cos[:, None], sin[:, None]
        q, k = q * c + _rot(q) * s, k * c + _rot(k) * s
    out = _sdpa(q, k, v, mask)
    return m.o_proj(out.transpose(1, 2).reshape(B, T, H * D))


def _randomise(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.ndim == 1 and p.shape[0] == 8 else 0.0))


def attention_forward(cls) -> bool:
    """Attention.forward(x, cos, sin, mask, cache, pos): projections, RoPE, GQA attention, o_proj."""
    def body():
        for qk_norm in (False, True):
            cfg = _tiny_config(qk_norm)
            m = cls(cfg)
            _randomise(m)
            T = 6
            x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
            cos, sin = _cos_sin(torch.arange(T), _inv_freq(cfg.head_dim))
            mask = _causal(T, T, 0)
            expected = _ref_attention(m, x, cos, sin, mask)
            name = "Qwen3 (q/k norm)" if qk_norm else "Qwen2 (qkv bias)"
            mistakes = [("apply RoPE to q and k, after splitting the heads", _ref_attention(m, x, cos, sin, mask, rope=False)),
                        ("pass the mask to the attention", _ref_attention(m, x, cos, sin, None))]
            if qk_norm:
                mistakes.append(("Qwen3: apply q_norm and k_norm to each head, before RoPE",
                                 _ref_attention(m, x, cos, sin, mask, norm=False)))
            _compare(f"Attention.forward, {name}, no cache", m(x, cos, sin, mask), expected, atol=1e-5, mistakes=mistakes)
            cache = KVCache(2, 16, cfg.num_key_value_heads, cfg.head_dim)
            first = m(x[:, :4], cos[:, :4], sin[:, :4], _causal(4, 4, 0), cache, 0)
            _compare(f"Attention.forward, {name}, cache prefill of 4 tokens", first, expected[:, :4], atol=1e-5,
                     hint="with a cache: k, v = cache.update(pos, k, v) after RoPE, then attend to all of them")
            step = m(x[:, 4:], cos[:, 4:], sin[:, 4:], _causal(2, 6, 4), cache, 4)
            _compare(f"Attention.forward, {name}, 2 more tokens at pos 4 with the cache", step, expected[:, 4:],
                     atol=1e-5, hint="RoPE the new k before cache.update(pos, k, v), and attend to what update returns")
    return _run("Attention.forward", body)


def decoder_layer_forward(cls) -> bool:
    """DecoderLayer.forward: x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(.))."""
    def body():
        cfg = _tiny_config()
        layer = cls(cfg)
        _randomise(layer)
        T = 5
        x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        cos, sin = _cos_sin(torch.arange(T), _inv_freq(cfg.head_dim))
        mask = _causal(T, T, 0)
        attn = lambda y: layer.self_attn(y, cos, sin, mask)
        n1, n2, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
        h = x + attn(n1(x))
        expected = h + mlp(n2(h))
        post = n1(x + attn(x))  # post-norm: normalise after each residual add
        mistakes = [("pre-norm: normalise each block's input, add the block's output to the un-normalised x",
                     n2(post + mlp(post))),
                    ("add the residual x + attn(...) before the MLP block", attn(n1(x)) + mlp(n2(attn(n1(x))))),
                    ("the MLP block adds its output to h = x + attn(...)", h + mlp(n2(h)) - h + x),
                    ("the MLP block uses post_attention_layernorm", h + mlp(n1(h))),
                    ("normalise with post_attention_layernorm before the MLP", h + mlp(h))]
        _compare("DecoderLayer.forward(x (2, 5, 32))", layer(x, cos, sin, mask), expected, atol=1e-5, mistakes=mistakes)
    return _run("DecoderLayer.forward", body)


# ------------------------------------------------------------------ 08 KV cache


def kv_cache_update(cls) -> bool:
    """KVCache.update(pos, k, v): write at slots pos..pos+T-1, return views of slots 0..pos+T-1."""
    def body():
        g = torch.Generator().manual_seed(0)
        B, Hkv, S_max, D = 2, 2, 10, 4
        cache = cls(B, S_max, Hkv, D)
        k1, v1 = torch.randn(B, Hkv, 4, D, generator=g), torch.randn(B, Hkv, 4, D, generator=g)
        k2, v2 = torch.randn(B, Hkv, 1, D, generator=g), torch.randn(B, Hkv, 1, D, generator=g)
        k3, v3 = torch.randn(B, Hkv, 2, D, generator=g), torch.randn(B, Hkv, 2, D, generator=g)
        full = "return only positions 0..pos+T-1 (k[:, :, :pos + T]), not the whole preallocated buffer"
        got_k, got_v = cache.update(0, k1, v1)
        _compare("update(0, k of 4 tokens): returned k", got_k, k1, hint=full)
        _compare("update(0, v of 4 tokens): returned v", got_v, v1, hint="write v into the v buffer")
        got_k, got_v = cache.update(4, k2, v2)
        exp_k, exp_v = torch.cat([k1, k2], 2), torch.cat([v1, v2], 2)
        stale = torch.cat([k2, k1[:, :, 1:], torch.zeros_like(k2)], 2)
        _compare("update(4, k of 1 token): returned k", got_k, exp_k, hint=full,
                 mistakes=[("write at slots pos..pos+T-1 (the time dim, dim 2), not at slot 0", stale)])
        _compare("update(4, v of 1 token): returned v", got_v, exp_v, hint=full)
        for name, got in (("k", got_k), ("v", got_v)):
            buffer = getattr(cache, name, None)
            if isinstance(buffer, torch.Tensor) and got.data_ptr() != buffer.data_ptr():
                _fail(f"update returned a copy of {name}, not a view of the cache's buffer",
                      "slice the buffer (self.k[:, :, :pos + T]) instead of torch.cat or .clone(): no copy per step")
        got_k, _ = cache.update(5, k3, v3)
        _compare("update(5, k of 2 tokens) after 5 cached: returned k", got_k, torch.cat([k1, k2, k3], 2), hint=full)
    return _run("KVCache.update", body)


# ------------------------------------------------------------------ 11 paged cache


def _paged_pool(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(8, 4, 2, 3)  # 8 blocks of 4 slots, Hkv 2, D 3
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def gather_reference(fn) -> bool:
    """gather_reference(cache, block_table, length) -> k, v (Hkv, length, D), read block by block."""
    def body():
        cache = _paged_pool()
        table, length = [5, 1, 6], 10  # 4 + 4 + 2 tokens: the last block only partly used
        slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(length)])
        expected_k = cache.k.view(-1, 2, 3)[slots].transpose(0, 1)  # (length, Hkv, D) -> (Hkv, length, D)
        expected_v = cache.v.view(-1, 2, 3)[slots].transpose(0, 1)
        got = fn(cache, table, length)
        if not isinstance(got, tuple) or len(got) != 2:
            _fail(f"expected a tuple (k, v), got {type(got).__name__}")
        whole = cache.k[table].reshape(-1, 2, 3).transpose(0, 1)  # every slot of every block
        _compare("k for table [5, 1, 6], length 10", got[0], expected_k,
                 mistakes=[("the last block is only partly used: take length - i * block_size rows of it", whole),
                           ("return (Hkv, length, D): transpose the (length, Hkv, D) you gathered",
                            expected_k.transpose(0, 1))],
                 hint="block i of the table holds positions i*bs .. i*bs+bs-1: read cache.k[block, :n] in table order")
        _compare("v for table [5, 1, 6], length 10", got[1], expected_v, hint="read v from cache.v, like k")
    return _run("gather_reference", body)


def batch_layout(fn) -> bool:
    """batch_layout(manager, seq_ids, T) -> BatchLayout with right-aligned rows."""
    def body():
        manager = BlockManager(16, 4, enable_prefix_caching=False)
        manager.allocate("a", list(range(10, 19)))  # 9 tokens
        manager.allocate("b", list(range(30, 35)))  # 5 tokens
        lengths = {"a": 9, "b": 5}
        S, T = 9, 1
        got = fn(manager, ["a", "b"], T)
        rows = {s: [manager.slot(s, p) for p in range(L)] for s, L in lengths.items()}
        expected_gather = torch.tensor([[0] * (S - L) + rows[s] for s, L in lengths.items()])
        expected_mask = torch.tensor([[0] * (S - L) + [1] * L for L in lengths.values()])
        left_aligned = torch.tensor([rows[s] + [0] * (S - L) for s, L in lengths.items()])
        right_hint = "right-align each row: padding goes on the LEFT, so every row's newest tokens share the last columns"
        _compare("gather", got.gather, expected_gather, mistakes=[(right_hint, left_aligned)],
                 hint="gather[b] lists the pool slot of each key position 0..L_b-1, after S - L_b padding columns")
        _compare("attention_mask", got.attention_mask, expected_mask, hint="1 for a real key, 0 for padding")
        _compare("slots", got.slots, torch.tensor([[rows["a"][-1]], [rows["b"][-1]]]),
                 hint="slots are where the T new tokens go: the slots of positions L_b - T .. L_b - 1")
        _compare("positions", got.positions, torch.tensor([[8], [4]]),
                 mistakes=[("positions count from each sequence's own start: L_b - T .. L_b - 1, not the padded column",
                            torch.tensor([[8], [8]]))])
        if got.start_pos != S - T:
            _fail(f"start_pos: expected {S - T}, got {got.start_pos}",
                  "start_pos is the number of key columns before the new tokens: S - T")
    return _run("batch_layout", body)


# ------------------------------------------------------------------ 09 sampling

_NEG = float("-inf")


def _no_inplace(what: str, fn, logits: torch.Tensor, *args):
    before = logits.clone()
    out = fn(logits, *args)
    if not torch.equal(logits, before):
        _fail(f"{what} changed its input logits", "don't modify logits in place: masked_fill, not masked_fill_")
    return out


def top_k_filter(fn) -> bool:
    """top_k_filter(logits, k): keep the k largest logits per row (and ties with the k-th), others -inf."""
    def body():
        logits = torch.tensor([[1.0, 4.0, 2.0, 3.0, 0.5, -1.0], [0.0, -2.0, 5.0, 1.0, 2.5, 3.5]])
        def keep(k):
            kth = logits.topk(k, -1).values[:, -1:]
            return logits.masked_fill(logits < kth, _NEG)
        _compare("top_k_filter(logits (2, 6), k=3)", _no_inplace("top_k_filter", fn, logits, 3), keep(3),
                 mistakes=[("keep exactly k tokens: off by one", keep(2)), ("keep exactly k tokens: off by one", keep(4)),
                           ("removed logits become -inf, not 0 (a logit of 0 still has probability)",
                            logits.masked_fill(logits < logits.topk(3, -1).values[:, -1:], 0.0)),
                           ("return logits, not probabilities", torch.softmax(keep(3), -1))])
        _compare("top_k_filter(logits, k=0) keeps all", fn(logits, 0), logits, hint="k = 0 means off: return logits")
        _compare("top_k_filter(logits, k=6 = V) keeps all", fn(logits, 6), logits)
        ties = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0]])
        _compare("top_k_filter with ties at the k-th value, k=2", fn(ties, 2),
                 ties.masked_fill(ties < 3.0, _NEG), hint="keep ties with the k-th largest: remove only logits < the k-th value")
    return _run("top_k_filter", body)


def _logits_of(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def top_p_filter(fn) -> bool:
    """top_p_filter(logits, p): keep the most likely tokens until their mass reaches p, the crossing one too."""
    def body():
        probs = [[0.05, 0.25, 0.10, 0.45, 0.15], [0.30, 0.05, 0.40, 0.10, 0.15]]
        logits = _logits_of(probs)
        def keep(row_sets):
            remove = torch.ones_like(logits, dtype=torch.bool)
            for r, cols in enumerate(row_sets):
                remove[r, cols] = False
            return logits.masked_fill(remove, _NEG)
        # p = 0.6: row 0 keeps 0.45, 0.25 (0.45 + 0.25 crosses 0.6); row 1 keeps 0.40, 0.30
        expected = keep([[3, 1], [2, 0]])
        sorted_order = [[0, 1], [0, 1]]  # the sorted-order mask applied without scattering back
        _compare("top_p_filter(logits, p=0.6)", _no_inplace("top_p_filter", fn, logits, 0.6), expected,
                 mistakes=[("did you keep the token that crosses the threshold? keep a token while the mass BEFORE it is < p",
                            keep([[3], [2]])),
                           ("keep a token while the mass before it is < p (you kept one past the crossing token)",
                            keep([[3, 1, 4], [2, 0, 4]])),
                           ("the mask was computed in sorted order: scatter it back to vocabulary order", keep(sorted_order)),
                           ("removed logits become -inf, not 0", logits.masked_fill(torch.isinf(expected), 0.0))])
        _compare("top_p_filter(logits, p=0.1) keeps the most likely token", fn(logits, 0.1), keep([[3], [2]]),
                 hint="the most likely token is always kept (the mass before it is 0)")
        _compare("top_p_filter(logits, p=1.0) keeps all", fn(logits, 1.0), logits)
    return _run("top_p_filter", body)


def min_p_filter(fn) -> bool:
    """min_p_filter(logits, p): keep tokens with probability >= p * (the top token's probability)."""
    def body():
        logits = _logits_of([[0.05, 0.2, 0.5, 0.15, 0.1], [0.3, 0.25, 0.2, 0.15, 0.1]])
        probs = torch.softmax(logits, -1)
        def keep_rel(p):
            return logits.masked_fill(probs < p * probs.amax(-1, keepdim=True), _NEG)
        _compare("min_p_filter(logits, p=0.35)", _no_inplace("min_p_filter", fn, logits, 0.35), keep_rel(0.35),
                 mistakes=[("the threshold is p times the top token's probability, not p itself",
                            logits.masked_fill(probs < 0.35, _NEG)),
                           ("compare probabilities (softmax), not logits",
                            logits.masked_fill(logits < 0.35 * logits.amax(-1, keepdim=True), _NEG)),
                           ("removed logits become -inf, not 0", logits.masked_fill(probs < 0.35 * probs.amax(-1, keepdim=True), 0.0))])
        _compare("min_p_filter(logits, p=0) keeps all", fn(logits, 0.0), logits)
        _compare("min_p_filter(logits, p=1) keeps only the top token", fn(logits, 1.0), keep_rel(1.0))
    return _run("min_p_filter", body)


# ------------------------------------------------------------------ 13 quantization


def quantize_int4(fn) -> bool:
    """quantize_int4(w, group_size, name) -> q (N, K) uint8 in 0..15, scales, zeros (N, K/g): w ≈ (q - 8) * s + z."""
    def body():
        w = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
        for g in (32, 64):
            got = fn(w, g)
            if not isinstance(got, tuple) or len(got) != 3:
                _fail(f"expected a tuple (q, scales, zeros), got {type(got).__name__}")
            q, scales, zeros = got
            wg = w.view(3, 128 // g, g)  # independent min/max per group
            lo, hi = wg.min(-1).values, wg.max(-1).values
            s = (hi - lo) / 15
            what = f"quantize_int4(w (3, 128), group_size={g})"
            _compare(f"{what}: scales", scales, s, atol=1e-6, rtol=1e-5,
                     mistakes=[("16 levels 0..15 span hi - lo in 15 steps: divide by 15, not 16", (hi - lo) / 16)],
                     hint="one scale per group of g consecutive inputs in a row: (max - min) / 15")
            _compare(f"{what}: zeros", zeros, lo + 8 * s, atol=1e-5, rtol=1e-5,
                     mistakes=[("w ≈ (q - 8) * scale + zero, so zero is the value q = 8 stands for: lo + 8 * scale", lo)])
            if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.shape != w.shape:
                _fail(f"{what}: q is {getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}, "
                      "expected uint8 (3, 128)", "return q as uint8 of w's shape (reshape the groups back)")
            if int(q.max()) > 15:
                _fail(f"{what}: q reaches {int(q.max())}", "clamp q to 0..15")
            err = ((q.float().view_as(wg) - 8) * s[..., None] + (lo + 8 * s)[..., None] - wg).abs()
            bad = err > s[..., None] / 2 + 1e-5
            if bad.any():
                idx = tuple(int(i) for i in bad.nonzero()[0])
                _fail(f"{what}: q decodes {int(bad.sum())} weights to more than half a step from w; first at "
                      f"(row, group, i) = {idx}", "q = round((w - lo) / scale): lo -> 0, hi -> 15")
        _expect_raises("quantize_int4(w (3, 96), group_size=64)", ValueError, lambda: fn(w[:, :96], 64),
                       "the group size must divide K: call check_group_size(K, group_size, name) first")
    return _run("quantize_int4", body)


def _q4_1_decode(raw: torch.Tensor, shape, pairs: str = "j, j+16", offset: float = 0.0) -> torch.Tensor:
    """Q4_1 decoded with a given nibble order (the right one, or a mistake's)."""
    b = raw.reshape(-1, 20)
    d, m = b[:, 0:2].contiguous().view(torch.float16).float(), b[:, 2:4].contiguous().view(torch.float16).float()
    lo, hi = b[:, 4:] & 0x0F, b[:, 4:] >> 4
    q = torch.cat([lo, hi], -1) if pairs == "j, j+16" else torch.stack([lo, hi], -1).reshape(-1, 32)
    return (d * (q.float() - offset) + m).reshape(tuple(shape))


def dequantize_q4_1(fn) -> bool:
    """dequantize_q4_1(raw, shape): GGUF Q4_1 blocks -> float32 weights, checked against the gguf package."""
    def body():
        x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
        packed = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_1)  # (2, 40): 2 blocks per row
        expected = torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q4_1).copy())
        raw = torch.from_numpy(packed.reshape(-1).copy())
        _compare("dequantize_q4_1(4 blocks, shape (2, 64))", fn(raw, (2, 64)), expected,
                 mistakes=[("nibble order: byte j holds q_j (low 4 bits) and q_{j+16} (high 4 bits), "
                            "not q_{2j} and q_{2j+1}", _q4_1_decode(raw, (2, 64), "2j, 2j+1")),
                           ("Q4_1 has no -8: w = d * q + m (the minimum m is stored)",
                            _q4_1_decode(raw, (2, 64), offset=8.0))],
                 hint="block = | d: fp16 | m: fp16 | 16 bytes of nibbles |; w_i = d * q_i + m")
    return _run("dequantize_q4_1", body)


# ------------------------------------------------------------------ the command line

CHECKS: dict[str, Callable[[object], bool]] = {
    "contiguous_strides": contiguous_strides, "transpose": transpose, "expand": expand, "matmul": matmul,
    "causal_mask": causal_mask, "attention_weights": attention_weights,
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "rotate_half": rotate_half, "rope_cos_sin": rope_cos_sin, "apply_rope": apply_rope,
    "rms_norm": rms_norm, "MLP.forward": mlp_forward,
    "Attention.forward": attention_forward, "DecoderLayer.forward": decoder_layer_forward,
    "KVCache.update": kv_cache_update, "gather_reference": gather_reference, "batch_layout": batch_layout,
    "top_k_filter": top_k_filter, "top_p_filter": top_p_filter, "min_p_filter": min_p_filter,
    "quantize_int4": quantize_int4, "dequantize_q4_1": dequantize_q4_1,
}
"""Exercise name (a function, or Class.method) -> its check, which takes the function or the class."""

_EXPORT = re.compile(r"^#\|\s*export")


def check_namespace(ns: dict, names: list[str] | None = None) -> tuple[int, int]:
    """Run the checks for `names` (default: every checkable name defined in ns); return (passed, total)."""
    if names is None:  # the checkable names the code defines itself (not those it imports)
        names = [n for n in CHECKS
                 if getattr(ns.get(n.split(".")[0]), "__module__", None) == ns.get("__name__", "__main__")]
    passed = 0
    for name in names:
        obj = ns.get(name.split(".")[0])
        if obj is None:
            print(f"FAIL {name}: not defined")
            continue
        passed += CHECKS[name](obj)
    return passed, len(names)


def _notebook_code(path: Path) -> tuple[str, list[str] | None]:
    """The code of a notebook's module cells (exercise cells tagged 'module', or '#| export' cells), and its stubs."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    chunks = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        tagged = "module" in cell.get("metadata", {}).get("tags", [])
        if tagged or any(_EXPORT.match(line) for line in src.splitlines()):
            chunks.append("\n".join(line for line in src.splitlines() if not line.startswith("#|")))
    stubs = nb.get("metadata", {}).get("minillm", {}).get("stubs")
    lines = "\n\n".join(chunks).splitlines()  # several modules' cells: their __future__ imports go first
    future = [line for line in lines if line.startswith("from __future__ import")]
    return "\n".join([*dict.fromkeys(future), *(line for line in lines if line not in future)]), stubs


def check_path(path: str | Path) -> tuple[int, int]:
    """Load a student's notebook (.ipynb) or module (.py) and run every check it has code for."""
    path = Path(path)
    if path.suffix == ".ipynb":
        code, stubs = _notebook_code(path)
    else:
        code, stubs = path.read_text(encoding="utf-8"), None
    name = "minillm_student_" + re.sub(r"\W", "_", path.stem)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # dataclasses look their module up
    try:
        exec(compile(code, str(path), "exec"), module.__dict__)
    except Exception as exc:
        print(f"FAIL {path}: its code does not run: {type(exc).__name__}: {exc}")
        return 0, len(stubs or []) or 1
    finally:
        sys.modules.pop(name, None)
    return check_namespace(module.__dict__, stubs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.check",
                                     description="Check exercise notebooks or student modules.")
    parser.add_argument("paths", nargs="+", type=Path, help="exercise notebooks, .py modules, or folders of them")
    args = parser.parse_args(argv)
    files: list[Path] = []
    for p in args.paths:
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.suffix in (".ipynb", ".py") and ".ipynb_checkpoints" not in q.parts)
        elif p.exists():
            files.append(p)
        else:
            print(f"error: {p} does not exist", file=sys.stderr)
            return 2
    results = []
    for f in files:
        print(f"== {f}")
        results.append((f, *check_path(f)))
    if len(results) > 1:
        print("\nsummary")
        for f, passed, total in results:
            print(f"  {passed}/{total}  {f}")
    return 0 if all(p == t for _, p, t in results) else 1


if __name__ == "__main__":
    sys.exit(main())
