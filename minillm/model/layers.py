# Generated from notebooks/04_norm_mlp.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Normalisation and feed-forward layers of Qwen/Llama decoders: RMSNorm and the SwiGLU MLP.

Built in notebooks/04_norm_mlp.ipynb, which explains each piece (why fp32 accumulation, what
eps does, why a gate); checked there against torch and in tests/model/test_layers.py against
transformers' Qwen2RMSNorm, Qwen2MLP and LlamaMLP. Parameter names are Hugging Face's
(`weight`, `gate_proj`, `up_proj`, `down_proj`), so a checkpoint's state dict loads by name.

References:
- B. Zhang, R. Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019 (arXiv:1910.07467).
- N. Shazeer, "GLU Variants Improve Transformer", 2020 (arXiv:2002.05202).
- S. Elfwing, E. Uchibe, K. Doya, "Sigmoid-Weighted Linear Units ...", 2017 (arXiv:1702.03118).
- transformers: models/qwen2/modeling_qwen2.py (Qwen2RMSNorm, Qwen2MLP), models/llama (LlamaMLP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _validate_norm_weight(x: Tensor, weight: Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rms_norm: weight must have shape ({x.shape[-1]},) to match x's last dim, "
            f"got weight shape {tuple(weight.shape)}"
        )


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, check: bool = True) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, accumulated in float32.

    Rounds like transformers' Qwen2RMSNorm: normalise in fp32, cast to x's dtype, then multiply
    by the weight. The result has x's shape and dtype. check=False skips the weight-shape check
    (the RMSNorm module: its weight was made to size).
    """
    if check:
        _validate_norm_weight(x, weight)
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    mean_sq = x32.pow(2).mean(-1, keepdim=True)  # (..., 1), in fp32 whatever the input dtype
    normed = x32 * torch.rsqrt(mean_sq + eps)
    return (weight * normed.to(input_dtype)).to(input_dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned gain `weight` (initialised to ones)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: Tensor) -> Tensor:  # (..., hidden_size) -> same shape
        # No per-call check: in a model this runs twice per layer per token, on hidden states whose
        # size the config fixed. A wrong x still fails, in torch's broadcast, naming both sizes.
        return rms_norm(x, self.weight, self.eps, check=False)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class MLP(nn.Module):
    """SwiGLU feed-forward block: down_proj(silu(gate_proj(x)) * up_proj(x)), HF names."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # (..., h) -> (..., h); a wrong h fails in gate_proj, naming both sizes
        # (..., h) -> (..., I) twice, gate * up, -> (..., h)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
