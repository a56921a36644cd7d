"""Exercise checks of notebook 22: the gated delta rule token by token, and where a hybrid's KV cache
outweighs its fixed states (an exploration).

The reference is the package's chunked form (minillm/model/gated_delta.py), a different algorithm
from the loop the student writes; the likely mistakes are computed by a loop of this module's own
with one step changed each. See minillm/check/__init__.py for how checks are called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.bench.qwen3_5 import QWEN3_5_0_8B
from minillm.check.harness import close_to, compare, fail, run_check, run_explore
from minillm.model.gated_delta import chunked_gated_delta_rule
from minillm.model.qwen3_5 import HybridConfig


def _inputs(B: int, T: int, H: int, Dk: int, Dv: int, seed: int):
    """Unit-length q, k; v; g <= 0 and beta in (0, 1), as the layer makes them; a starting state."""
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, T, H, Dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g)
    decay, beta = -torch.rand(B, T, H, generator=g), torch.rand(B, T, H, generator=g)
    return q, k, v, decay, beta, torch.randn(B, H, Dk, Dv, generator=g)


def _slip(q, k, v, g, beta, state, *, decay=True, after=False, step=True, delta=True, scale=True):
    """The recurrence with one step changed: decay off or after the write, no beta, the running sum
    (v written, not the error), or q unscaled. Returns out (B, T, H, Dv) and the last state."""
    Dk = k.shape[-1]
    q, k, v, g, beta = (x.float().transpose(1, 2) for x in (q, k, v, g, beta))
    q = q * Dk**-0.5 if scale else q
    S, out = state.float().clone(), torch.empty_like(v)
    for t in range(k.shape[2]):
        forget = g[:, :, t, None, None].exp() if decay else 1.0
        S = S if after else S * forget
        written = v[:, :, t] - (k[:, :, t, :, None] * S).sum(-2) if delta else v[:, :, t]
        S = S + k[:, :, t, :, None] * ((beta[:, :, t, None] if step else 1.0) * written)[:, :, None, :]
        S = S * forget if after else S
        out[:, :, t] = (q[:, :, t, :, None] * S).sum(-2)
    return out.transpose(1, 2), S


MISTAKES = [
    ("decay the state first: S = S * exp(g_t), one number per sequence and head, before it is read or written",
     dict(decay=False)),
    ("decay BEFORE the write: the token's own correction must not fade in its own step", dict(after=True)),
    ("scale the error by beta_t, the write's step size", dict(step=False)),
    ("write the error v_t - S^T k_t (the delta rule), not v_t itself (that is the running sum)", dict(delta=False)),
    ("q is scaled by 1/sqrt(Dk) at the top: read with that q", dict(scale=False)),
]


def recurrent_gated_delta_rule(fn) -> bool:
    """recurrent_gated_delta_rule(q, k, v, g, beta, state) -> (out (B, T, H, Dv), state (B, H, Dk, Dv))."""
    def body():
        for (B, T, H, Dk, Dv), start in [((2, 5, 3, 8, 4), True), ((1, 70, 2, 16, 8), True), ((1, 3, 2, 4, 4), False)]:
            q, k, v, g, beta, state = _inputs(B, T, H, Dk, Dv, seed=T)
            state = state if start else None
            got = fn(q, k, v, g, beta, state)
            if not isinstance(got, tuple) or len(got) != 2:
                fail(f"expected (out, state), got {type(got).__name__}")
            want = chunked_gated_delta_rule(q, k, v, g, beta, state)
            zeros = torch.zeros(B, H, Dk, Dv) if state is None else state
            slips = [(hint, _slip(q, k, v, g, beta, zeros, **change)) for hint, change in MISTAKES]
            what = f"(B, T, H, Dk, Dv) = {(B, T, H, Dk, Dv)}, {'a starting state' if start else 'state None'}"
            compare(f"out {what}", got[0], want[0], atol=1e-4, rtol=1e-4,
                    mistakes=[(hint, slip[0]) for hint, slip in slips],
                    hint="step t: decay, predict S^T k_t, write k_t x beta_t (v_t - prediction), read S^T q_t")
            compare(f"state {what}", got[1], want[1], atol=1e-4, rtol=1e-4,
                    mistakes=[(hint, slip[1]) for hint, slip in slips],
                    hint="return the state after the last token, (B, H, Dk, Dv)")
    return run_check("recurrent_gated_delta_rule", body)


def state_crossover_tokens(recurrent_bytes: int = 4, conv: bool = True, attention_layers: int | None = None,
                           tensors: int = 2) -> int:
    """The first context length at which Qwen3.5-0.8B's KV cache (6 attention layers) holds at least as
    many bytes as its 18 DeltaNet states, in bfloat16 (the recurrent state is float32 regardless).
    The arguments make the likely slips: a bf16 recurrent state, the conv state forgotten, KV in every
    layer, keys without values."""
    c = HybridConfig.from_dict(dict(QWEN3_5_0_8B, model_type="qwen3_5_text"))
    linear = c.layer_types.count("linear_attention")
    conv_bytes = c.conv_channels * (c.linear_conv_kernel_dim - 1) * 2 if conv else 0
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * recurrent_bytes
    layers = c.layer_types.count("full_attention") if attention_layers is None else attention_layers
    kv_per_token = tensors * layers * c.num_key_value_heads * c.head_dim * 2
    return -(-linear * (conv_bytes + recurrent) // kv_per_token)


def explore_state_crossover_tokens(value) -> bool:
    """From how many tokens Qwen3.5-0.8B's KV cache outweighs its DeltaNet states (bfloat16); within 1 token."""
    def body():
        close_to("state_crossover_tokens", value, state_crossover_tokens(), abs_=1, mistakes=[
            ("the recurrent state is float32 (4 bytes a number) even in a bfloat16 model",
             state_crossover_tokens(recurrent_bytes=2)),
            ("the conv state counts too: C x (K - 1) numbers per DeltaNet layer", state_crossover_tokens(conv=False)),
            ("only 6 of the 24 layers keep keys and values: the other 18 keep the states",
             state_crossover_tokens(attention_layers=24)),
            ("keys AND values: two tensors per attention layer and token", state_crossover_tokens(tensors=1))])
    return run_explore("state_crossover_tokens", body)


EXPLORE = {"state_crossover_tokens": explore_state_crossover_tokens}
"""Exploration name (the answer's variable) -> its check."""
