"""Exercise checks of notebook 20 (plumbing): the multi-adapter linear, and its exploration.

`MultiLoRALinear.forward` is checked against the plainest reference there is: each row on its own,
through its adapter's merged weight W + B_i A_i (index 0: the base model). A known mistake is named
by the output it produces, computed here; the gathered stacks are changed between two calls, so
that an answer worked out once and kept is caught. The exploration counts an adapter's bytes on
the meta-device model of SmolLM2's config, every adapted linear's r (in + out), independent of the
notebook's formula.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

import torch

from minillm.check.explore import meta_model
from minillm.check.harness import close_to, compare, fail, run_check, run_explore
from minillm.weights.lora import TARGET_MODULES

NUM_ADAPTERS, RANK, IN, OUT = 3, 2, 6, 5


def _stacks(seed: int = 0):
    """A base linear and stacks (N + 1, r, in), (N + 1, out, r) whose row 0 (no adapter) is zeros."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.Linear(IN, OUT, bias=True)
    with torch.no_grad():
        base.weight.copy_(torch.randn(OUT, IN, generator=g))
        base.bias.copy_(torch.randn(OUT, generator=g))
    A, B = torch.randn(NUM_ADAPTERS + 1, RANK, IN, generator=g), torch.randn(NUM_ADAPTERS + 1, OUT, RANK, generator=g)
    A[0], B[0] = 0.0, 0.0
    return base, A, B


def _per_row(base, A, B, x, ids) -> torch.Tensor:
    """Each row alone, through its adapter's merged weight: (B, T, in) -> (B, T, out)."""
    return torch.stack([x[b] @ (base.weight + B[i] @ A[i]).T + base.bias for b, i in enumerate(ids)])


def multi_lora_linear_forward(cls) -> bool:
    """MultiLoRALinear(base_layer, A, B, rows).forward(x): base_layer(x) plus each row's own B A x."""
    def body():
        base, A, B = _stacks()
        rows = SimpleNamespace(ids=None)
        layer = cls(base, A.clone(), B.clone(), rows)
        x = torch.randn(4, 3, IN, generator=torch.Generator().manual_seed(1))  # (B, T, in)
        try:
            got = layer(x)
        except NotImplementedError:  # the stub, which run_check reports as such
            raise
        except (TypeError, IndexError, RuntimeError) as exc:  # e.g. indexing the stacks with None
            fail(f"with rows.ids None (a batch on the base model) your code raised {type(exc).__name__}: {exc}",
                 "rows.ids is None when no row has an adapter: return the base layer's output alone")
        compare("rows.ids None: the output", got, base(x), atol=1e-5,
                hint="with no adapter in the batch the layer is the base layer: base_layer(x)")
        for ids in ([2, 0, 1, 3], [1, 1, 0, 2]):  # the second call after the first: nothing kept between them
            rows.ids = torch.tensor(ids)
            want = _per_row(base, A, B, x, ids)
            delta = want - base(x)
            same = _per_row(base, A, B, x, [ids[0]] * len(ids))
            compare(f"rows.ids {ids}: the output", layer(x), want, atol=1e-4, mistakes=[
                ("add the base layer's output: the adapter is an update to it, base_layer(x) + B A x", delta),
                ("that is the base layer alone: add each row's B_i (A_i x), gathered with self.lora_A[self.rows.ids]",
                 base(x)),
                ("each row has its own adapter: index the stacks with all of rows.ids (one per row), not one",
                 same)], hint="row b adds x[b] @ A[i].T @ B[i].T with i = rows.ids[b]; A (N + 1, r, in), "
                              "B (N + 1, out, r): gather, then two batched matmuls through the rank r")
    return run_check("MultiLoRALinear.forward", body)


# ------------------------------------------------------------------ the exploration: an adapter's bytes


@cache
def adapter_megabytes(r: int = 32, bytes_per_value: int = 4, config: str = "SmolLM2-135M-Instruct",
                      gqa: bool = True) -> float:
    """Megabytes (10^6 bytes) of a rank-r adapter on all seven projections of every layer of `config`:
    r (in + out) values per adapted linear. gqa=False plants a slip: k and v as wide as q."""
    model = meta_model(config)
    values = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGET_MODULES:
            out = module.in_features if not gqa and name.endswith(("k_proj", "v_proj")) else module.out_features
            values += r * (module.in_features + out)
    return values * bytes_per_value / 1e6


def explore_adapter_megabytes(value) -> bool:
    """MB (10^6 bytes) of a rank-32 float32 adapter on all seven projections of SmolLM2; within 0.1 MB."""
    def body():
        want = adapter_megabytes()
        close_to("adapter_megabytes", value, want, abs_=0.1, mistakes=[
            ("float32 is 4 bytes a value, not 2", adapter_megabytes(bytes_per_value=2)),
            ("k_proj and v_proj are narrower than q_proj: SmolLM2 has 3 KV heads for 9 query heads (GQA)",
             adapter_megabytes(gqa=False)),
            ("megabytes are 10^6 bytes here, not 2^20 (MiB)", want * 1e6 / 2**20),
            ("rank 32, not 8", adapter_megabytes(r=8)),
            ("bits, not bytes: a float32 value is 4 bytes", want * 8)],
            hint="each adapted (out, in) linear adds A (r, in) and B (out, r): r (in + out) values; sum over the "
                 "seven projections of each of the 30 layers, with the sizes in smol.config")
    return run_explore("adapter_megabytes", body)


EXPLORE = {"adapter_megabytes": explore_adapter_megabytes}
