"""The benchmark's yardsticks (plumbing, not a lesson): weight bytes and the matrix-vector ceiling.

Decoding one token at batch 1 reads every weight once, so its speed is bounded by how fast this
machine multiplies a (1, K) vector by every weight matrix of the model: `ceilings` times exactly
that, in the model dtype and through quant's Int8Linear / Int4Linear (the "ceiling" rows), and
`own_ceiling` times a variant's own matrices in its own kernels, where they lie: minillm.bench
reports each decode variant as a fraction of that. Notebook 11 explains the roofline.
"""

from __future__ import annotations

import gc
import time

import torch
from torch import nn

from minillm.speed.quant import Int4Linear, Int8Linear
from minillm.speed.profile import weight_shapes  # notebook 11: every linear a token passes through


CEILING_SLACK = 1.05  # a decode loop may pass its ceiling by timing noise, not more


def ceiling_fraction(tok_s: float, ceiling: dict | None, variant: str, skipped: dict) -> float | None:
    """tok_s as a fraction of its ceiling; None where it passed the ceiling by more than noise (the
    reason goes into `skipped`): such a ceiling did not bound the variant, so it measured something else."""
    if not ceiling:
        return None
    fraction = tok_s / ceiling["tok_s"]
    if fraction > CEILING_SLACK:
        skipped[f"ceiling of {variant}"] = (f"invalid ceiling: {variant} decoded at {fraction:.0%} of it, which a "
                                            "ceiling forbids; it measured something else (per-call overhead, weights "
                                            "resident in cache, too few repeats)")
        return None
    return fraction


def weight_mib(module: nn.Module) -> float:
    """Parameters, buffers and tensor attributes of every submodule, each storage counted once."""
    seen, total = set(), 0
    for m in module.modules():
        tensors = [*m.parameters(recurse=False), *m.buffers(recurse=False),
                   *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total / 2**20


def matvec_seconds(layers, x_by_k: dict, repeats: int, compiled: bool = False) -> float:
    """Best of `repeats` passes of one (1, K) matrix-vector product through every layer, after one untimed
    pass; compiled: the pass as one torch.compile graph (outputs returned, so none is dropped as dead code)."""
    def one_pass() -> list:
        return [layer(x_by_k[layer.in_features]) for layer in layers]

    run = torch.compile(one_pass) if compiled else one_pass
    with torch.no_grad():
        run()  # warm-up (and compiling)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
    return best


def own_linears(model: nn.Module) -> list[nn.Module]:
    """The matrices one decode token goes through, as the variant built them (its format, its kernel):
    every module with in_features (nn.Linear, quant's and cpu_kernel's layers), and a tied head's table."""
    layers = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    if getattr(model, "lm_head", False) is None:  # the readable model's tied head: the embedding itself
        table = model.model.embed_tokens.weight  # (V, h)
        head = nn.Linear(table.shape[1], table.shape[0], bias=False, device="meta")
        head.weight = table  # shared, not copied
        layers.append(head)
    return layers


def own_ceiling(model: nn.Module, repeats: int, compiled: bool = False) -> dict:
    """A variant's ceiling, a bound by construction: the best of `repeats` passes of a (1, K) product
    through its own matrices (own_linears), where they lie in memory, in its kernels, and under
    torch.compile when the variant is compiled (no Python between kernels). Decoding does all of
    this and more (attention, norms, sampling), so it cannot be faster but by timing noise."""
    layers = own_linears(model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    x_by_k = {k: torch.randn(1, k, dtype=dtype) for k in {layer.in_features for layer in layers}}
    seconds = matvec_seconds(layers, x_by_k, repeats, compiled)
    return {"seconds": seconds, "tok_s": 1 / seconds}


def ceilings(config, dtype: torch.dtype, group_size: int, repeats: int, skipped: dict) -> dict:
    """{key: {"seconds", "tok_s"}} for the model dtype, int8 and int4; a kind that fails is reported in `skipped`."""
    shapes = weight_shapes(config)
    x_by_k = {k: torch.randn(1, k, dtype=dtype) for _, k in shapes}
    gen = torch.Generator().manual_seed(0)

    def linear(n, k):
        lin = nn.Linear(k, n, bias=False, dtype=dtype)
        with torch.no_grad():
            lin.weight.normal_(0, k**-0.5, generator=gen)
        return lin

    kinds = {str(dtype).removeprefix("torch."): lambda lin, i: lin,
             "int8": lambda lin, i: Int8Linear.from_linear(lin, name=f"ceiling.{i}"),
             "int4": lambda lin, i: Int4Linear.from_linear(lin, group_size=group_size, name=f"ceiling.{i}")}
    out = {}
    for key, make in kinds.items():
        try:
            layers = [make(linear(n, k), i) for i, (n, k) in enumerate(shapes)]  # one at a time: bounded memory
            seconds = matvec_seconds(layers, x_by_k, repeats)
            out[key] = {"seconds": seconds, "tok_s": 1 / seconds}
        except Exception as e:  # reported, not hidden
            skipped[f"ceiling-{key}"] = f"skipped: {type(e).__name__}: {e}"
        layers = None
        gc.collect()
    return out
