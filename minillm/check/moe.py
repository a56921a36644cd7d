"""Exercise checks of notebook 23: the router, the readable loop over experts, and how many of
Qwen3.5-35B-A3B's experts a decode batch of 16 touches (an exploration).

The references are other algorithms than the student's: for `route`, a sort of each token's
probabilities written here; for `experts_loop`, the package's grouped form (minillm/model/moe.py).
The likely mistakes are computed by this module's own code with one step changed each. See
minillm/check/__init__.py for how checks are called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.check.harness import close_to, compare, fail, run_check, run_explore
from minillm.model.moe import expert_mlp, experts_grouped

QWEN3_5_35B_A3B = dict(num_experts=256, num_experts_per_tok=8)  # transformers' Qwen3_5MoeTextConfig defaults (that model)


def _router_inputs(N: int, h: int, E: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, h, generator=g).to(dtype), (torch.randn(E, h, generator=g) * 2 / h**0.5).to(dtype)


def _route_by_sorting(x, weight, k, norm, *, softmax_first=True, renorm=True, fp32=True):
    """The router by a full sort of each token's scores; the keywords make the likely slips."""
    logits = F.linear(x, weight)
    logits = logits.float() if fp32 else logits
    if softmax_first:
        probs = torch.softmax(logits, -1)
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
        top = probs.gather(-1, order)
        if norm and renorm:
            top = top / top.sum(-1, keepdim=True)
    else:  # the k largest logits, then a softmax over those k alone
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
        top = torch.softmax(logits.gather(-1, order), -1)
    return top.to(x.dtype), order


ROUTE_MISTAKES = [
    ("renormalise the k kept weights to sum to 1 when norm_topk_prob is set", dict(renorm=False)),
    ("softmax over ALL experts first, then the top k: the k largest logits' own softmax is the renormalised "
     "weights, which is wrong when norm_topk_prob is False", dict(softmax_first=False)),
]


def route(fn) -> bool:
    """route(x (N, h), weight (E, h), top_k, norm_topk_prob) -> (weights (N, k) in x's dtype, experts (N, k))."""
    def body():
        for (N, h, E, k), norm, dtype in [((6, 16, 8, 3), True, torch.float32), ((6, 16, 8, 3), False, torch.float32),
                                          ((40, 32, 16, 4), False, torch.float32), ((5, 16, 8, 2), True, torch.bfloat16)]:
            x, weight = _router_inputs(N, h, E, seed=N + E + norm, dtype=dtype)
            got = fn(x, weight, k, norm)
            if not isinstance(got, tuple) or len(got) != 2:
                fail(f"expected (weights, experts), got {type(got).__name__}")
            weights, experts = got
            want_w, want_e = _route_by_sorting(x, weight, k, norm)
            what = f"N={N}, E={E}, k={k}, norm_topk_prob={norm}, {str(dtype).removeprefix('torch.')}"
            if not isinstance(experts, torch.Tensor) or tuple(experts.shape) != (N, k):
                fail(f"experts {what}: expected shape {(N, k)}", "topk(k) along the experts' dim gives (N, k)")
            if not torch.equal(experts.sort(-1).values, want_e.sort(-1).values):
                fail(f"experts {what}: not the k most probable of each token", "probs.topk(top_k, dim=-1)")
            if isinstance(weights, torch.Tensor) and weights.dtype != x.dtype:
                fail(f"weights {what}: dtype {weights.dtype}, expected x's {x.dtype}",
                     "the softmax runs in float32; cast the k weights back to x.dtype at the end")
            mistakes = [(hint, _route_by_sorting(x, weight, k, norm, **change)[0].gather(
                -1, _order_of(want_e, experts))) for hint, change in ROUTE_MISTAKES]
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            compare(f"weights {what}", weights, want_w.gather(-1, _order_of(want_e, experts)), atol=tol,
                    mistakes=mistakes, hint="softmax(F.linear(x, weight).float()), topk, then divide by the sum if norm_topk_prob")
    return run_check("route", body)


def _order_of(want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Indices into `want`'s columns that put them in `got`'s order (the same experts per row)."""
    return (got[:, :, None] == want[:, None, :]).long().argmax(-1)


def _loop_slip(x, gate_up_proj, down_proj, weights, experts, *, weighted=True, one_slot=False, add=True):
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        token, slot = torch.where(experts == e)
        y = expert_mlp(x[token], gate_up_proj[e], down_proj[e])
        w = weights[token, 0, None] if one_slot else weights[token, slot, None]
        y = y * w if weighted else y
        if add:
            out.index_add_(0, token, y)
        else:
            out[token] = y
    return out


LOOP_MISTAKES = [
    ("weight each expert's output by the router's weight for that token", dict(weighted=False)),
    ("each token has k weights: take the one of the slot in which it chose this expert", dict(one_slot=True)),
    ("a token's k experts ADD into its row (index_add_); assigning keeps only the last expert", dict(add=False)),
]


def experts_loop(fn) -> bool:
    """experts_loop(x (N, h), gate_up_proj (E, 2I, h), down_proj (E, h, I), weights, experts (N, k)) -> (N, h)."""
    def body():
        for N, h, E, k, I in [(5, 16, 6, 2, 8), (33, 24, 8, 3, 12), (1, 16, 8, 4, 8)]:
            g = torch.Generator().manual_seed(N)
            x, gate_up, down = (torch.randn(*s, generator=g) for s in ((N, h), (E, 2 * I, h), (E, h, I)))
            probs = torch.softmax(torch.randn(N, E, generator=g), -1)
            weights, experts = probs.topk(k, -1)
            got = fn(x, gate_up, down, weights, experts)
            want = experts_grouped(x, gate_up, down, weights, experts)
            mistakes = [(hint, _loop_slip(x, gate_up, down, weights, experts, **change)) for hint, change in LOOP_MISTAKES]
            compare(f"out, N={N} tokens, E={E} experts, k={k}", got, want, atol=1e-4, mistakes=mistakes,
                    hint="for each expert: its tokens (where), their rows through expert_mlp, times their weights, added back")
    return run_check("experts_loop", body)


def experts_touched(batch: int = 16, E: int = QWEN3_5_35B_A3B["num_experts"],
                    k: int = QWEN3_5_35B_A3B["num_experts_per_tok"], per_token: float | None = None) -> float:
    """The expected number of distinct experts a batch of decode tokens touches under even, independent
    routing: E (1 - (1 - k/E)^B). per_token: the slip of a miss probability of (1 - 1/E) per token."""
    miss = (1 - k / E) ** batch if per_token is None else (1 - per_token) ** batch
    return E * (1 - miss)


def explore_experts_touched_16(value) -> bool:
    """How many of Qwen3.5-35B-A3B's 256 experts a decode batch of 16 touches on average (within 0.5)."""
    def body():
        E, k = QWEN3_5_35B_A3B["num_experts"], QWEN3_5_35B_A3B["num_experts_per_tok"]
        close_to("experts_touched_16", value, experts_touched(), abs_=0.5, mistakes=[
            ("16 tokens x 8 choices overlap: an expert is missed only if all 16 tokens miss it, (1 - k/E)^16",
             min(16 * k, E)),
            ("each token picks 8 experts, not 1: it misses a given expert with probability 1 - k/E",
             experts_touched(per_token=1 / E)),
            ("the expected count is E x (1 - the chance all 16 miss), not that chance itself", (1 - k / E) ** 16)])
    return run_explore("experts_touched_16", body)


EXPLORE = {"experts_touched_16": explore_experts_touched_16}
"""Exploration name (the answer's variable) -> its check."""
