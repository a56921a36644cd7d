"""transformers' 32 greedy tokens, reproduced by every decoding path of minillm.

One test, parametrized over the paths (the readable model, the KV-cached loop, the fast path,
the continuous-batching engine on the paged cache) and over the reference models (the four tiny
checkpoints and SmolLM2-135M-Instruct), with end-of-turn disabled: transformers' references
ignore it. The stored greedy tokens are decided by margins far above the float tolerance
(tests/test_reference_data.py checks that), so exact equality is a fair test on any CPU.

Not here: SmolLM2 with its GGUF blocks kept quantized (minillm.speed.quant.load_gguf_quantized). It
re-quantizes the embedding to int8 rows, so its logits are not transformers' float32 ones (its
greedy run leaves the reference within a few tokens); tests/speed/test_quant.py compares it with its
dequantize-then-matmul reference in the same run instead.
"""

from __future__ import annotations

import dataclasses

import pytest
from safetensors.torch import load_file

from support import DATA, TINY, greedy_by_teacher_forcing
from minillm.runtime.engine import Engine
from minillm.speed.fast import FastCausalLM
from minillm.runtime.generate import generate
from minillm.model.decoder import from_folder

N = 32


def readable(model, tokenizer, prompts, refs):
    """The model of notebook 05, no cache: each step's logits from the whole sequence (teacher forced)."""
    return [greedy_by_teacher_forcing(model, p, ref) for p, ref in zip(prompts, refs)]


def kv_cached(model, tokenizer, prompts, refs):
    """generate(): prefill, then one token per step through the KV cache of notebook 08."""
    return [generate(model, tokenizer, p.tolist(), max_new_tokens=N, eos_token_ids=()).token_ids for p in prompts]


def fast(model, tokenizer, prompts, refs):
    """The same loop on notebook 13's FastCausalLM."""
    return kv_cached(FastCausalLM(model), tokenizer, prompts, refs)


def paged_engine(model, tokenizer, prompts, refs):
    """All prompts at once through the engine of notebook 17: paged cache, batched prefill and decode."""
    out = Engine(model, tokenizer, num_blocks=64).generate([p.tolist() for p in prompts], max_new_tokens=N,
                                                           eos_token_ids=())
    return [r["token_ids"] for r in out]


@pytest.mark.parametrize("path", [readable, kv_cached, fast, paged_engine], ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", [*TINY, "smollm2"])
def test_32_greedy_tokens_equal_transformers(name, path, smollm2):
    smol, tokenizer = smollm2  # its tokenizer decodes any id < 320, so it serves the tiny models too
    ref = load_file(DATA / name / "reference.safetensors")
    model = smol if name == "smollm2" else from_folder(DATA / name)
    prompts = [ref[f"prompt_ids_{i}" if name == "smollm2" else f"input_ids_{i}"] for i in range(3)]
    refs = [ref[f"greedy_{i}"] for i in range(3)]
    assert [len(r) for r in refs] == [N] * 3
    got = path(model, tokenizer, prompts, refs)
    for i in range(3):
        assert got[i] == refs[i].tolist(), f"{name} prompt {i}"


def test_a_planted_bug_fails_every_path(smollm2):
    """The comparison can fail: a RoPE base ten times too small turns every path's tokens."""
    model = from_folder(DATA / "tiny-llama")
    model.config = dataclasses.replace(model.config, rope_theta=model.config.rope_theta / 10)
    model.reset_rope()
    ref = load_file(DATA / "tiny-llama" / "reference.safetensors")
    prompts, refs = [ref["input_ids_2"]], [ref["greedy_2"]]
    for path in (readable, kv_cached, fast, paged_engine):
        assert path(model, smollm2[1], prompts, refs)[0] != refs[0].tolist(), path.__name__
