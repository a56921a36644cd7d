# Generated from notebooks/22_linear_attention.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The gated delta rule: linear attention with a fixed-size state, in its recurrent and chunked forms.

Built in notebooks/22_linear_attention.ipynb. A Gated DeltaNet layer keeps, per value head, a
state S of shape (Dk, Dv): a memory that maps keys to values. Each token decays it (exp(g) < 1),
corrects what it says about the token's key towards the token's value (the delta rule, step
size beta), and reads it with the query:

    S_t = exp(g_t) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T
    o_t = S_t^T q_t

`recurrent_gated_delta_rule` runs that loop, one token at a time (decode); the chunked form
gives the same outputs with matrix products over chunks of 64 tokens (prefill). The short
causal convolution before it and the gated RMSNorm after it are here too.

Shape legend: B batch, T tokens, H value heads, Dk key dim, Dv value dim, C conv channels, K kernel.

References:
- Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (arXiv:2412.06464);
  Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence Length"
  (arXiv:2406.06484), for the chunked (WY / UT) form.
- transformers' models/qwen3_5 (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule):
  the reference the tests compare with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_SIZE = 64  # the chunk of Qwen3.5's prefill (flash-linear-attention's and transformers')


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: unit-length queries and keys keep the state bounded."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The rule token by token. q, k (B, T, H, Dk) unit length; v (B, T, H, Dv); g (log decay, <= 0)
    and beta (B, T, H); state (B, H, Dk, Dv) or None (zeros). Returns out (B, T, H, Dv) and the state,
    all in float32. q is scaled by 1/sqrt(Dk) here, as attention scales its scores."""
    B, T, H, Dk = k.shape
    q, k, v, g, beta = (x.float().transpose(1, 2) for x in (q, k, v, g, beta))  # heads first: (B, H, T, ...)
    q = q * Dk**-0.5
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if state is None else state.float()
    out = torch.empty_like(v)  # (B, H, T, Dv)
    for t in range(T):
        S = S * g[:, :, t, None, None].exp()  # forget a little of everything
        predicted = (k[:, :, t, :, None] * S).sum(-2)  # S^T k: (B, H, Dv), what the memory says of k
        correction = beta[:, :, t, None] * (v[:, :, t] - predicted)  # (B, H, Dv)
        S = S + k[:, :, t, :, None] * correction[:, :, None, :]  # rank-1 write: k (B,H,Dk,1) x corr (B,H,1,Dv)
        out[:, :, t] = (q[:, :, t, :, None] * S).sum(-2)  # S^T q: (B, H, Dv)
    return out.transpose(1, 2), S


def chunked_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                             state: Tensor | None = None, chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """The same outputs and final state as recurrent_gated_delta_rule, a chunk at a time.

    Inside a chunk, with G_t the cumulative log decay from the chunk's start and S0 the state
    before it, the corrections u_t solve a unit lower-triangular system (I + A) U = beta V - ...,
    A[t, s] = beta_t exp(G_t - G_s) k_t.k_s for s < t; then outputs and the next state are
    matrix products. Only the state is carried from chunk to chunk."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    n = -(-T // chunk_size)  # chunks
    pad = n * chunk_size - T  # zeros after the end: k = v = beta = 0 and g = 0 change nothing
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float(), (0, 0, 0, pad)) for x in (g, beta))
    q = q * Dk**-0.5

    def chunks(x: Tensor) -> Tensor:  # (B, n*c, H, ...) -> (B, H, n, c, ...)
        return x.view(B, n, chunk_size, H, *x.shape[3:]).movedim(3, 1)

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(-1)  # (B, H, n, c): log of the decay from the chunk's start to each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()  # s <= t
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (.., c, c): exp(G_t - G_s)
    k_beta = k * beta[..., None]  # (B, H, n, c, Dk)
    A = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)  # strictly lower: earlier tokens' writes seen by t
    eye = torch.eye(chunk_size, device=q.device)
    # (I + A) X = RHS, solved by forward substitution (unit lower triangular)
    W = torch.linalg.solve_triangular(eye + A, v * beta[..., None], upper=False, unitriangular=True)  # (.., c, Dv)
    K_read = torch.linalg.solve_triangular(eye + A, k_beta * G[..., None].exp(), upper=False, unitriangular=True)
    scores = q @ k.transpose(-1, -2) * decay  # (.., c, c): like causal attention, decayed
    q_read = q * G[..., None].exp()  # queries read S0 decayed to their position
    k_write = k * (G[..., -1:] - G).exp()[..., None]  # keys' writes decayed to the chunk's end
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state.float()
    out = torch.empty_like(v)  # (B, H, n, c, Dv)
    for i in range(n):
        U = W[:, :, i] - K_read[:, :, i] @ S  # (B, H, c, Dv): the corrections, given S0
        out[:, :, i] = q_read[:, :, i] @ S + scores[:, :, i] @ U
        S = S * G[:, :, i, -1, None, None].exp() + k_write[:, :, i].transpose(-1, -2) @ U
    out = out.reshape(B, H, n * chunk_size, Dv)[:, :, :T]  # drop the padding
    return out.transpose(1, 2), S


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A depthwise causal convolution with silu: each channel mixes its last K inputs.

    x (B, C, T); weight (C, K); conv_state (B, C, K-1), the inputs before x (None: zeros, a prompt's
    start). Returns silu(conv) (B, C, T) and the new conv state (the last K-1 inputs)."""
    K = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[0], x.shape[1], K - 1)
    window = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # (B, C, K-1+T)
    out = F.conv1d(window, weight[:, None, :].to(x.dtype), groups=x.shape[1])  # (B, C, T): no padding needed
    return F.silu(out), window[:, :, -(K - 1):]


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm(x) * weight * silu(gate) over the last dim, normalised in float32 (transformers' rounding)."""
    dtype = x.dtype
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)
