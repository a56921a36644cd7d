"""The decode step validates at the boundary, not inside: no per-layer checks, no value read back.

A tensor on torch's "meta" device has a shape and a dtype but no data, so anything that reads a
value back to Python (`int(t)`, `t.item()`, `if t.any():`) raises on it. That is exactly what
stalls a GPU once per token (a host-device sync), so running a whole decode step on meta
tensors proves the step has none. The shape checks that would run once per layer are
planted to fail, to prove the layers do not call them.
"""

from __future__ import annotations

import pytest
import torch

from support import DATA
from minillm.model import attention, rope
from minillm.speed import cpu_kernel, quant
from minillm.speed.fast import FastCausalLM
from minillm.cache.dense import make_cache
from minillm.model.decoder import from_folder
from minillm.cache.paged import BlockManager, make_paged_cache, paged_forward
from minillm.runtime.sampling import SamplingParams, sample


def meta_ids(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.long, device="meta")


@pytest.fixture(params=["readable", "fast"])
def meta_model(request):
    model = from_folder(DATA / "tiny-qwen3")  # q/k norm: every per-layer piece runs
    return (model if request.param == "readable" else FastCausalLM(model)).to("meta")


def test_prefill_and_decode_read_nothing_back(meta_model):
    cache = make_cache(meta_model.config, 2, 16, device="meta")
    with torch.no_grad():
        meta_model(meta_ids(2, 5), cache=cache)  # prefill
        logits = meta_model(meta_ids(2, 1), cache=cache, start_pos=5)[:, -1]  # one decode step
        for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)):
            assert sample(logits, params).tokens.shape == (2,)  # on meta too: the one read is the caller's


def test_a_planted_read_back_is_caught(monkeypatch):
    """The meta test can fail: a value check that runs on every device reads the ids back."""
    model = from_folder(DATA / "tiny-qwen3").to("meta")
    monkeypatch.setattr("minillm.model.decoder.on_host", lambda t: True)
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(meta_ids(1, 3))


def test_paged_batch_with_padding_reads_nothing_back():
    model = from_folder(DATA / "tiny-qwen3").to("meta")
    manager = BlockManager(8, 4)
    manager.allocate("a", [1, 2, 3, 4, 5])
    manager.allocate("b", [6, 7])
    cache = make_paged_cache(model.config, 8, 4, device="meta")
    with torch.no_grad():  # rows of different lengths: an attention mask with padding
        assert paged_forward(model, cache, manager, ["a", "b"], meta_ids(2, 1)).shape == (2, 1, 320)


def test_layers_do_not_check_their_inputs(monkeypatch):
    """The model checks its inputs once per forward; the shape checks inside would run per layer."""
    def planted(*args, **kwargs):
        raise AssertionError("a per-layer check ran")

    model = from_folder(DATA / "tiny-qwen3")
    monkeypatch.setattr(attention, "_validate_shapes", planted)
    monkeypatch.setattr(rope, "_validate_rope_shapes", planted)
    cache = make_cache(model.config, 1, 8)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        model(torch.tensor([[4]]), cache=cache, start_pos=3)
    with pytest.raises(AssertionError, match="per-layer check"):  # the planted check is live for direct calls
        attention.scaled_dot_product_attention(*torch.randn(3, 1, 2, 3, 4))


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_layers_check_their_input_only_when_the_kernel_fails(monkeypatch, quantize):
    def planted(*args, **kwargs):
        raise AssertionError("a per-layer check ran")

    fast = FastCausalLM(from_folder(DATA / "tiny-qwen3"), quantize=quantize)
    monkeypatch.setattr(quant, "validate_quant_input", planted)  # notebook 12's layers (torch's kernels)
    monkeypatch.setattr(cpu_kernel, "validate_quant_input", planted)  # the fast path's own kernel, which reuses it
    with torch.no_grad():
        fast(torch.tensor([[1, 2, 3]]))
    with pytest.raises(AssertionError, match="per-layer check"):  # a wrong width still reaches the check
        fast.layers[0].qkv_proj(torch.randn(1, 7))
