# Generated from notebooks/23_moe.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Mixture of experts: a router sends each token to k of E expert MLPs; Qwen3-MoE and Qwen3.5-MoE.

Built in notebooks/23_moe.ipynb. `route` is the router (a softmax over the experts in float32, the
top k, renormalised when norm_topk_prob); `experts_loop` is the readable form of the layer and
`experts_grouped` the fast one (the (token, expert) pairs sorted by expert, one grouped matrix
product per projection). `SparseMoeBlock` is a MoE layer's MLP, with Qwen3.5-MoE's shared expert
behind a sigmoid gate; `MoeCausalLM` (Qwen3-MoE) and `HybridMoeCausalLM` (Qwen3.5-MoE) put it into
the decoders of notebooks 05 and 22, with transformers' parameter names.

Shape legend: N tokens (batch and time flattened), h hidden, E experts, k experts per token,
I an expert's width.

References: Shazeer et al., "Outrageously Large Neural Networks" (arXiv:1701.06538); Gale et al.,
"MegaBlocks" (arXiv:2211.15841); transformers' models/qwen3_moe and qwen3_5_moe (the tests' reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minillm.model.decoder import CausalLM, ModelConfig, hf_config_fields, validate_config_dict
from minillm.model.layers import MLP
from minillm.model.qwen3_5 import HybridCausalLM, HybridConfig, hybrid_config_fields, validate_hybrid_config_dict
from minillm.utils.validate import is_positive_int

MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text")


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert, a SwiGLU MLP: x (n, h), gate_up (2I, h) its gate rows then its up rows, down (h, I) -> (n, h)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # (n, I) each
    return F.linear(F.silu(gate) * up, down)


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: x (N, h), weight (E, h) -> weights (N, k) in x's dtype, experts (N, k) int64.

    A softmax over all E experts in float32, the k most probable kept and, with norm_topk_prob,
    renormalised to sum to 1 (without it, each keeps its share of the whole softmax)."""
    probs = torch.softmax(F.linear(x, weight).float(), dim=-1)  # (N, E): every expert's share
    top, experts = probs.topk(top_k, dim=-1)  # (N, k), the most probable first
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(x.dtype), experts


def experts_loop(x, gate_up_proj, down_proj, weights, experts) -> torch.Tensor:
    """The readable form: for each expert chosen at least once, its tokens through its MLP, added back
    weighted. x (N, h), gate_up_proj (E, 2I, h), down_proj (E, h, I), weights and experts (N, k) -> (N, h)."""
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():  # ascending, the order transformers adds them in
        token, slot = torch.where(experts == e)  # the tokens that chose e, and in which of their k slots
        y = expert_mlp(x[token], gate_up_proj[e], down_proj[e])  # (n_e, h)
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Row groups of x, each times its own matrix: rows [ends[g-1], ends[g]) @ w[g]. x (n, a), w (G, a, b),
    ends (G,) int32 -> (n, b). torch's grouped GEMM where it runs (CPU; CUDA in bfloat16 from Hopper on), else a loop."""
    if hasattr(F, "grouped_mm") and _grouped_mm_takes(x, w):
        return F.grouped_mm(x, w, offs=ends)
    out, start = x.new_empty(x.shape[0], w.shape[-1]), 0
    for g, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of experts (N, k) grouped by expert: order (N k,) into the flattened pairs,
    each sorted pair's token (N k,), and ends (E,) int32, the row where each expert's run ends."""
    order = experts.flatten().argsort(stable=True)  # stable: each expert's tokens stay in order
    ends = torch.bincount(experts.flatten(), minlength=num_experts).cumsum(0).to(torch.int32)
    return order, order // experts.shape[1], ends


def experts_grouped(x, gate_up_proj, down_proj, weights, experts) -> torch.Tensor:
    """The fast path: the N k (token, expert) pairs sorted by expert, then one grouped matrix product
    per projection over all experts. Arguments and result as experts_loop's."""
    order, token, ends = sort_by_expert(experts, gate_up_proj.shape[0])  # (N k,), (N k,), (E,)
    gate, up = grouped_matmul(x[token], gate_up_proj.transpose(1, 2), ends).chunk(2, dim=-1)  # (N k, I) each
    y = grouped_matmul(F.silu(gate) * up, down_proj.transpose(1, 2), ends)  # (N k, h)
    return torch.zeros_like(x).index_add_(0, token, y * weights.flatten()[order, None])

def _grouped_mm_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs these: every stride but the unit one a multiple of 16 bytes,
    on the CPU, or on CUDA in bfloat16 from Hopper (compute capability 9.0) on."""
    aligned = all(s == 1 or s * t.element_size() % 16 == 0 for t in (x, w) for s in t.stride())
    if x.device.type == "cuda":
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return aligned and x.device.type == "cpu"


class Router(nn.Module):
    """The router's weight (E, h), transformers' `mlp.gate`: one logit per expert for each token."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (N, h) -> weights, experts (N, k)
        return route(x, self.weight, self.top_k, self.norm_topk_prob)


class Experts(nn.Module):
    """E SwiGLU experts, stacked: gate_up_proj (E, 2I, h), down_proj (E, h, I)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return experts_grouped(x, self.gate_up_proj, self.down_proj, weights, experts)  # (N, h)


class SparseMoeBlock(nn.Module):
    """A MoE layer's MLP: the router, E experts and, in Qwen3.5-MoE, a shared expert every token
    passes through, scaled per token by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: MoeConfig):
        super().__init__()
        h, E = config.hidden_size, config.num_experts
        self.gate = Router(h, E, config.num_experts_per_tok, config.norm_topk_prob)
        self.experts = Experts(E, h, config.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(h, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)  # one number per token

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h) -> (B, T, h)
        flat = x.reshape(-1, x.shape[-1])  # (N, h): routing is per token, whatever its sequence
        weights, experts = self.gate(flat)  # (N, k) each
        out = self.experts(flat, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)


@dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """ModelConfig and the MoE fields, with config.json's names."""

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False  # transformers' default for qwen3_moe; Qwen3's checkpoints set true
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # 0: none (Qwen3-MoE); Qwen3.5-MoE has one

    def __post_init__(self):
        super().__post_init__()
        validate_moe_config(self)  # positive sizes, k <= E, layer indices in range (Plumbing)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> MoeConfig:
        """From a Qwen3-MoE config.json dict: Qwen3's fields, then the MoE ones."""
        validate_moe_config_dict(cfg, source)  # model_type qwen3_moe, Qwen3's fields, the MoE ones (Plumbing)
        fields = hf_config_fields(dict(cfg, model_type="qwen3")) | dict(model_type="qwen3_moe") | moe_config_fields(cfg)
        try:
            return cls(**fields)
        except (TypeError, ValueError, ArithmeticError) as exc:
            raise ValueError(f"{source}: {exc}") from None


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
ALIASES = {"num_experts": "num_local_experts"}  # the name transformers 5 saves qwen3_moe's under


def moe_config_fields(cfg: dict) -> dict:
    """The MoE fields of a config.json dict. Qwen3.5-MoE's has no norm_topk_prob: it always renormalises."""
    return dict(
        {name: cfg[name] if name in cfg else cfg[ALIASES[name]] for name in MOE_FIELDS},
        norm_topk_prob=bool(cfg.get("norm_topk_prob", cfg.get("model_type") != "qwen3_moe")),
        decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
    )


class MoeCausalLM(CausalLM):
    """Qwen3-MoE: notebook 05's decoder with a SparseMoeBlock as the MLP of each sparse layer."""

    def __init__(self, config: MoeConfig):
        super().__init__(config)  # dense MLPs first: a loader builds on the meta device, where they cost nothing
        for i, layer in enumerate(self.model.layers):
            if config.is_sparse(i):
                layer.mlp = SparseMoeBlock(config)


@dataclass(frozen=True)
class HybridMoeConfig(HybridConfig, MoeConfig):
    """Qwen3.5-MoE: HybridConfig's fields and the MoE ones; every layer sparse, with a shared expert."""

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> HybridMoeConfig:
        """From a Qwen3.5-MoE config.json dict (the text fields under text_config, or not)."""
        text = validate_hybrid_moe_config_dict(cfg, source)  # model_type, the MoE fields, the hybrid's (Plumbing)
        dense_view = dict(text, model_type="qwen3_5_text", intermediate_size=text["moe_intermediate_size"])
        fields = hybrid_config_fields(cfg, dense_view) | dict(model_type="qwen3_5_moe") | moe_config_fields(text)
        try:
            return cls(**fields)
        except (TypeError, ValueError, ArithmeticError) as exc:
            raise ValueError(f"{source}: {exc}") from None


class HybridMoeCausalLM(HybridCausalLM):
    """Qwen3.5-MoE's text model: notebook 22's hybrid with a SparseMoeBlock (and its shared expert) as every MLP."""

    def __init__(self, config: HybridMoeConfig):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = SparseMoeBlock(config)


def validate_moe_config(config: MoeConfig) -> None:
    """A MoE config's own fields: positive sizes, k <= E, mlp_only_layers among the layers."""
    for name in MOE_FIELDS + ("decoder_sparse_step",):
        if not is_positive_int(getattr(config, name)):
            raise ValueError(f"{name} must be a positive integer, got {getattr(config, name)!r}")
    if config.num_experts_per_tok > config.num_experts:
        raise ValueError(f"num_experts_per_tok {config.num_experts_per_tok} is more than num_experts {config.num_experts}")
    shared = config.shared_expert_intermediate_size
    if shared != 0 and not is_positive_int(shared):
        raise ValueError(f"shared_expert_intermediate_size must be a positive integer or 0, got {shared!r}")
    bad = [i for i in config.mlp_only_layers if type(i) is not int or not 0 <= i < config.num_hidden_layers]
    if bad:
        raise ValueError(f"mlp_only_layers {bad} are not layers of this model (0..{config.num_hidden_layers - 1})")


def validate_moe_config_dict(cfg: dict, source: str) -> None:
    """A Qwen3-MoE config.json dict: model_type qwen3_moe, Qwen3's fields, the MoE fields."""
    if not isinstance(cfg, dict) or cfg.get("model_type") != "qwen3_moe":
        got = cfg.get("model_type") if isinstance(cfg, dict) else type(cfg).__name__
        raise ValueError(f"{source}: model_type {got!r} is not qwen3_moe")
    validate_config_dict(dict(cfg, model_type="qwen3"), source)
    _require_moe_fields(cfg, source)


def validate_hybrid_moe_config_dict(cfg: dict, source: str) -> dict:
    """The dict a Qwen3.5-MoE config's text fields are in, checked: the MoE fields, then the hybrid's."""
    if not isinstance(cfg, dict) or cfg.get("model_type") not in ("qwen3_5_moe", "qwen3_5_moe_text"):
        got = cfg.get("model_type") if isinstance(cfg, dict) else type(cfg).__name__
        raise ValueError(f"{source}: model_type {got!r} is not qwen3_5_moe")
    text = cfg.get("text_config", cfg) if cfg["model_type"] == "qwen3_5_moe" else cfg
    if not isinstance(text, dict):
        raise ValueError(f"{source}: text_config must be an object")
    _require_moe_fields(text, source)
    validate_hybrid_config_dict(dict(text, model_type="qwen3_5_text", intermediate_size=text["moe_intermediate_size"]), source)
    return text


def _require_moe_fields(cfg: dict, source: str) -> None:
    missing = [name for name in MOE_FIELDS if name not in cfg and ALIASES.get(name) not in cfg]
    if missing:
        raise ValueError(f"{source}: missing field(s) {', '.join(missing)} for a mixture of experts")
