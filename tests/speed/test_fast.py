"""minillm.speed.fast against the stored transformers logits, the readable model and its own int4 reference.

The fast path must be the same model: the reference for it is transformers (stored logits and
greedy tokens in data/) and, where no stored reference covers a case (padding, chunked prefill,
the engine), the readable CausalLM it was built from. A planted bug shows the comparison bites.
"""

import pytest
import torch
from safetensors.torch import load_file

from support import DATA, TINY
import minillm
import minillm.speed.fast as fast_module
from minillm.weights.embedded import embedded_gguf_path
from minillm.runtime.engine import Engine
from minillm.speed.fast import FastCausalLM, fuse_linears
from minillm.runtime.generate import generate
from minillm.cache.dense import make_cache
from minillm.model.decoder import from_folder
from minillm.text.tokenizer import Tokenizer
from support import assert_logits_close


@pytest.fixture(scope="module", params=TINY)
def fixture(request):
    readable = from_folder(DATA / request.param)
    return request.param, readable, FastCausalLM(readable), load_file(DATA / request.param / "reference.safetensors")


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2


@torch.no_grad()
def test_logits_match_transformers(fixture):
    name, _, fast, ref = fixture
    for i in range(3):
        assert_logits_close(fast(ref[f"input_ids_{i}"][None])[0], ref[f"logits_{i}"])


@torch.no_grad()
def test_padding_and_chunked_prefill_equal_the_readable_model(fixture):
    name, readable, fast, ref = fixture
    ids = ref["input_ids_2"][None, :40].repeat(3, 1)  # (3, 40)
    pad = torch.ones(3, 40, dtype=torch.long)
    pad[0, :7], pad[2, :25] = 0, 0
    for b, start in enumerate([7, 0, 25]):
        assert_logits_close(fast(ids, attention_mask=pad)[b, start:], readable(ids, attention_mask=pad)[b, start:])
    c_fast, c_read = make_cache(fast.config, 1, 48), make_cache(readable.config, 1, 48)
    assert_logits_close(fast(ids[:1, :30], cache=c_fast), readable(ids[:1, :30], cache=c_read))
    assert_logits_close(fast(ids[:1, 30:], cache=c_fast, start_pos=30), readable(ids[:1, 30:], cache=c_read, start_pos=30))


def test_engine_with_the_fast_model_equals_one_at_a_time():
    tiny = from_folder(DATA / "tiny-qwen2-untied")
    fast = FastCausalLM(tiny)
    tok = Tokenizer.from_gguf(embedded_gguf_path())  # decodes any id < 320
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (int(k),), generator=g).tolist() for k in torch.randint(1, 60, (12,), generator=g)]
    limits = [int(k) for k in torch.randint(1, 30, (12,), generator=g)]
    alone = [generate(tiny, tok, p, max_new_tokens=m, eos_token_ids=()).token_ids for p, m in zip(prompts, limits)]
    for num_blocks in (512, 16):  # roomy, and small enough to force preemption
        out = Engine(fast, tok, num_blocks=num_blocks).generate(prompts, max_new_tokens=limits, eos_token_ids=())
        assert [r["token_ids"] for r in out] == alone, num_blocks


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@torch.no_grad()
def test_quantized_fast_path_equals_its_dequantize_then_matmul_reference(smol, quantize):
    model, tok = smol
    packed = FastCausalLM(model, quantize=quantize, kernel="packed")
    reference = FastCausalLM(model, quantize=quantize, kernel="reference")
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. It was a sunny day and")])
    got, want = packed(ids), reference(ids)
    # The packed kernels take and return bf16 (8 bits of mantissa) in each of 30 layers and the
    # head, whose logits reach ~20 where a bf16 step is 0.125: measured mean |diff| 0.06 (int4)
    # and 0.09 (int8), max 0.6. A wrong scale or group layout gives differences of several units.
    diff = (got - want).abs()
    assert diff.mean() < 0.2 and diff.max() < 1.5, (float(diff.mean()), float(diff.max()))
    assert (got[0].argmax(-1) == want[0].argmax(-1)).float().mean() >= 0.9
    fp32 = model(ids)  # and both stay near the fp32 model: quantized, not broken
    assert (got[0].argmax(-1) == fp32[0].argmax(-1)).float().mean() > 0.6


def test_quantized_fast_path_keeps_a_tied_head_in_int8(smol):
    from minillm.speed.cpu_kernel import Int4DotLinear, Int8DotLinear
    from minillm.speed.quant import Int4Linear, Int8Embedding, Int8Linear

    for kernel, head, linear in (("auto", Int8DotLinear, Int4DotLinear), ("packed", Int8Linear, Int4Linear)):
        fast = FastCausalLM(smol[0], quantize="int4", kernel=kernel)
        assert isinstance(fast.lm_head, head) and isinstance(fast.embed_tokens, Int8Embedding)
        assert fast.lm_head.qweight is fast.embed_tokens.qweight  # one int8 table for lookup and head
        assert isinstance(fast.layers[0].qkv_proj, linear) and fast.layers[0].qkv_proj.out_features == (9 + 2 * 3) * 64


def test_fuse_linears_stacks_outputs():
    a, b = torch.nn.Linear(8, 3), torch.nn.Linear(8, 5)
    x = torch.randn(2, 8)
    torch.testing.assert_close(fuse_linears(a, b)(x), torch.cat([a(x), b(x)], dim=-1))
    with pytest.raises(ValueError, match="in_features"):
        fuse_linears(a, torch.nn.Linear(4, 3))


def test_bad_input_is_named():
    tiny = from_folder(DATA / "tiny-llama")
    with pytest.raises(ValueError, match="quantize must be one of"):
        FastCausalLM(tiny, quantize="int3")
    with pytest.raises(TypeError, match="CausalLM"):
        FastCausalLM(torch.nn.Linear(2, 2))
    fast = FastCausalLM(tiny)
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 320\)"):
        fast(torch.tensor([[1, 320]]))
    with pytest.raises(ValueError, match=r"input_ids must be \(B, T\)"):
        fast(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="needs a cache"):
        fast(torch.tensor([[1, 2]]), start_pos=3)


@torch.no_grad()
def test_planted_bug_fused_in_the_wrong_order_is_caught(monkeypatch):
    tiny = from_folder(DATA / "tiny-qwen3")
    ref = load_file(DATA / "tiny-qwen3" / "reference.safetensors")
    original = fast_module.fuse_linears
    monkeypatch.setattr(fast_module, "fuse_linears", lambda *ls: original(*((ls[1], ls[0], *ls[2:]) if len(ls) == 3 else ls)))
    wrong = FastCausalLM(tiny)  # q and k swapped in the fused qkv
    with pytest.raises(AssertionError):
        assert_logits_close(wrong(ref["input_ids_1"][None])[0], ref["logits_1"])


@torch.no_grad()
def test_compiled_fast_path_equals_eager():
    tiny = from_folder(DATA / "tiny-llama")
    eager, compiled = FastCausalLM(tiny), FastCausalLM(tiny).compile()
    ref = load_file(DATA / "tiny-llama" / "reference.safetensors")
    ids = ref["input_ids_1"][None]  # (1, 9)
    c_eager, c_compiled = make_cache(tiny.config, 1, 16), make_cache(tiny.config, 1, 16)
    assert_logits_close(compiled(ids, cache=c_compiled), eager(ids, cache=c_eager))
    for pos in range(9, 12):  # decode steps: a new length each time, one graph thanks to dynamic shapes
        token = torch.tensor([[pos + 3]])
        assert_logits_close(compiled(token, cache=c_compiled, start_pos=pos), eager(token, cache=c_eager, start_pos=pos))


def test_cli_fast_flag_and_its_errors(capsys):
    from minillm.__main__ import main

    question = "What is the capital of France?"
    args = ["generate", question, "--temperature", "0", "--max-new-tokens", "8"]
    assert main(args + ["--fast"]) == 0
    assert "Paris" in capsys.readouterr().out  # float32: safe on any CPU (test_generate.py checks the margins)
    assert main(args + ["--fast", "--quantize", "int8"]) == 0
    # int8: bf16 logits, whose first-token top two are 0.125 apart here; the same answer as in-process
    llm = minillm.load(fast=True, quantize="int8")
    assert capsys.readouterr().out == llm.chat([{"role": "user", "content": question}], max_new_tokens=8).text + "\n"
    assert main(args + ["--compile"]) == 2
    assert "compile=True compiles the fast path: pass fast=True too" in capsys.readouterr().err
    assert main(args + ["--fast", "--quantize", "gguf"]) == 2
    assert "use quantize='int4'" in capsys.readouterr().err


def test_load_fast_quantized_returns_the_fast_model():
    from minillm.speed.cpu_kernel import Int4DotLinear

    llm = minillm.load(fast=True, quantize="int4")
    assert isinstance(llm.model, FastCausalLM) and isinstance(llm.model.layers[0].mlp.gate_up_proj, Int4DotLinear)
    reply = llm.chat([{"role": "user", "content": "Name a color."}], max_new_tokens=4)
    assert len(reply.token_ids) >= 1 and reply.metrics.generated_tokens == len(reply.token_ids)
