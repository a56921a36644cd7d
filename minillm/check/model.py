"""Exercise checks of notebooks 01-05: tensors, attention, RoPE, RMSNorm and SwiGLU, the decoder.

Each takes a student's function or class and returns True (PASS) or False (FAIL, with feedback);
see minillm/check/__init__.py for how they are called.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minillm.check.harness import compare, expect_raises, fail, run_check
from minillm.cache.dense import KVCache
from minillm.model.decoder import ModelConfig
from minillm.model.tensor import Tensor, narrow
from minillm.model.tensor import transpose as _transpose  # `transpose` here is the check of a student's transpose


# ------------------------------------------------------------------ 01 tensors


def _tensor(t: torch.Tensor):
    return Tensor.from_torch(t)


def _check_view(what: str, got, expected: torch.Tensor, source=None, hint_stride: str | None = None) -> None:
    """got is a minillm-style Tensor (duck-typed) that should equal the torch view `expected`."""
    for attr in ("shape", "stride", "tolist"):
        if not hasattr(got, attr):
            fail(f"{what}: expected a Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if tuple(got.stride()) != tuple(expected.stride()):
        fail(f"{what}: strides {tuple(got.stride())}, expected {tuple(expected.stride())}", hint_stride)
    if source is not None and getattr(got, "storage", None) is not source.storage:
        fail(f"{what}: the result has its own storage", "a view must not copy: build a new Layout over the same Storage")
    if got.tolist() != expected.tolist():
        fail(f"{what}: values {got.tolist()}, expected {expected.tolist()}",
             "keep the layout's offset (a view of a view starts where its source starts)")


def contiguous_strides(fn) -> bool:
    """contiguous_strides(shape) -> row-major strides, as torch gives a contiguous tensor."""
    def body():
        for shape in [(2, 3, 4), (5,), (), (3, 1, 2), (4, 5)]:
            expected = torch.empty(shape).stride()
            got = fn(shape)
            if not isinstance(got, tuple):
                fail(f"contiguous_strides({shape}) returned a {type(got).__name__}, expected a tuple {expected}")
            if got == tuple(reversed(expected)) and got != expected:
                fail(f"contiguous_strides({shape}) = {got}, expected {expected}",
                     "you built them from the last dimension: reverse the list at the end")
            if got != expected:
                including = tuple(s * n for s, n in zip(expected, shape))
                fail(f"contiguous_strides({shape}) = {got}, expected {expected}",
                     "each stride is the product of the sizes AFTER that dimension (not including it)"
                     if got == including else "the last dimension moves by 1, each earlier one by the size of what follows")
    return run_check("contiguous_strides", body)


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
    return run_check("transpose", body)


def expand(fn) -> bool:
    """expand(t, shape): size-1 dims broadcast with stride 0, no copy."""
    def body():
        base = torch.arange(3.0).view(3, 1)
        t = _tensor(base)
        hint = "a broadcast dimension gets stride 0, and new leading dimensions too"
        _check_view("expand(t (3, 1), (3, 4))", fn(t, (3, 4)), base.expand(3, 4), t, hint)
        _check_view("expand(t (3, 1), (2, 3, 4))", fn(t, (2, 3, 4)), base.expand(2, 3, 4), t, hint)
        _check_view("expand(t (3, 1), (-1, 5))", fn(t, (-1, 5)), base.expand(-1, 5), t, "-1 keeps that dimension's size")
        expect_raises("expand(t (3, 1), (4, 4))", ValueError, lambda: fn(t, (4, 4)),
                      "only size-1 dimensions can grow: raise ValueError for size 3 -> 4")
    return run_check("expand", body)


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
                fail(f"{what}: expected a Tensor, got {type(got).__name__}")
            if tuple(got.shape) != tuple(expected.shape):
                fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}", hint)
            compare(what, torch.tensor(got.tolist()), expected, atol=1e-5, hint=hint)
    return run_check("matmul", body)


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
            compare(f"causal_mask(T={T}, S={S}, start={start})", fn(T, S, start), expected, mistakes=mistakes)
    return run_check("causal_mask", body)


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
        compare("attention_weights(q, k, causal mask)", fn(q, k, mask), _ref_weights(q, k, mask),
                atol=1e-6, mistakes=_weight_mistakes(q, k, mask))
        compare("attention_weights(q, k) without a mask", fn(q, k), _ref_weights(q, k, None), atol=1e-6)
        empty = mask.clone()
        empty[0] = False  # query 0 may attend to nothing
        compare("attention_weights with a query row that may attend to no key", fn(q, k, empty),
                _ref_weights(q, k, empty), hint="a row with no allowed key must give zeros, not NaN")
        qb, kb, _, _ = _attn_inputs(torch.bfloat16)
        compare("attention_weights in bfloat16", fn(qb, kb, mask), _ref_weights(qb, kb, mask), atol=1e-2,
                hint="do the softmax in float32, return q's dtype")
    return run_check("attention_weights", body)


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
        compare("scaled_dot_product_attention(q, k, v, causal mask)", fn(q, k, v, mask), expected,
                atol=1e-5, mistakes=mistakes)
        expected = _sdpa(q, k, v)
        compare("scaled_dot_product_attention(q, k, v) without a mask", fn(q, k, v), expected, atol=1e-5)
    return run_check("scaled_dot_product_attention", body)


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
        compare("rotate_half(x (2, 3, 4, 8))", fn(x), _rot(x),
                mistakes=[("signs: the first half becomes -x2, the second x1", torch.cat((x2, -x1), -1)),
                           ("the halves are swapped but one must be negated: (-x2, x1)", torch.cat((x2, x1), -1)),
                           (_PAIRS, _rot_interleaved(x))])
    return run_check("rotate_half", body)


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
        compare("rope_cos_sin(arange(6), inv_freq): cos", cos, exp_cos,
                mistakes=[(half, f.cos()), (_PAIRS, f.cos().repeat_interleave(2, -1)),
                           ("positions (T,) give B = 1: cos is (1, T, D)", exp_cos[0])])
        compare("rope_cos_sin(arange(6), inv_freq): sin", sin, exp_sin, mistakes=[(half, f.sin())])
        batched = torch.tensor([[0, 1, 2], [5, 6, 7]])
        cos, sin = fn(batched, inv)
        compare("rope_cos_sin((B, T) positions): cos", cos, _cos_sin(batched, inv)[0])
        far = torch.arange(4000, 4008)
        exp_cos = _cos_sin(far, inv, torch.bfloat16)[0]
        bad = torch.cat([(far[None, :, None].to(torch.bfloat16) * inv.to(torch.bfloat16))] * 2, -1).cos()
        compare("rope_cos_sin(positions 4000.., dtype=bfloat16): cos", fn(far, inv, torch.bfloat16)[0], exp_cos,
                atol=1e-2, mistakes=[("compute the angles in float32 and cast only cos and sin to dtype", bad)])
    return run_check("rope_cos_sin", body)


def apply_rope(fn) -> bool:
    """apply_rope(x, cos, sin): x * cos + rotate_half(x) * sin, cos broadcast over the heads."""
    def body():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 4, 6, 8, generator=g)
        cos, sin = _cos_sin(torch.arange(3, 9), _inv_freq(8))  # (1, T, D), positions 3..8
        c, s = cos[:, None], sin[:, None]
        compare("apply_rope(x (2, 4, 6, 8), cos, sin)", fn(x, cos, sin), x * c + _rot(x) * s,
                mistakes=[("x * cos + rotate_half(x) * sin: a plus sign", x * c - _rot(x) * s),
                           ("cos goes with x, sin with rotate_half(x)", x * s + _rot(x) * c),
                           (_PAIRS, x * c + _rot_interleaved(x) * s)])
        xb = x.to(torch.bfloat16)
        compare("apply_rope in bfloat16", fn(xb, cos, sin), xb * c.to(xb.dtype) + _rot(xb) * s.to(xb.dtype),
                atol=3e-2, hint="cast cos and sin to x's dtype; return x's dtype")
    return run_check("apply_rope", body)


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
        compare("rms_norm(x fp32 (2, 3, 64))", fn(x, w, eps), _rms_ref(x, w, eps), atol=1e-5, mistakes=mistakes)
        tiny = 1e-4 * torch.randn(2, 64, generator=g)
        compare("rms_norm at tiny activations (|x| ~ 1e-4, eps = 1e-5)", fn(tiny, w, 1e-5), _rms_ref(tiny, w, 1e-5),
                atol=1e-5, mistakes=[("add eps inside the square root: rsqrt(mean(x^2) + eps)",
                                       tiny * torch.rsqrt(tiny.pow(2).mean(-1, keepdim=True)) * w)])
        big = (300 * torch.randn(2, 64, generator=g)).to(torch.float16)
        compare("rms_norm(x float16 with |x| ~ 300)", fn(big, w.half(), eps), _rms_ref(big, w.half(), eps),
                atol=1e-2, rtol=1e-2, hint=inputdtype)
        xb, wb = (3 * torch.randn(4, 16, 896, generator=g)).to(torch.bfloat16), (1 + 0.3 * torch.randn(896, generator=g)).to(torch.bfloat16)
        bad = wb * (xb * torch.rsqrt(xb.pow(2).mean(-1, keepdim=True) + eps))
        got = fn(xb, wb, eps)
        compare("rms_norm(x bfloat16 (4, 16, 896)), exact like transformers", got, _rms_ref(xb, wb, eps),
                atol=0, mistakes=[(inputdtype, bad)],
                hint="normalise in float32, cast to x's dtype, THEN multiply by the weight (transformers' rounding)")
    return run_check("rms_norm", body)


def mlp_forward(cls) -> bool:
    """MLP.forward: down_proj(silu(gate_proj(x)) * up_proj(x)) on the class's own projections."""
    def body():
        torch.manual_seed(0)
        mlp = cls(16, 40)
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
        x = torch.randn(2, 5, 16)
        gate, up, down = mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj
        compare("MLP(16, 40).forward(x (2, 5, 16))", mlp(x), down(F.silu(gate) * up), atol=1e-5,
                mistakes=[("SiLU goes on gate_proj's output, not up_proj's", down(gate * F.silu(up))),
                           ("the activation is SiLU, x * sigmoid(x)", down(F.relu(gate) * up)),
                           ("the activation is SiLU, x * sigmoid(x), not GELU", down(F.gelu(gate) * up)),
                           ("SiLU is x * sigmoid(x), not sigmoid(x) alone", down(torch.sigmoid(gate) * up)),
                           ("multiply the gate by up_proj(x) (the GLU)", down(F.silu(gate)))])
    return run_check("MLP.forward", body)


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


def _layer_inputs(cfg: ModelConfig, T: int):
    """x (2, T, h), cos and sin of positions 0..T-1, and the causal mask: one layer's inputs."""
    x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = _cos_sin(torch.arange(T), _inv_freq(cfg.head_dim))
    return x, cos, sin, _causal(T, T, 0)


def attention_forward(cls) -> bool:
    """Attention.forward(x, cos, sin, mask, cache, pos): projections, RoPE, GQA attention, o_proj."""
    def body():
        for qk_norm in (False, True):
            cfg = _tiny_config(qk_norm)
            m = cls(cfg)
            _randomise(m)
            x, cos, sin, mask = _layer_inputs(cfg, T=6)
            expected = _ref_attention(m, x, cos, sin, mask)
            name = "Qwen3 (q/k norm)" if qk_norm else "Qwen2 (qkv bias)"
            mistakes = [("apply RoPE to q and k, after splitting the heads", _ref_attention(m, x, cos, sin, mask, rope=False)),
                        ("pass the mask to the attention", _ref_attention(m, x, cos, sin, None))]
            if qk_norm:
                mistakes.append(("Qwen3: apply q_norm and k_norm to each head, before RoPE",
                                 _ref_attention(m, x, cos, sin, mask, norm=False)))
            compare(f"Attention.forward, {name}, no cache", m(x, cos, sin, mask), expected, atol=1e-5, mistakes=mistakes)
            cache = KVCache(2, 16, cfg.num_key_value_heads, cfg.head_dim)
            first = m(x[:, :4], cos[:, :4], sin[:, :4], _causal(4, 4, 0), cache, 0)
            compare(f"Attention.forward, {name}, cache prefill of 4 tokens", first, expected[:, :4], atol=1e-5,
                    hint="with a cache: k, v = cache.update(pos, k, v) after RoPE, then attend to all of them")
            step = m(x[:, 4:], cos[:, 4:], sin[:, 4:], _causal(2, 6, 4), cache, 4)
            compare(f"Attention.forward, {name}, 2 more tokens at pos 4 with the cache", step, expected[:, 4:],
                    atol=1e-5, hint="RoPE the new k before cache.update(pos, k, v), and attend to what update returns")
    return run_check("Attention.forward", body)


def decoder_layer_forward(cls) -> bool:
    """DecoderLayer.forward: x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(.))."""
    def body():
        cfg = _tiny_config()
        layer = cls(cfg)
        _randomise(layer)
        x, cos, sin, mask = _layer_inputs(cfg, T=5)
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
        compare("DecoderLayer.forward(x (2, 5, 32))", layer(x, cos, sin, mask), expected, atol=1e-5, mistakes=mistakes)
    return run_check("DecoderLayer.forward", body)
