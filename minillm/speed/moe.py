# Generated from notebooks/23_moe.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Quantized experts and the fast path for a mixture of experts.

Built in notebooks/23_moe.ipynb on notebook 12 (quantized layers, quantize_model), notebook 13 (the
fast path) and appendix A4 (the integer-dot kernel). Each expert's two projections become quantized
layers of their own (QuantizedExperts); the router and the shared expert's gate stay float.
quantize_moe_model is quantize_model for a MoE, FastMoeCausalLM is FastCausalLM for Qwen3-MoE.

Shape legend: N tokens, h hidden, E experts, k experts per token, I an expert's width.

References: llama.cpp's ggml_mul_mat_id (an expert's matrix chosen per group of rows); gpt-fast's
mixtral-moe (int8 experts on torch's kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillm.model.moe import MoeCausalLM, SparseMoeBlock, sort_by_expert
from minillm.speed.cpu_kernel import BLOCK
from minillm.speed.fast import FastCausalLM, FastLayer, FusedMLP
from minillm.speed.quant import quantize_linear, quantize_model, validate_group_size


def expert_linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear on one expert's (out, in) weight: a view of the stacked parameter, no copy."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


class QuantizedExperts(nn.Module):
    """E experts as layers of their own, each made by q(linear, part): gate_up[e] (h -> 2I), down[e] (I -> h).
    Called as Experts: x (N, h), weights and experts (N, k) -> (N, h)."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, q):
        super().__init__()
        E = gate_up_proj.shape[0]  # gate_up_proj (E, 2I, h), down_proj (E, h, I)
        self.gate_up = nn.ModuleList(q(expert_linear(gate_up_proj[e]), f"experts.{e}.gate_up_proj") for e in range(E))
        self.down = nn.ModuleList(q(expert_linear(down_proj[e]), f"experts.{e}.down_proj") for e in range(E))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        order, token, ends = sort_by_expert(experts, len(self.gate_up))  # as experts_grouped
        xs, y, start = x[token], torch.empty_like(x[token]), 0  # (N k, h): the pairs' rows, by expert
        for e, end in enumerate(ends.tolist()):
            if end > start:  # an expert some token chose: only these experts' bytes are read
                gate, up = self.gate_up[e](xs[start:end]).chunk(2, dim=-1)  # (n_e, I) each
                y[start:end] = self.down[e](F.silu(gate) * up)  # (n_e, h)
            start = end
        return torch.zeros_like(x).index_add_(0, token, y * weights.flatten()[order, None])


class QuantizedMoeBlock(SparseMoeBlock):
    """SparseMoeBlock's forward, its experts (and shared expert) made by q(linear, part); the router and the
    shared expert's gate are the float block's own."""

    def __init__(self, block: SparseMoeBlock, q):
        nn.Module.__init__(self)  # every part comes from `block`
        self.gate, self.shared_expert_gate = block.gate, block.shared_expert_gate
        self.experts = QuantizedExperts(block.experts.gate_up_proj, block.experts.down_proj, q)
        shared = block.shared_expert
        self.shared_expert = None if shared is None else \
            FusedMLP(shared, lambda linear, part: q(linear, "shared_expert." + part.removeprefix("mlp.")))


@torch.no_grad()
def quantize_moe_model(model: MoeCausalLM, mode: str, group_size: int = 32, kernel: str = "auto") -> MoeCausalLM:
    """quantize_model (notebook 12) for Qwen3-MoE, in place: every SparseMoeBlock a QuantizedMoeBlock of
    Int8Linear or Int4Linear experts; attention, the head and the embedding as for a dense model."""
    validate_moe_quantizable(model, mode, group_size)  # every expert's K, before any layer is replaced (Plumbing)

    def quantize_block(block, mode, group_size, name, kernel):
        return QuantizedMoeBlock(block, lambda linear, part: quantize_linear(linear, mode, group_size, f"{name}.{part}", kernel))
    return quantize_model(model, mode, group_size, kernel, quantize_mlp=quantize_block)


class FastMoeLayer(FastLayer):
    """Notebook 13's FastLayer; a sparse layer keeps its SparseMoeBlock in float, or quantizes it."""

    def fast_mlp(self, mlp, q, quantize: str | None) -> nn.Module:
        if not isinstance(mlp, SparseMoeBlock):  # a dense layer (mlp_only_layers)
            return super().fast_mlp(mlp, q, quantize)
        return mlp if quantize is None else QuantizedMoeBlock(mlp, lambda linear, part: q(linear, f"mlp.{part}"))


class FastMoeCausalLM(FastCausalLM):
    """FastCausalLM (notebook 13) for Qwen3-MoE: fused attention, experts on A4's kernel when quantized."""

    layer_class = FastMoeLayer

    def __init__(self, model: MoeCausalLM, quantize: str | None = None, group_size: int = 32, kernel: str = "auto"):
        validate_moe_quantizable(model, quantize, group_size, BLOCK if kernel == "dot8" else None)  # (Plumbing)
        on_cpu = model.model.embed_tokens.weight.device.type == "cpu"
        if kernel == "auto" and on_cpu and any(K % BLOCK for K in expert_widths(model).values()):
            kernel = "packed"  # A4's kernel reads blocks of 32 inputs; torch's kernels take any width
        super().__init__(model, quantize, group_size, kernel)


def expert_widths(model: MoeCausalLM) -> dict[str, int]:
    """{name: input features K} of every sparse layer's expert (and shared expert) projections."""
    widths = {}
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, SparseMoeBlock):
            name, mlp = f"model.layers.{i}.mlp", layer.mlp
            widths[f"{name}.experts.gate_up_proj"] = mlp.experts.gate_up_proj.shape[2]  # h
            widths[f"{name}.experts.down_proj"] = mlp.experts.down_proj.shape[2]  # I
            if mlp.shared_expert is not None:
                widths[f"{name}.shared_expert.down_proj"] = mlp.shared_expert.down_proj.in_features
    return widths


def validate_moe_quantizable(model: MoeCausalLM, mode: str | None, group_size: int, kernel_block: int | None = None) -> None:
    """The experts' input widths K, before any layer is replaced: int4's groups must divide each K, and
    A4's kernel, when asked for by name (kernel_block = 32), reads blocks of inputs. Qwen3.5's hybrid is refused."""
    if not isinstance(model, MoeCausalLM):
        raise TypeError(f"expected a Qwen3-MoE (MoeCausalLM), got {type(model).__name__}: Qwen3.5's hybrid "
                        "layers have no quantized or fast path yet")
    if mode is None:  # float: no width to check
        return
    for name, K in expert_widths(model).items():
        if mode == "int4":
            validate_group_size(K, group_size, name)
        if kernel_block and K % kernel_block:
            raise ValueError(f"{name}: input features K={K} is not a multiple of {kernel_block}, the block "
                             "A4's kernel reads; kernel='auto' takes torch's kernels")
