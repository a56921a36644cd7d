"""The benchmark's lora section (plumbing): what serving many LoRA adapters at once costs.

The same requests (mixed lengths, seeded, greedy, end-of-sequence off) run three ways through
minillm's engine: on the base model alone; on a MultiLoRA model (notebook 20) with every request
on the base model (the wrapper's own cost); and spread over ADAPTERS random rank-RANK adapters on
all seven projections, one batch mixing them (each row gathers its adapter). The peer is
transformers with PEFT on the same adapters and requests: one left-padded batch, `adapter_names`
giving each row its adapter (PEFT's mixed-batch inference), against the same batch on the bare
transformers model. Useful tokens are each request's own max_new_tokens.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

from minillm.bench.engine import minillm_engine, mixed_requests, transformers_padded_batch
from minillm.weights.lora import TARGET_MODULES, AdapterConfig, MultiLoRA, add_lora, read_adapter, save_adapter

ADAPTERS, RANK = 4, 8


def random_adapters(model, folder: Path, n: int = ADAPTERS) -> dict[str, Path]:
    """n seeded adapters of rank RANK on every target module of `model`, saved in PEFT's format."""
    folders = {}
    for i in range(n):
        trained = copy.deepcopy(model)
        config = AdapterConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGET_MODULES)
        torch.manual_seed(i)
        for module in add_lora(trained, config).values():
            torch.nn.init.normal_(module.lora_B.weight, std=0.01)
        folders[f"a{i}"] = save_adapter(trained, config, folder / f"a{i}")
        del trained
    return folders


def minillm_adapters(model, tokenizer, requests, folders: dict[str, Path], spread: bool) -> float:
    """Seconds for the engine on a MultiLoRA model: request i on adapter i mod n, or all on the base model."""
    served = MultiLoRA(copy.deepcopy(model), {name: read_adapter(path) for name, path in folders.items()})
    names = list(folders) if spread else [None]
    return minillm_engine(served, tokenizer, requests, [names[i % len(names)] for i in range(len(requests))])


def peft_adapters(hf_model, requests, folders: dict[str, Path], pad_id: int) -> float | None:
    """Seconds for transformers + PEFT on one padded batch, row i on adapter i mod n (PEFT's adapter_names)."""
    import peft  # the peer, installed for tests and benchmarks only

    names = list(folders)
    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), folders[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name)
    rows = [names[i % len(names)] for i in range(len(requests))]
    return transformers_padded_batch(model.eval(), requests, pad_id, adapter_names=rows)


def lora_rows(sides, args, row, skipped: dict) -> None:
    """Rows of the lora section: tok/s for base, wrapper-only and spread batches, minillm and transformers+PEFT."""
    n = 4 if args.quick else 16
    prompt_range, new_range = ((4, 48), (4, 32)) if args.quick else ((16, 128), (16, 64))
    requests = mixed_requests(n, sides.model.config.vocab_size, seed=n, prompt_range=prompt_range, new_range=new_range)
    useful = sum(m for _, m in requests)
    with tempfile.TemporaryDirectory(prefix="minillm-bench-lora-") as tmp:
        folders = random_adapters(sides.model, Path(tmp))
        base = useful / minillm_engine(sides.model, sides.tokenizer, requests)
        hf_base = useful / transformers_padded_batch(sides.hf, requests, pad_id=0)
        wrapped = useful / minillm_adapters(sides.model, sides.tokenizer, requests, folders, spread=False)
        spread = useful / minillm_adapters(sides.model, sides.tokenizer, requests, folders, spread=True)
        try:
            hf_spread = useful / peft_adapters(sides.hf, requests, folders, pad_id=0)
        except ImportError as e:
            hf_spread = None
            skipped["lora: transformers + PEFT"] = f"skipped: {e}"
    row("lora", "base model", "engine", "tok/s", base, hf_base, n=n)
    row("lora", "MultiLoRA, all on base", "engine", "tok/s", wrapped, hf_base, n=n)
    row("lora", f"{ADAPTERS} adapters, mixed batch", "engine", "tok/s", spread, hf_spread, n=n)
    row("lora", f"{ADAPTERS} adapters, mixed batch", "vs base model", "x", spread / base,
        None if hf_spread is None else hf_spread / hf_base, n=n)
