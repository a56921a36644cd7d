"""The suite's one rule for comparing float32 logits, and the margins that make greedy tokens safe.

Two correct machines do not compute the same float32 logits. MKL, oneDNN and torch's own
kernels sum in a different order on an AVX-512 CPU than on an AVX2 one, so transformers itself,
run twice on the same checkpoint, differs from its stored output by up to 1.4e-5 on the tiny
fixtures (logits std about 4) and by 8e-5 on SmolLM2 (30 layers, std about 3.6). An absolute
1e-5 is below what two correct machines agree on; an absolute tolerance also means something
different for logits of another scale. So a logits comparison allows

    tolerance = rel x std(reference)

with `rel` one of the two levels of the design's verification ladder:

    TINY_REL    = 3e-5    the 4-layer fixtures in data/, and any of our own float32 paths compared
                          with another (cache, paged, batched, fast, compiled): 1.2e-4 to 1.3e-4
    SMOLLM2_REL = 2.5e-4  the 30-layer SmolLM2 against transformers on the same GGUF: about 9e-4

Why these numbers (measured on an AVX-512 CPU with its own kernels and with
ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2):
- from below, the machines: the largest difference between correct runs is 3.3e-6 x std on
  the tiny fixtures and 2.3e-5 x std on SmolLM2, 9x and 11x under the tolerance;
- from above, the bugs: the subtlest planted bug, RMSNorm's eps at 1e-5 instead of tiny-qwen3's
  1e-6, moves the logits by 1.5e-4 x std, 5x over the tolerance (test_model.py); RoPE or the
  causal mask off by one moves them by 1.8 x std or more.

Greedy tokens. If both of the two largest logits are within the tolerance of the reference, the
argmax cannot change while their gap (the top-2 margin) exceeds twice the tolerance. Tests that
compare greedy tokens with stored ones rely on that; test_reference_data.py checks the margin of
every stored greedy step, so a reference regenerated with a near-tie fails there, by name.

Quantized and bf16 paths are not bit-reproducible across CPUs: the packed int8/int4 kernels
return bf16, whose step near a logit of 20 is 0.125, and their greedy choices often tie exactly.
Never compare their exact text or tokens with a stored value or a fixed string: compare them
with their own reference path in the same run, or by KL and perplexity.
"""

from __future__ import annotations

import torch

TINY_REL = 3e-5
SMOLLM2_REL = 2.5e-4


def logits_tolerance(reference: torch.Tensor, rel: float = TINY_REL) -> float:
    """The absolute tolerance for logits compared with `reference`: rel x its standard deviation."""
    return rel * float(reference.detach().float().std())


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = TINY_REL, msg: str = "") -> None:
    """torch.testing.assert_close at the suite's tolerance (shapes, dtypes and NaNs checked too)."""
    atol = logits_tolerance(expected, rel)
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=0)
    except AssertionError as exc:
        raise AssertionError(f"{msg + ': ' if msg else ''}logits beyond the tolerance "
                             f"{rel:g} x std {atol / rel:.3f} = {atol:.2e}\n{exc}") from None


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Gap between the largest and the second largest logit, per row: (..., V) -> (...)."""
    top = logits.detach().float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]
