# Generated from notebooks/12_quantization.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""How close a changed model stays to the original: perplexity, KL divergence, greedy agreement.

Built in notebooks/12_quantization.ipynb; compares any two models with the same vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minillm.runtime.generate import generate


@torch.no_grad()
def perplexity(model: nn.Module, ids: Sequence[int], window: int = 256) -> float:
    """exp(mean negative log-likelihood) of ids[1:], scored in consecutive chunks of `window` tokens.

    Each chunk starts with an empty context, so its first token is not scored."""
    if window < 2 or len(ids) < 2:
        raise ValueError(f"need window >= 2 and at least 2 ids, got window={window}, {len(ids)} ids")
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([list(ids[start:start + window])], device=device)  # (1, T)
        if chunk.shape[1] < 2:
            break
        logits = model(chunk)[0].float()  # (T, V)
        nll += F.cross_entropy(logits[:-1], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(P_ref || P) between next-token distributions, logits (..., V)."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    ref = F.log_softmax(ref_logits.float(), dim=-1)
    out = F.log_softmax(logits.float(), dim=-1)
    return (ref.exp() * (ref - out)).sum(dim=-1).mean().item()


def greedy_tokens(model: nn.Module, tokenizer, prompt_ids: Sequence[int], n: int = 64) -> list[int]:
    """n greedy tokens after prompt_ids (end-of-text ignored), through minillm.runtime.generate."""
    return generate(model, tokenizer, list(prompt_ids), max_new_tokens=n, eos_token_ids=[]).token_ids


@torch.no_grad()
def forced_choices(model: nn.Module, prompt_ids: Sequence[int], continuation: Sequence[int]) -> list[int]:
    """The greedy choice at each position of `continuation`, fed it (teacher forcing): one forward."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(continuation)], device=device)  # (1, T)
    logits = model(ids)[0, len(prompt_ids) - 1: -1]  # (n, V): predictions of the continuation's tokens
    return logits.argmax(dim=-1).tolist()


def greedy_agreement(reference: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading tokens two greedy runs share; with forced_choices, a free run's agreement."""
    same = 0
    for a, b in zip(reference, tokens):
        if a != b:
            break
        same += 1
    return same
