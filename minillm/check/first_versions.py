"""Exercise checks of the notebooks' first, simple versions (plumbing): the formula before the module.

Three lessons write a short version first and grow the package's function from it: notebook 02's
`naive_attention` (the formula in three lines), notebook 10's `greedy_decode` (prefill, then one
token per pass with the cache) and notebook 12's `fake_quant` (quantize and dequantize, one scale
per group). They are not exported, so each check holds its own few lines of reference, with
switches that plant the known mistakes, and compares the student's function with it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minillm.check.harness import bounded, compare, fail, run_check
from minillm.check.loading import tiny_lm
from minillm.cache.dense import make_cache

# ------------------------------------------------------------------ 02 attention: the formula


def _naive_ref(q, k, v, scale: str = "sqrt", dim: int = -1):
    D = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / {"sqrt": math.sqrt(D), "none": 1.0, "D": D}[scale]  # (T, S)
    return scores.softmax(dim=dim) @ v  # (T, D)


def naive_attention(fn) -> bool:
    """naive_attention(q (T, D), k (S, D), v (S, D)) -> (T, D): softmax(q k^T / sqrt(D)) v, no mask."""
    def body():
        g = torch.Generator().manual_seed(0)
        for T, S, D in [(3, 5, 8), (1, 4, 16)]:  # a prompt's queries, then a single decoding query
            q, k, v = (torch.randn(n, D, generator=g) for n in (T, S, S))
            compare(f"naive_attention(q {T}x{D}, k {S}x{D}, v {S}x{D})", fn(q, k, v),
                    F.scaled_dot_product_attention(q, k, v), atol=1e-5, mistakes=[
                        ("divide the scores by sqrt(D), the square root of the head dimension",
                         _naive_ref(q, k, v, scale="none")),
                        ("divide by sqrt(D), not by D", _naive_ref(q, k, v, scale="D")),
                        ("softmax over the keys (dim=-1): each query's weights sum to 1",
                         _naive_ref(q, k, v, dim=0))],
                    hint="scores = q @ k^T (T, S), scaled, softmax along the keys, then times v")
    return run_check("naive_attention", body)


# ------------------------------------------------------------------ 10 generate: the greedy loop


@torch.no_grad()
def _greedy_ref(model, prompt_ids, n, *, cache: bool = True, first_advance: str = "width", passes: int = 0):
    """The loop of notebook 10 with switches for the known slips; returns the n + passes new ids."""
    kv = make_cache(model.config, 1, len(prompt_ids) + n + 1)
    seen, ids, start_pos, tokens = list(prompt_ids), torch.tensor([prompt_ids]), 0, []
    for _step in range(n + passes):
        if cache:
            logits = model(ids, cache=kv, start_pos=start_pos, logits_to_keep=1)[:, -1]
        else:
            logits = model(torch.tensor([seen]))[:, -1]
        start_pos += {"width": ids.shape[1], "one": 1, "none": 0}[first_advance]
        tokens.append(int(logits.argmax(-1)))
        seen.append(tokens[-1])
        ids = torch.tensor([[tokens[-1]]])
    return tokens


def _greedy_run(fn, model, prompt, n) -> tuple[list[int], list[int]]:
    """(new ids, width of every input the model saw) of fn's run."""
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(
        (args[0] if args else kwargs["input_ids"]).shape[-1]), with_kwargs=True)
    try:
        result = bounded(fn, "greedy_decode")(model, prompt, n)
    finally:
        hook.remove()
    if not (isinstance(result, tuple) and len(result) == 2):
        fail(f"greedy_decode returned {type(result).__name__}, expected a pair (new ids, seconds of each pass)")
    tokens, seconds = result
    if len(seconds) != len(widths):
        fail(f"{len(seconds)} times for {len(widths)} forward passes", "time each pass: one entry per model call")
    return [int(t) for t in tokens], widths


_GREEDY_MISTAKES = [
    ("after the prefill, feed only the newest token: the cache holds the keys and values of every earlier one",
     dict(cache=False)),
    ("start_pos is the number of tokens already in the cache: after each pass add the width of its input "
     "(the whole prompt after the prefill, then 1)", dict(first_advance="one")),
    ("advance start_pos after each pass, or every token is written at position 0", dict(first_advance="none")),
    ("n new tokens: the prefill's last logits give the first, n - 1 decode passes the rest",
     dict(passes=-1)),
]


def greedy_decode(fn) -> bool:
    """greedy_decode(model, prompt_ids, n) -> (n new ids, n seconds): prefill once, then one token a pass."""
    def body():
        model, _ = tiny_lm()
        prompt, n = [7, 4, 11, 11, 14], 8
        got, widths = _greedy_run(fn, model, prompt, n)
        want, want_widths = _greedy_ref(model, prompt, n, cache=False), [len(prompt)] + [1] * (n - 1)
        if (got, widths) == (want, want_widths):
            return
        message = (f"new ids {got} from inputs of widths {widths}; expected {want} from widths {want_widths} "
                   "(the prompt once, then one token per pass)")
        for hint, switches in _GREEDY_MISTAKES:
            variant = _greedy_ref(model, prompt, n, **switches)
            if got == variant and (switches.get("cache", True) or widths != want_widths):
                fail(message, hint)
        fail(message, "the ids must be the argmax of the full recompute at every step")
    return run_check("greedy_decode", body)


# ------------------------------------------------------------------ 13 quantization: quantize, then dequantize


def _fake_quant_ref(w, bits, group, symmetric, *, levels_off: int = 1, per_row: bool = False, plus_lo: bool = True):
    N, K = w.shape
    wg = w.reshape(N, 1, K) if per_row else w.reshape(N, K // group, group)  # (N, K/g, g)
    if symmetric:
        s = wg.abs().amax(-1, keepdim=True).clamp(min=1e-12) / (2 ** (bits - 1) - levels_off)
        return (torch.round(wg / s) * s).reshape(N, K)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = ((hi - lo) / (2**bits - levels_off)).clamp(min=1e-12)
    return (torch.round((wg - lo) / s) * s + (lo if plus_lo else 0)).reshape(N, K)


def fake_quant(fn) -> bool:
    """fake_quant(w (N, K), bits, group, symmetric) -> (N, K): each group of a row quantized, then dequantized."""
    def body():
        g = torch.Generator().manual_seed(0)
        w = torch.randn(4, 64, generator=g)
        w[:, 5] *= 8  # an outlier input column: groups keep its damage local
        for bits, group, symmetric in [(4, 16, False), (4, 32, True), (8, 64, False), (3, 8, True)]:
            compare(f"fake_quant(w, bits={bits}, group={group}, symmetric={symmetric})",
                    fn(w.clone(), bits, group, symmetric), _fake_quant_ref(w, bits, group, symmetric),
                    atol=1e-5, mistakes=[
                        (f"{2 ** bits} levels from lo to hi are {2 ** bits - 1} steps: divide by 2**bits - 1"
                         if not symmetric else f"the symmetric grid is -{2 ** (bits - 1) - 1}..{2 ** (bits - 1) - 1}: "
                         "divide max|w| by 2**(bits - 1) - 1", _fake_quant_ref(w, bits, group, symmetric, levels_off=0)),
                        ("one scale per `group` consecutive inputs of a row: reshape (N, K) to (N, K // group, group) "
                         "and reduce over the last axis", _fake_quant_ref(w, bits, group, symmetric, per_row=True)),
                        ("dequantize with the zero point: q * s + lo", _fake_quant_ref(w, bits, group, symmetric,
                                                                                     plus_lo=False))])
    return run_check("fake_quant", body)
