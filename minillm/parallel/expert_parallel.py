# Generated from notebooks/23_moe.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Expert parallelism: each rank holds a share of every MoE layer's experts, whole; the ranks' sums added.

Built in notebooks/23_moe.ipynb on notebook 21's process group (init_tensor_parallel: the variables
torchrun sets, gloo on a CPU, NCCL on GPUs; all_reduce). The router, attention, the embeddings and
the shared expert stay whole on every rank (the shared expert runs on rank 0 alone, so the sum
counts it once); each rank runs the (token, expert) pairs whose expert it holds. Every rank loads
the whole checkpoint and keeps its share: reading only the share is not built yet.

Shape legend: N tokens, h hidden, E experts in all, El this rank's, k experts per token, I width.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from minillm.model.moe import SparseMoeBlock, experts_grouped
from minillm.parallel.tensor_parallel import all_reduce, init_tensor_parallel
from minillm.weights.moe import load_moe_folder


def expert_share(num_experts: int, rank: int, world: int) -> range:
    """The experts rank holds: a contiguous run of num_experts / world."""
    if num_experts % world:
        raise ValueError(f"expert parallelism over {world} ranks needs num_experts divisible by {world}, got {num_experts}")
    n = num_experts // world
    return range(rank * n, (rank + 1) * n)


def local_experts(x, gate_up_proj, down_proj, weights, experts, first: int) -> torch.Tensor:
    """This rank's part of the layer: the pairs whose expert is one of its El (from `first`), through
    experts_grouped as pairs of one choice each, added to their tokens' rows. x (N, h), gate_up_proj
    (El, 2I, h), down_proj (El, h, I), weights and experts (N, k) -> (N, h), zero where no pair is held."""
    token, slot = torch.where((experts >= first) & (experts < first + gate_up_proj.shape[0]))
    y = experts_grouped(x[token], gate_up_proj, down_proj, weights[token, slot, None], experts[token, slot, None] - first)
    return torch.zeros_like(x).index_add_(0, token, y)  # (N, h)


class ExpertParallelBlock(nn.Module):
    """One rank's SparseMoeBlock: the router (and, on rank 0, the shared expert) whole, its share of the
    experts, and the ranks' outputs summed (one all-reduce)."""

    def __init__(self, block: SparseMoeBlock, rank: int, world: int):
        super().__init__()
        share = expert_share(block.experts.gate_up_proj.shape[0], rank, world)
        self.gate, self.first = block.gate, share.start
        self.gate_up_proj = nn.Parameter(block.experts.gate_up_proj[share].clone())  # (El, 2I, h): the rest is freed
        self.down_proj = nn.Parameter(block.experts.down_proj[share].clone())  # (El, h, I)
        self.shared_expert = block.shared_expert if rank == 0 else None  # added once, by rank 0
        self.shared_expert_gate = block.shared_expert_gate if rank == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h) -> (B, T, h)
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat)
        out = local_experts(flat, self.gate_up_proj, self.down_proj, weights, experts, self.first)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return all_reduce(out).view_as(x)


def expert_parallel_model(model: nn.Module, rank: int, world: int) -> nn.Module:
    """A loaded MoE model with every SparseMoeBlock replaced by this rank's ExpertParallelBlock."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp = ExpertParallelBlock(layer.mlp, rank, world)
    return model


def load_expert_parallel(folder: str | Path, world: int, dtype: torch.dtype | None = None) -> nn.Module:
    """In one of the `world` processes torchrun started: join the group, load the MoE folder, keep this rank's share."""
    rank, device = init_tensor_parallel(world)
    model = load_moe_folder(folder, dtype=dtype, device="cpu")
    return expert_parallel_model(model, rank, world).to(device)
