# Generated from notebooks/21_tensor_parallel.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Tensor parallelism: one model split across ranks, Megatron-style, over torch.distributed.

Built in notebooks/21_tensor_parallel.ipynb. Each of N ranks holds 1/N of every large matrix:
q/k/v and gate/up split by output rows (column-parallel), o_proj and down_proj by input columns
(row-parallel: an all-reduce sums the ranks' partial outputs, two per block), the embedding and
the head by vocabulary rows (an all-reduce after the lookup, an all-gather of the logits). KV
heads fewer than the ranks are replicated, each rank keeping the one its query heads read. Each
rank builds the same CausalLM contract with its own shapes (its `config` is its share, so a KV
cache made from it holds only its heads) and reads only its slices from the checkpoint's memory
map. Every rank runs the same program (SPMD): the logits are gathered whole on every rank, so
every rank samples the same tokens; minillm/parallel/lockstep.py keeps the ranks in step.

Shape legend: h hidden, H/Hkv heads, D head dim, I intermediate, V vocab; a trailing l: one rank's share.

References:
- M. Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
  Parallelism", 2019 (arXiv:1909.08053): column- and row-parallel linears, two all-reduces a block.
- nano-vllm (layers/linear.py, layers/embed_head.py) and gpt-fast (tp.py): the same splits for inference.
- torch.distributed: init_process_group, all_reduce, all_gather (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minillm.model.devices import default_dtype
from minillm.weights.hub import download
from minillm.model.decoder import CausalLM, ModelConfig
from minillm.weights.loading import validate_names_and_shapes, gguf_tensors, open_folder, open_gguf
from minillm.utils.validate import is_positive_int

TP_TIMEOUT = 60.0  # seconds a collective waits for the other ranks before it fails


class RankLost(RuntimeError):
    """A collective failed: another rank died, or did not answer within the timeout."""


def validate_split(config: ModelConfig, world: int) -> None:
    """Can `config` be split over `world` ranks? ValueError naming the sizes that do not divide."""
    if not is_positive_int(world):
        raise ValueError(f"tensor_parallel must be an int >= 1, got {world!r}")
    H, Hkv, I = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    bad = [f"num_attention_heads {H}"] if H % world else []
    if Hkv >= world and Hkv % world:
        bad.append(f"num_key_value_heads {Hkv}")
    if Hkv < world and world % Hkv:  # replicated KV heads: each must serve a whole number of ranks
        bad.append(f"num_key_value_heads {Hkv} (fewer than the ranks: {world} must be a multiple of it)")
    if I % world:
        bad.append(f"intermediate_size {I}")
    if bad:
        raise ValueError(f"tensor_parallel {world} does not divide {', '.join(bad)}; "
                         f"choose a size that divides the heads and the MLP width")


@dataclass(frozen=True)
class Split:
    """Rank `rank` of `world`: which heads, MLP columns and vocabulary rows of `config` it holds."""

    config: ModelConfig  # the whole model's
    rank: int
    world: int

    def __post_init__(self):
        validate_split(self.config, self.world)
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank}")

    @property
    def heads(self) -> slice:  # this rank's query heads
        n = self.config.num_attention_heads // self.world
        return slice(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> slice:  # its KV heads: a share, or the one its query heads read (replicated)
        Hkv = self.config.num_key_value_heads
        if Hkv >= self.world:
            n = Hkv // self.world
            return slice(self.rank * n, (self.rank + 1) * n)
        first = self.rank * Hkv // self.world  # world / Hkv ranks share each KV head
        return slice(first, first + 1)

    @property
    def columns(self) -> slice:  # its MLP columns (of I)
        n = self.config.intermediate_size // self.world
        return slice(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_rows(self) -> int:  # ceil(V / world): the last rank's rows past V are zeros
        return math.ceil(self.config.vocab_size / self.world)

    @property
    def vocab(self) -> slice:
        return slice(self.rank * self.vocab_rows, (self.rank + 1) * self.vocab_rows)

    def local_config(self) -> ModelConfig:
        """The shapes this rank computes: its heads and MLP columns (vocab_size stays whole: the logits are)."""
        c = self.config
        return replace(c, num_attention_heads=c.num_attention_heads // self.world,
                       num_key_value_heads=self.kv_heads.stop - self.kv_heads.start,
                       intermediate_size=c.intermediate_size // self.world)


def heads_rows(heads: slice, D: int) -> slice:
    """The rows of a projection's output (H*D) that hold these heads."""
    return slice(heads.start * D, heads.stop * D)


def shard(split: Split, name: str, w: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the checkpoint tensor `name` (HF name), a view where it can be."""
    D = split.config.head_dim
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return w[heads_rows(split.heads, D)]  # column-parallel: (H*D, h) -> (Hl*D, h)
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return w[heads_rows(split.kv_heads, D)]  # (Hkv*D, h) -> (Hkvl*D, h)
    if name.endswith("o_proj.weight"):
        return w[:, heads_rows(split.heads, D)]  # row-parallel: (h, H*D) -> (h, Hl*D)
    if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")):
        return w[split.columns]  # (I, h) -> (Il, h)
    if name.endswith("down_proj.weight"):
        return w[:, split.columns]  # (h, I) -> (h, Il); its bias stays whole, added once after the sum
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = w[split.vocab]  # (V, h) -> (Vl, h); the last rank's may be short: zeros below
        return rows if len(rows) == split.vocab_rows else F.pad(rows, (0, 0, 0, split.vocab_rows - len(rows)))
    return w  # norms: every rank keeps them whole


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """x summed over the ranks, in place; RankLost if a rank is gone."""
    try:
        dist.all_reduce(x)
    except RuntimeError as exc:  # gloo: "Connection closed by peer", a timeout; NCCL: its own errors
        raise RankLost(f"tensor parallel rank {dist.get_rank()}: all_reduce failed, another rank died or did "
                       f"not answer in time ({exc})") from exc
    return x


def all_gather_last(x: torch.Tensor, world: int) -> torch.Tensor:
    """(..., n) on each rank -> (..., world * n): the ranks' tensors side by side, rank order."""
    parts = [torch.empty_like(x) for _ in range(world)]
    try:
        dist.all_gather(parts, x.contiguous())
    except RuntimeError as exc:
        raise RankLost(f"tensor parallel rank {dist.get_rank()}: all_gather failed, another rank died or did "
                       f"not answer in time ({exc})") from exc
    return torch.cat(parts, dim=-1)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_l @ W_l^T, + b: each rank holds some input columns of W (h, I) as (h, Il)."""

    def __init__(self, in_local: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., Il) -> (..., h)
        y = all_reduce(F.linear(x, self.weight))  # the partial sums of every rank, added
        return y if self.bias is None else y + self.bias  # the bias once, not once per rank


class VocabParallelEmbedding(nn.Module):
    """Each rank holds Vl rows of the table; a token's row comes from the rank that holds it (others add 0)."""

    def __init__(self, split: Split):
        super().__init__()
        self.first, self.rows = split.vocab.start, split.vocab_rows
        self.weight = nn.Parameter(torch.empty(self.rows, split.config.hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, h)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.rows)  # (B, T): another rank holds these rows
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, h)
        return all_reduce(x.masked_fill_(outside[..., None], 0.0))


class VocabParallelHead(nn.Module):
    """Logits for this rank's Vl vocabulary rows, then all ranks' side by side: (..., h) -> (..., V)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, world: int):
        super().__init__()
        self.weight, self.vocab_size, self.world = weight, vocab_size, world  # tied: the embedding's own rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)  # (..., Vl)
        return all_gather_last(logits, self.world)[..., : self.vocab_size]  # (..., V), every rank


def tensor_parallel_model(split: Split) -> CausalLM:
    """The CausalLM of one rank (on the default device: "meta" to check shapes without memory)."""
    config = split.config
    model = CausalLM(split.local_config())  # q/k/v and gate/up already have this rank's rows
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj.in_features, config.hidden_size)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, config.hidden_size, bias=config.mlp_bias)
    model.model.embed_tokens = embed = VocabParallelEmbedding(split)
    head = embed.weight if config.tie_word_embeddings else nn.Parameter(torch.empty_like(embed.weight))
    model.lm_head = VocabParallelHead(head, config.vocab_size, split.world)
    model.split = split  # the whole model's config is model.split.config
    return model


def empty_shard(split: Split, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> CausalLM:
    """One rank's model allocated once on `device`, its weights not yet written."""
    device = torch.device(device)
    with torch.device("meta"):
        model = tensor_parallel_model(split)
    model = model.to(dtype=dtype or default_dtype(device)).to_empty(device=device)
    if split.config.tie_word_embeddings:  # to_empty gave the head a tensor of its own: tie it again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope()  # to_empty left inv_freq uninitialised
    return model


def read_checkpoint(source: str | Path) -> tuple[ModelConfig, dict, Iterator[tuple[str, torch.Tensor]], str]:
    """A .gguf file or a model folder, checked: its config, {name: shape}, the (name, tensor) stream and
    its name for errors. No tensor data is read until the stream is (safetensors: views of a memory map)."""
    path = Path(source)
    if path.suffix == ".gguf":
        config, shapes, infos = open_gguf(path)
        return config, shapes, gguf_tensors(config, shapes, infos), str(path)
    return open_folder(path)


def load_shard(source: str | Path, rank: int, world: int, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> CausalLM:
    """Rank `rank` of `world`'s model from a .gguf file or a model folder: every name and shape of the
    whole checkpoint is checked, then only this rank's slices are copied (from a safetensors memory
    map, only their pages are read). A size that does not split raises ValueError naming it."""
    config, shapes, tensors, name = read_checkpoint(source)
    split = Split(config, rank, world)
    validate_names_and_shapes(config, shapes, name)  # the whole model's names and shapes, on "meta"
    model = empty_shard(split, dtype, device)
    params, written = dict(model.named_parameters()), set()  # a tied head is listed once, as the embedding
    with torch.no_grad():
        for key, w in tensors:
            if key in params:
                params[key].copy_(shard(split, key, w))  # cast and move this rank's slice only
                written.add(key)
    assert written == set(params), f"not written: {sorted(set(params) - written)}"
    return model.eval()


def init_tensor_parallel(world: int, timeout: float = TP_TIMEOUT) -> tuple[int, torch.device]:
    """Join the process group that torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
    gloo on the CPU, NCCL on CUDA, one GPU per rank (LOCAL_RANK). Returns (rank, device)."""
    launched = os.environ.get("WORLD_SIZE")
    if launched != str(world):
        raise ValueError(f"tensor_parallel {world} runs as {world} processes: launch with `torchrun "
                         f"--nproc-per-node {world} -m minillm ...` (WORLD_SIZE is {launched or 'not set'})")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout))
    return dist.get_rank(), device


def load_rank_shard(source: str | Path, world: int, dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None) -> CausalLM:
    """In one of the `world` processes torchrun started: join the group, then load this rank's shard of
    a .gguf file, a model folder or a hub id (rank r runs on cuda:LOCAL_RANK, or on the CPU)."""
    if device not in (None, "auto"):
        raise ValueError(f"tensor_parallel places each rank on its own device (cuda:LOCAL_RANK, or the CPU); "
                         f"got device {device!r}: leave it auto")
    if not Path(source).exists() and Path(source).suffix != ".gguf":
        source = download(str(source))  # a hub id: every rank reads the one cached copy
    rank, device = init_tensor_parallel(world)
    return load_shard(source, rank, world, dtype, device)
