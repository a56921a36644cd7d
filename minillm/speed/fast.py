# Generated from notebooks/13_fast_path.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The fast decode path: the same model and forward contract as CausalLM, less per-token overhead.

Built in notebooks/13_fast_path.ipynb ("A fast path"). `FastCausalLM(model)` takes a
loaded CausalLM and rebuilds its layers for speed, keeping `forward(input_ids, positions,
attention_mask, cache, start_pos)`, so generate, the engine and the server run it unchanged:

- q/k/v and gate/up projections fused into one matrix each (one weight read, one kernel call);
- RoPE's cos/sin computed once for every position (rope_tables), then indexed (rope_rows);
  RoPE applied to q and k at once;
- grouped-query attention through torch's SDPA (no repeat_kv copy), no mask at decode (fast_mask);
- torch's fused RMSNorm; optional int8 / int4 weights (minillm.speed.quant) and torch.compile.

Shape legend: B batch, T tokens, S keys, H heads, Hkv kv heads, D head dim, V vocab.

References: gpt-fast (fused qkv, int4 weight-only decode); PyTorch's SDPA documentation
(enable_gqa); the roofline model (Williams, Waterman and Patterson, CACM 2009).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm.cache.dense import KVCache, make_cache
from minillm.model.attention import attention_mask as build_attention_mask
from minillm.model.decoder import (CausalLM, ModelConfig, validate_forward_inputs, keep_columns, padded_positions,
                                   rope_frequencies, rope_scale)
from minillm.speed.cpu_kernel import decode_in_one_call, decode_layer_parts, fast_int8_table, fast_quantized_linear
from minillm.speed.quant import MODES

QUANTIZE_CHOICES = (None, *MODES)  # None: the model's own dtype


def fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One nn.Linear computing several that read the same input: weights stacked along the output dim."""
    first = linears[0]
    if any(lin.in_features != first.in_features or (lin.bias is None) != (first.bias is None) for lin in linears):
        raise ValueError("fuse_linears: the layers must share in_features and all have (or lack) a bias")
    fused = nn.Linear(first.in_features, sum(lin.out_features for lin in linears), bias=first.bias is not None,
                      dtype=first.weight.dtype, device=first.weight.device)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))  # (N1 + N2 + ..., K)
        if first.bias is not None:
            fused.bias.copy_(torch.cat([lin.bias for lin in linears]))
    return fused


def rope_tables(config: ModelConfig, device=None, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos and sin of every position's RoPE angles (times YaRN's factor, if any), (P, D) each for
    P = max_position_embeddings."""
    freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32),
                        rope_frequencies(config))  # (P, D/2)
    angles = torch.cat((freqs, freqs), dim=-1).to(device)  # (P, D): pair (i, i + D/2) shares one angle
    scale = rope_scale(config)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rope_rows(cos: Tensor, sin: Tensor, positions: Tensor | None, attention_mask: Tensor | None,
              start_pos: int, T: int, S: int) -> tuple[Tensor, Tensor]:
    """The rows of the (P, D) tables for this forward, (B or 1, T, D) each: new tensors, never views of the
    tables, so that a compiled layer (below) always meets its inputs in one layout."""
    if positions is None and attention_mask is not None:  # left padding: count real tokens before each one
        positions = padded_positions(attention_mask, start_pos)  # (B, T)
    if positions is None:
        positions = torch.arange(start_pos, S, device=cos.device)  # (T,)
    positions = positions.view(-1, T)  # (B or 1, T)
    return cos[positions], sin[positions]


def fast_mask(T: int, S: int, start_pos: int, attention_mask: Tensor | None, device) -> Tensor | None:
    """None when SDPA needs no mask (decode, or a fresh unpadded prompt: is_causal); else (B or 1, 1, T, S)."""
    if attention_mask is None and not (T > 1 and start_pos > 0):
        return None
    return build_attention_mask(T, S, start_pos, attention_mask, device)


def embedding_and_head(model: CausalLM, quantize: str | None, group_size: int,
                       kernel: str) -> tuple[nn.Module, nn.Module]:
    """(embed_tokens, lm_head) of the fast model: the head quantized if untied, shared or int8 if tied."""
    embed = model.model.embed_tokens
    weight = embed.weight  # (V, h)
    if model.lm_head is not None:
        return embed, fast_quantized_linear(model.lm_head, quantize, group_size, "lm_head", kernel)
    if quantize is None:  # tied: the head reads the embedding table itself
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        head.weight = weight  # shared, not copied
        return embed, head
    return fast_int8_table(weight, kernel)  # tied and quantized: int8 rows shared by lookup and head


class FusedMLP(nn.Module):
    """Notebook 04's SwiGLU MLP with gate and up fused into one matrix: one weight read, one kernel call.
    `q` makes each linear as the fast model asks (float, int8 or int4; FastLayer's below)."""

    def __init__(self, mlp, q):
        super().__init__()
        self.intermediate_size = mlp.down_proj.in_features  # I
        self.gate_up_proj = q(fuse_linears(mlp.gate_proj, mlp.up_proj), "mlp.gate_up_proj")  # h -> 2 I
        self.down_proj = q(mlp.down_proj, "mlp.down_proj")  # I -> h

    def forward(self, x: Tensor) -> Tensor:  # (B, T, h) -> (B, T, h)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, -1)  # (B, T, I) each
        return self.down_proj(F.silu(gate) * up)


def takes_one_call(layer, tokens: int, cache) -> bool:
    """Whether a FastLayer runs this step in A4's C++ op: int4 parts, not tracing, and one token with a dense
    cache or an engine step of decode tokens only (notebook 17's packed view offers them as `decode_rows`)."""
    if layer.one_call is None or torch.compiler.is_compiling():
        return False
    return (tokens == 1 and type(cache) is KVCache) or getattr(cache, "decode_rows", None) is not None


def reads_block_tables(model) -> bool:
    """Whether every layer of `model` takes an engine's decode-only step in A4's one call, which reads each
    sequence's keys through its block table: notebook 17's engine then lays out no gathered or paged view."""
    return isinstance(model, FastCausalLM) and all(layer.one_call is not None for layer in model.layers)


def cached_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, cache, pos: int, causal: bool) -> Tensor:
    """q (B, H, T, D) attends to this step's k, v (B, Hkv, T, D) and the cache's: (B, H, T, D)."""
    if hasattr(cache, "attend"):  # paged attention (notebook 16): the cache reads its own blocks
        return cache.attend(q, k, v)
    k, v = (k, v) if cache is None else cache.update(pos, k, v)  # (B, Hkv, pos + T, D)
    # no mask: no padding, so decode sees every key and a fresh prompt is plainly causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


class FastLayer(nn.Module):
    """One decoder layer, rebuilt: fused qkv and gate_up, RoPE on q and k together, SDPA with GQA."""

    def __init__(self, layer, config: ModelConfig, quantize: str | None, group_size: int, name: str,
                 kernel: str = "auto"):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.H, self.Hkv, self.D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.eps = config.rms_norm_eps
        self.input_norm, self.post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight  # (h,)
        self.q_norm, self.k_norm = (None, None) if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)  # Qwen3

        def q(linear: nn.Linear, part: str) -> nn.Module:
            return fast_quantized_linear(linear, quantize, group_size, f"{name}.{part}", kernel)

        self.qkv_proj = q(fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj), "qkv_proj")  # h -> (H + 2 Hkv) D
        self.o_proj = q(attn.o_proj, "o_proj")
        self.mlp = self.fast_mlp(mlp, q, quantize)  # FusedMLP; notebook 23's experts build their own here
        self.one_call = decode_layer_parts(self)  # int4 on A4's kernel: a decode step's arguments, else None

    def fast_mlp(self, mlp, q, quantize: str | None) -> nn.Module:
        return FusedMLP(mlp, q)  # quantize (None: float) is for subclasses: q already applies it

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache, pos: int, causal: bool) -> Tensor:
        B, T, h = x.shape
        if takes_one_call(self, B * T, cache):
            return decode_in_one_call(self.one_call, x, cos, sin, cache, pos)  # appendix A4's C++ layer
        q, k, v = self.attention_inputs(x, cos, sin)  # (B, heads, T, D) each
        out = cached_attention(q, k, v, mask, cache, pos, causal)  # (B, H, T, D), in the layout attention left
        out = out.transpose(1, 2).reshape(B, T, -1).clone(memory_format=torch.contiguous_format)  # (B, T, H*D)
        return self.attention_output(x, out)  # (B, T, h)

    def attention_inputs(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, h = x.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        qkv = self.qkv_proj(F.rms_norm(x, (h,), self.input_norm, self.eps)).view(B, T, H + 2 * Hkv, D)
        qk, v = qkv[:, :, : H + Hkv], qkv[:, :, H + Hkv :]  # (B, T, H + Hkv, D), (B, T, Hkv, D)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            qk = torch.cat((F.rms_norm(qk[:, :, :H], (D,), self.q_norm, self.eps),
                            F.rms_norm(qk[:, :, H:], (D,), self.k_norm, self.eps)), dim=2)
        rotated = torch.cat((-qk[..., D // 2 :], qk[..., : D // 2]), dim=-1)  # rotate_half, q and k at once
        qk = qk * cos[:, :, None] + rotated * sin[:, :, None]  # cos, sin (B or 1, T, 1, D): over the heads
        return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)

    def attention_output(self, x: Tensor, out: Tensor) -> Tensor:  # x (B, T, h), out (B, T, H*D) -> (B, T, h)
        x = x + self.o_proj(out)  # (B, T, h)
        return x + self.mlp(F.rms_norm(x, (x.shape[-1],), self.post_norm, self.eps))


def validate_fast_model(model, quantize) -> None:
    """FastCausalLM's argument checks: a minillm CausalLM and a known quantization mode."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"FastCausalLM: model must be a minillm CausalLM, got {type(model).__name__}")
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"FastCausalLM: quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")


class FastCausalLM(nn.Module):
    """CausalLM's forward contract, rebuilt for speed from a loaded CausalLM (see the module docstring).

    quantize: None (the model's own dtype), "int8" (per channel) or "int4" (group-wise, group_size); kernel:
    "auto", "packed" or "reference" (minillm.speed.quant). Projections are fused copies; norms are shared."""

    layer_class = FastLayer  # notebook 23's mixture of experts swaps in its own

    def __init__(self, model: CausalLM, quantize: str | None = None, group_size: int = 32, kernel: str = "auto"):
        super().__init__()
        validate_fast_model(model, quantize)
        self.config = config = model.config
        self.quantize = quantize
        self.embed_tokens, self.lm_head = embedding_and_head(model, quantize, group_size, kernel)
        self.layers = nn.ModuleList(self.layer_class(layer, config, quantize, group_size, f"model.layers.{i}", kernel)
                                    for i, layer in enumerate(model.model.layers))
        self.norm = model.model.norm.weight  # (h,)
        weight = model.model.embed_tokens.weight  # (V, h): its device and dtype
        cos, sin = rope_tables(config, weight.device, weight.dtype)
        self.register_buffer("cos", cos, persistent=False)  # (P, D): one row per position
        self.register_buffer("sin", sin, persistent=False)

    def compile(self, **kwargs) -> FastCausalLM:
        """Opt in to torch.compile of every layer's pieces around attention (attention itself stays eager):
        seconds of compiling first, then the same few graphs for every layer and every kind of step."""
        for layer in self.layers:  # one code object per piece, each layer's weights its inputs: graphs are shared
            layer.attention_inputs = torch.compile(layer.attention_inputs, dynamic=True, **kwargs)
            layer.attention_output = torch.compile(layer.attention_output, dynamic=True, **kwargs)
        return self

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: list | None = None, start_pos: int = 0, logits_to_keep: int | Tensor = 0) -> Tensor:
        """Logits (B, T, V), as CausalLM.forward; logits_to_keep=n > 0 returns only the last n positions
        (a 1-D tensor: those columns)."""
        B, T, S = validate_forward_inputs(self.config, input_ids, attention_mask, cache, start_pos, logits_to_keep)
        cos, sin = rope_rows(self.cos, self.sin, positions, attention_mask, start_pos, T, S)
        mask = fast_mask(T, S, start_pos, attention_mask, input_ids.device)
        causal = mask is None and T > 1
        x = self.embed_tokens(input_ids)  # (B, T, h)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, None if cache is None else cache[i], start_pos, causal)
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)  # (B, T, h)
        return self.lm_head(keep_columns(x, logits_to_keep))  # (B, T or n, V)


def compile_now(model: FastCausalLM, say=lambda line: print(line, file=sys.stderr, flush=True)) -> FastCausalLM:
    """Compile a .compile()'d model's graphs now, saying each (on stderr: a command's output stays the answer):
    the pieces' for many tokens (an 11-token prompt) and for one (a token without a cache, never A4's one call)."""
    # sizes no model dimension has: a first trace makes equal sizes one symbol, and one of them would fix the other
    cache = make_cache(model.config, 1, 29, dtype=model.cos.dtype, device=model.cos.device)
    ids = torch.zeros(1, 11, dtype=torch.long, device=model.cos.device)
    with torch.no_grad():
        for what, run in (("prompt", lambda: model(ids, cache=cache)), ("one-token", lambda: model(ids[:, :1]))):
            say(f"minillm: compiling the {what} graphs (seconds, minutes on a busy machine; then from torch's cache)...")
            t0 = time.perf_counter()
            run()
            say(f"minillm: {what} graphs ready in {time.perf_counter() - t0:.1f} s")
    return model
