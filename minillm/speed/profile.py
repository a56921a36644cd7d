# Generated from notebooks/11_roofline.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Where a decode step's time goes: the matrix-vector ceiling and a profile by category.

Built in notebooks/11_roofline.ipynb. `matvec_ceiling(config)` times only the matrix-vector
products one decoded token needs (every weight matrix once): a floor under any decode step at
batch 1 on this machine, and the bandwidth a decode loop actually gets. `decode_breakdown(model)`
runs decode steps under torch.profiler and sums the operators' own ("self") times by CATEGORIES;
notebook 13 measures its fast path against the readable model with both.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from minillm.cache.dense import make_cache


def weight_shapes(config) -> list[tuple[int, int]]:
    """(N, K) of every linear one token passes through: q, k, v, o, gate, up, down per layer, the head."""
    h, i, D = config.hidden_size, config.intermediate_size, config.head_dim
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    layer = [(H * D, h), (Hkv * D, h), (Hkv * D, h), (h, H * D), (i, h), (i, h), (h, i)]
    return layer * config.num_hidden_layers + [(config.vocab_size, h)]


def matvec_ceiling(config, dtype: torch.dtype = torch.float32, repeats: int = 5) -> tuple[float, int]:
    """(seconds, bytes) per token of just the weights' matrix-vector products, best of `repeats`:
    every weight matrix of `config` once, each layer its own random matrices (nothing stays in cache)."""
    weights = [torch.randn(n, k, dtype=dtype) for n, k in weight_shapes(config)]  # (N, K) each
    inputs = {k: torch.randn(1, k, dtype=dtype) for k in {w.shape[1] for w in weights}}  # (1, K)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
        best = min(best, time.perf_counter() - t0)
    return best, sum(w.numel() * w.element_size() for w in weights)


CATEGORIES = {  # operator names by what they are for; each counted once, by its own ("self") time
    "weights (matmul)": ("aten::mm", "aten::addmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
                         "minillm_cpu::int4_matmul", "minillm_cpu::int8_matvec"),  # the last four: notebooks 12, 13, A4
    "attention": ("aten::bmm", "aten::_softmax", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::masked_fill", "aten::masked_fill_", "aten::any"),
    "norm": ("aten::pow", "aten::mean", "aten::rsqrt", "aten::_fused_rms_norm"),
    "copies": ("aten::copy_", "aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::cat", "aten::clone"),
    "element-wise": ("aten::mul", "aten::add", "aten::add_", "aten::silu", "aten::neg", "aten::sub", "aten::cos", "aten::sin"),
}


def decode_breakdown(model, steps: int = 16, prompt_len: int = 64, dtype: torch.dtype = torch.float32):
    """(wall ms per decode step without the profiler, {category: ms per step}, {category: operators per step})."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # before the first profile: no Kineto progress lines on stderr
    cache = make_cache(model.config, 1, prompt_len + 2 * steps + 8, dtype=dtype)
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, prompt_len)), cache=cache)
        x = torch.tensor([[42]])
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            model(x, cache=cache, start_pos=prompt_len + i)
            times.append(time.perf_counter() - t0)
        wall = sorted(times)[steps // 2] * 1e3  # the median step: robust to a busy machine
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                model(x, cache=cache, start_pos=prompt_len + steps + i)
    ms, ops = {name: 0.0 for name in CATEGORIES}, {name: 0.0 for name in CATEGORIES}
    for event in prof.key_averages():
        for name, kinds in CATEGORIES.items():
            if event.key in kinds:
                ms[name] += event.self_cpu_time_total / 1e3 / steps
                ops[name] += event.count / steps
    ms["Python, dispatch, other ops"] = max(wall - sum(ms.values()), 0.0)
    return wall, ms, ops
