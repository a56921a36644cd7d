# Generated from notebooks/20_lora.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""LoRA: low-rank adapters, trained on a frozen model, saved and read in PEFT's format, many served at once.

Built in notebooks/20_lora.ipynb. An adapter changes a linear layer's weight W (out, in) by
B @ A * scaling, with A (r, in) and B (out, r) for a small rank r. `LoRALinear` trains one;
`save_adapter` and `read_adapter` write and read PEFT's files (adapter_config.json,
adapter_model.safetensors); `merge_adapter` folds an adapter into the weights and
`attach_adapter` keeps it apart; `MultiLoRA` serves several adapters in one batch, each row
gathering its own A and B (the idea of Punica's and S-LoRA's batched kernels).

Shape legend: B batch, T tokens, r rank, N adapters.

References:
- E. Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022 (arXiv:2106.09685).
- D. Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA", 2023 (arXiv:2312.03732).
- L. Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024 (arXiv:2310.18547).
- Y. Sheng et al., "S-LoRA: Serving Thousands of Concurrent LoRA Adapters", MLSys 2024 (arXiv:2311.03285).
- Hugging Face PEFT, tuners/lora: the file format and the parameter names.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from minillm.weights.gguf_file import WeightsError
from minillm.model.decoder import CausalLM
from minillm.weights.loading import read_safetensors_header, stream_safetensors
from minillm.utils.validate import is_number, is_positive_int

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # PEFT's name for the model it wraps, before each module path
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update: base_layer(x) + lora_B(lora_A(x)) * scaling."""

    def __init__(self, base_layer: nn.Linear, r: int, scaling: float):
        super().__init__()
        self.base_layer, self.scaling = base_layer, scaling
        kw = dict(bias=False, dtype=base_layer.weight.dtype, device=base_layer.weight.device)
        self.lora_A = nn.Linear(base_layer.in_features, r, **kw)  # weight (r, in): Kaiming-uniform, as PEFT
        self.lora_B = nn.Linear(r, base_layer.out_features, **kw)  # weight (out, r): zeros, so B A = 0 at first
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling  # (..., in) -> (..., r) -> (..., out)

    def delta_weight(self) -> Tensor:  # (out, r) @ (r, in) -> (out, in): what merging adds to W
        return self.lora_B.weight @ self.lora_A.weight * self.scaling


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of PEFT's adapter_config.json that decide what an adapter computes."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")  # last names, or a regex on the whole path
    use_rslora: bool = False  # scaling alpha / sqrt(r) instead of alpha / r
    rank_pattern: dict = field(default_factory=dict)  # module-path pattern -> its own r
    alpha_pattern: dict = field(default_factory=dict)  # module-path pattern -> its own alpha
    base_model_name_or_path: str | None = None

    def rank(self, module: str) -> int:
        return _pattern_value(self.rank_pattern, module, self.r)

    def scaling(self, module: str) -> float:
        """alpha / r (or alpha / sqrt(r)) for one module path, after rank_pattern and alpha_pattern."""
        r, alpha = self.rank(module), _pattern_value(self.alpha_pattern, module, self.lora_alpha)
        return alpha / (math.sqrt(r) if self.use_rslora else r)

    def targets(self, module: str) -> bool:
        """Would PEFT adapt the module at this path?"""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        return module.rsplit(".", 1)[-1] in self.target_modules


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule: the first key that matches the end of the module path (after a dot) wins."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def add_lora(model: nn.Module, config: AdapterConfig) -> dict[str, LoRALinear]:
    """Wrap each targeted linear of `model` in a LoRALinear, in place, and freeze everything else.
    Returns {module path: its LoRALinear}: their A and B are the only trainable parameters."""
    model.requires_grad_(False)
    wrapped = {}
    for path, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and path.rsplit(".", 1)[-1] in TARGET_MODULES and config.targets(path):
            wrapped[path] = LoRALinear(module, config.rank(path), config.scaling(path))
            set_module(model, path, wrapped[path])
    if not wrapped:
        raise ValueError(f"no linear of the model matches target_modules {config.target_modules!r}")
    return wrapped


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """Replace the submodule at a dotted path ("model.layers.0.self_attn.q_proj")."""
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)


def save_adapter(model: nn.Module, config: AdapterConfig, folder: str | Path) -> Path:
    """Write the LoRALinear weights of `model` as a PEFT adapter: adapter_config.json + adapter_model.safetensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"{PEFT_PREFIX}{path}.{part}.weight": getattr(module, part).weight.detach().contiguous()
               for path, module in model.named_modules() if isinstance(module, LoRALinear)
               for part in ("lora_A", "lora_B")}
    save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(peft_config(config), indent=2) + "\n", encoding="utf-8")
    return folder


def peft_config(config: AdapterConfig) -> dict:
    """adapter_config.json's fields: ours, and PEFT's defaults for those that would change the result."""
    targets = config.target_modules if isinstance(config.target_modules, str) else sorted(config.target_modules)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.r, "lora_alpha": config.lora_alpha,
            "target_modules": targets, "use_rslora": config.use_rslora, "rank_pattern": config.rank_pattern,
            "alpha_pattern": config.alpha_pattern, "base_model_name_or_path": config.base_model_name_or_path,
            "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False, "modules_to_save": None,
            "use_dora": False, "init_lora_weights": True, "inference_mode": True}


@dataclass
class Adapter:
    """A loaded adapter: its config and, per module path, (A (r, in), B (out, r), scaling)."""

    config: AdapterConfig
    weights: dict[str, tuple[Tensor, Tensor, float]]
    source: str

    def delta(self, module: str) -> Tensor:  # (out, r) @ (r, in) -> (out, in)
        A, B, scaling = self.weights[module]
        return B @ A * scaling


def read_adapter(folder: str | Path) -> Adapter:
    """A PEFT LoRA adapter from its folder; errors name the file, the field or the tensor."""
    folder = Path(folder)
    config = read_adapter_config(folder)  # Plumbing, below
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"adapter weights not found: {path} (PEFT's pickled .bin files are not read)")
    pairs: dict[str, dict[str, Tensor]] = {}
    for name, tensor in stream_safetensors(path, read_safetensors_header(path)):
        match = re.fullmatch(rf"{re.escape(PEFT_PREFIX)}(.+)\.(lora_A|lora_B)\.weight", name)
        if match is None:
            raise WeightsError(f"{path}: tensor {name} is not a LoRA weight (<prefix><module>.lora_A.weight or lora_B)")
        pairs.setdefault(match[1], {})[match[2]] = tensor.to(torch.promote_types(tensor.dtype, torch.float32), copy=True)
    if not pairs:
        raise WeightsError(f"{path}: the file holds no LoRA weights")
    weights = {module: checked_pair(path, module, pair, config) for module, pair in sorted(pairs.items())}
    return Adapter(config, weights, str(folder))


UNSUPPORTED = {  # adapter_config.json fields whose other values change what the adapter computes: their defaults
    "use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "modules_to_save": None,
    "layer_replication": None, "trainable_token_indices": None, "alora_invocation_tokens": None,
    "use_qalora": False, "target_parameters": None,
}


def read_adapter_config(folder: Path) -> AdapterConfig:
    """adapter_config.json, checked: a LoRA adapter that computes here exactly what it computes in PEFT."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"adapter config not found: {path}" + ("" if folder.is_dir() else " (no such folder)"))
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(raw).__name__}")
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {raw['peft_type']!r} is not supported; supported: 'LORA'")
    for name, default in [*UNSUPPORTED.items(), ("bias", "none")]:
        if raw.get(name, default) not in (default, [], {}):
            raise ValueError(f"{path}: {name}={raw[name]!r} is not supported (only {default!r})")
    r, alpha, targets = raw.get("r"), raw.get("lora_alpha", 8), raw.get("target_modules")
    if not is_positive_int(r):
        raise ValueError(f"{path}: r must be a positive integer, got {r!r}")
    if not is_number(alpha) or not math.isfinite(alpha):
        raise ValueError(f"{path}: lora_alpha must be a finite number, got {alpha!r}")
    if not (isinstance(targets, str) or isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"{path}: target_modules must be a list of module names or a regex, got {targets!r}")
    patterns = {key: raw.get(key) or {} for key in ("rank_pattern", "alpha_pattern")}
    if not all(isinstance(p, dict) for p in patterns.values()):
        raise ValueError(f"{path}: rank_pattern and alpha_pattern must be objects")
    return AdapterConfig(r, alpha, targets if isinstance(targets, str) else tuple(targets),
                         bool(raw.get("use_rslora", False)), **patterns,
                         base_model_name_or_path=raw.get("base_model_name_or_path"))


def checked_pair(path: Path, module: str, pair: dict[str, Tensor], config: AdapterConfig) -> tuple[Tensor, Tensor, float]:
    """(A, B, scaling) of one module: both there, 2-D, of the rank the config gives it, A's rows = B's columns."""
    missing = sorted({"lora_A", "lora_B"} - set(pair))
    if missing:
        raise WeightsError(f"{path}: module {module} has no {missing[0]}.weight")
    A, B, r = pair["lora_A"], pair["lora_B"], config.rank(module)
    if A.ndim != 2 or B.ndim != 2 or A.shape[0] != r or B.shape[1] != r:
        raise WeightsError(f"{path}: module {module}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} "
                           f"must be (r, in) and (out, r) with r = {r}")
    return A, B, config.scaling(module)


def validate_fits(model: nn.Module, adapter: Adapter) -> None:
    """Each adapted module is a q/k/v/o/gate/up/down linear of the model, of the size A and B expect."""
    modules = dict(model.named_modules())
    for path, (A, B, _) in adapter.weights.items():
        linear = modules.get(path)
        linear = getattr(linear, "base_layer", linear)  # already wrapped (LoRALinear, MultiLoRALinear)
        if not isinstance(linear, nn.Linear) or path.rsplit(".", 1)[-1] not in TARGET_MODULES:
            layers = getattr(getattr(model, "config", None), "num_hidden_layers", "?")
            raise ValueError(f"{adapter.source}: adapts module {path}, which is not a linear this model can adapt "
                             f"(the model has {layers} layers; adaptable: {', '.join(TARGET_MODULES)})")
        if (B.shape[0], A.shape[1]) != (linear.out_features, linear.in_features):
            raise ValueError(f"{adapter.source}: module {path} is (out, in) = {(linear.out_features, linear.in_features)} "
                             f"in the model, but the adapter's B @ A is {(B.shape[0], A.shape[1])}")


@torch.no_grad()
def merge_adapter(model: nn.Module, adapter: Adapter, sign: float = 1.0) -> nn.Module:
    """Fold the adapter into the weights, in place: W <- W + sign * B @ A * scaling (sign=-1 takes it out)."""
    validate_fits(model, adapter)
    for path in adapter.weights:
        weight = model.get_submodule(path).weight  # (out, in)
        weight += sign * adapter.delta(path).to(weight.device, weight.dtype)
    return model


def attach_adapter(model: nn.Module, adapter: Adapter) -> nn.Module:
    """Keep the adapter apart: each adapted linear becomes a LoRALinear holding A and B, frozen."""
    validate_fits(model, adapter)
    for path, (A, B, scaling) in adapter.weights.items():
        lora = LoRALinear(model.get_submodule(path), A.shape[0], scaling)
        with torch.no_grad():
            lora.lora_A.weight.copy_(A)
            lora.lora_B.weight.copy_(B)
        set_module(model, path, lora)
    return model.requires_grad_(False)


class AdapterRows:
    """Which adapter each row of the current forward uses: (B,) indices into the stacks, 0 = none."""

    def __init__(self):
        self.ids: Tensor | None = None


class MultiLoRALinear(nn.Module):
    """A linear serving N adapters at once: each row adds its own adapter's B A x (index 0: zeros)."""

    def __init__(self, base_layer: nn.Linear, A: Tensor, B: Tensor, rows: AdapterRows):
        super().__init__()
        self.base_layer, self.rows = base_layer, rows
        self.register_buffer("lora_A", A)  # (N + 1, r, in)
        self.register_buffer("lora_B", B)  # (N + 1, out, r), scaling folded in

    def forward(self, x: Tensor) -> Tensor:  # (B, T, in) -> (B, T, out)
        y = self.base_layer(x)  # the shared part: one matmul for every row
        if self.rows.ids is None:  # a batch on the base model alone
            return y
        A, B = self.lora_A[self.rows.ids], self.lora_B[self.rows.ids]  # (B, r, in), (B, out, r): gathered per row
        return y + (x @ A.transpose(1, 2)) @ B.transpose(1, 2)  # (B, T, in) -> (B, T, r) -> (B, T, out)


class MultiLoRA(nn.Module):
    """A model serving several adapters in one batch: forward(..., adapter_ids) with one index per row
    (0: the base model, i: the i-th adapter); otherwise the forward contract of CausalLM."""

    def __init__(self, base_model: CausalLM, adapters: dict[str, Adapter]):
        super().__init__()
        self.base_model, self.config, self.rows = base_model, base_model.config, AdapterRows()
        self.names = ["", *adapters]  # index 0: no adapter
        for adapter in adapters.values():
            validate_fits(base_model, adapter)
        rank = max(A.shape[0] for adapter in adapters.values() for A, _, _ in adapter.weights.values())
        for path in sorted({path for adapter in adapters.values() for path in adapter.weights}):
            base = base_model.get_submodule(path)  # (out, in)
            kw = dict(dtype=base.weight.dtype, device=base.weight.device)
            A = torch.zeros(len(self.names), rank, base.in_features, **kw)  # (N + 1, r, in)
            B = torch.zeros(len(self.names), base.out_features, rank, **kw)  # (N + 1, out, r)
            for i, adapter in enumerate(adapters.values(), start=1):
                if path in adapter.weights:  # a smaller rank is padded with zeros: they add nothing
                    a, b, scaling = adapter.weights[path]
                    A[i, : a.shape[0]], B[i, :, : a.shape[0]] = a, b * scaling
            set_module(base_model, path, MultiLoRALinear(base, A, B, self.rows))
        base_model.requires_grad_(False)

    def forward(self, input_ids: Tensor, *args, adapter_ids: Tensor | None = None, **kwargs) -> Tensor:
        if adapter_ids is not None and tuple(adapter_ids.shape) != (input_ids.shape[0],):
            raise ValueError(f"adapter_ids must be (B,) = ({input_ids.shape[0]},), got {tuple(adapter_ids.shape)}")
        self.rows.ids = adapter_ids  # read by every MultiLoRALinear during this forward
        try:
            return self.base_model(input_ids, *args, **kwargs)
        finally:
            self.rows.ids = None
