# Generated from notebooks/22_linear_attention.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Loading Qwen3.5 checkpoints: the text model out of a vision-language folder.

Built in notebooks/22_linear_attention.ipynb with the loader of notebook 06: the same checked
safetensors headers and streamed tensors, the decoder's names read from under
`model.language_model.` and the vision tower (`model.visual.`) and the multi-token-prediction
head (`mtp.`) skipped, once, with a message.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from minillm.model.devices import default_dtype, pick_device
from minillm.model.decoder import read_config_json
from minillm.model.qwen3_5 import HYBRID_MODEL_TYPES, HybridCausalLM, HybridConfig
from minillm.weights.loading import _build, open_folder

TEXT_PREFIX = "model.language_model."  # Qwen3_5ForConditionalGeneration's decoder
SKIPPED_PREFIXES = ("model.visual.", "mtp.")  # the vision tower; the multi-token-prediction head


def text_model_name(name: str) -> str | None:
    """A checkpoint tensor's name in the text model (model.X, lm_head.weight), or None: skipped."""
    if name.startswith(TEXT_PREFIX):
        return "model." + name[len(TEXT_PREFIX):]
    if name.startswith(SKIPPED_PREFIXES):
        return None
    return name  # the text-only layout (Qwen3_5ForCausalLM) and lm_head.weight


def text_model_tensors(shapes: dict, source: str) -> dict:
    """{text-model name: value} from a checkpoint's {name: value}; says once what it skipped."""
    kept, skipped = {}, []
    for name, value in shapes.items():
        new = text_model_name(name)
        if new is None:
            skipped.append(name)
        else:
            kept[new] = value
    if skipped:
        towers = sorted({name.split(".")[0] if name.startswith("mtp.") else "model.visual" for name in skipped})
        warnings.warn(f"{source}: skipped {len(skipped)} tensors of {', '.join(towers)} "
                      f"(minillm runs the text model only)", stacklevel=3)
    return kept




def load_hybrid_folder(folder: str | Path, dtype: torch.dtype | None = None,
                       device: str | torch.device | None = None) -> HybridCausalLM:
    """A Qwen3.5 text model from a Hugging Face folder (config.json + safetensors, whole or sharded)."""
    device = pick_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    config, shapes, tensors, source = open_folder(folder, config_class=HybridConfig)
    shapes = text_model_tensors(shapes, source)
    return _build(config, shapes, _renamed(tensors), dtype, device, source, model_class=HybridCausalLM)


def _renamed(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        new = text_model_name(name)
        if new is not None:
            yield new, tensor


def is_hybrid_folder(folder: str | Path) -> bool:
    """Whether a model folder holds a Qwen3.5: its config.json's model_type alone decides, before a weight is read."""
    folder = Path(folder)
    if not (folder.is_dir() and (folder / "config.json").is_file()):
        return False
    config, _ = read_config_json(folder)
    return config.get("model_type") in HYBRID_MODEL_TYPES
