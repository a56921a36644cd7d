"""minillm.speed.quant (notebook 12): int8/int4 weight-only quantization, GGUF blocks, the quantized model.

References: the formulas themselves (error within half a step), F.linear on the dequantized
weight, the `gguf` package's dequantizer (bit-exact), the float32 model's logits, and the CLI.
Planted bugs (a wrong int4 zero convention, GGUF's nibble order mistaken for ours) show the
comparisons catch real mistakes.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support import DATA, ROOT
from minillm.api import load
from minillm.weights.embedded import embedded_gguf_path
from minillm.runtime.evaluate import forced_choices, greedy_agreement, kl_divergence, perplexity
from minillm.model.decoder import from_folder
from minillm.speed.quant import (
    GGUF_DEQUANTIZE,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    dequantize_q4_0,
    dequantize_q4_1,
    dequantize_q8_0,
    gguf_linear,
    load_gguf_quantized,
    model_bytes,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_model,
    unpack_int4,
)
from support import assert_logits_close, top2_margin


def weight(N=96, K=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[3, 7] = 1.5  # an outlier
    return w


# ---------------------------------------------------------------- int8 and int4 formulas


def test_int8_is_absmax_per_channel_within_half_a_step():
    w = weight()
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (96,) and s.dtype == torch.float32
    torch.testing.assert_close(s, w.abs().amax(1) / 127)
    assert (q.abs().amax(1) == 127).all()
    assert ((dequantize_int8(q, s) - w).abs() <= s[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_is_min_max_per_group_in_torch_convention(group_size):
    w = weight()
    q, s, z = quantize_int4(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and s.shape == z.shape == (96, 128 // group_size)
    wg = w.reshape(96, -1, group_size)
    torch.testing.assert_close(s, (wg.amax(-1) - wg.amin(-1)) / 15)
    torch.testing.assert_close(z, wg.amin(-1) + 8 * s)  # (q - 8) * s + z: q = 0 is the minimum
    w_hat = dequantize_int4(q, s, z)
    assert ((w_hat - w).abs() <= s.repeat_interleave(group_size, 1) / 2 + 1e-6).all()


def test_int4_group_size_errors_name_layer_and_sizes():
    with pytest.raises(ValueError, match=r"blk\.7.*K=576.*group_size 128.*remainder 64.*32, 64"):
        quantize_int4(torch.randn(16, 576), 128, name="blk.7")
    with pytest.raises(ValueError, match="group_size must be one of 32, 64, 128, 256"):
        quantize_int4(torch.randn(16, 96), 48)


@pytest.mark.parametrize("bad", [torch.randn(8), torch.ones(4, 32, dtype=torch.int32), torch.randn(2, 4, 32)])
def test_quantizers_reject_non_matrices(bad):
    with pytest.raises(ValueError, match="2-D floating weight"):
        quantize_int8(bad)
    with pytest.raises(ValueError, match="2-D floating weight"):
        quantize_int4(bad, 32)


def test_pack_int4_round_trip_and_layout():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 32)
    assert torch.equal(packed[:, 0], q[:, 0] + 16 * q[:, 1])
    assert torch.equal(unpack_int4(packed), q)
    with pytest.raises(ValueError, match="even last dim"):
        pack_int4(q[:, :63])


# ---------------------------------------------------------------- linear layers


@pytest.mark.parametrize("cls,kwargs", [(Int8Linear, {}), (Int4Linear, {"group_size": 32}), (Int4Linear, {"group_size": 64})])
def test_linears_match_f_linear_on_the_dequantized_weight(cls, kwargs):
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True)
    x = torch.randn(2, 3, 128)
    ref = cls.from_linear(linear, kernel="reference", **kwargs)
    w_hat = dequantize_int8(ref.qweight, ref.scales) if cls is Int8Linear else ref.dequantize()
    torch.testing.assert_close(ref(x), F.linear(x, w_hat, linear.bias), atol=1e-5, rtol=1e-5)
    packed = cls.from_linear(linear, kernel="packed", **kwargs)
    assert packed.kernel == "packed" and cls.from_linear(linear, **kwargs).kernel == "packed"  # auto on cpu
    expected = F.linear(x.bfloat16().float(), w_hat, linear.bias)  # the kernel sees bf16 activations
    out = packed(x)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 96)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    assert packed(x.bfloat16()).dtype == torch.bfloat16


def test_planted_bug_wrong_int4_zero_convention_is_caught():
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=False)
    layer = Int4Linear.from_linear(linear, 32, kernel="packed")
    x = torch.randn(4, 128)
    q, s, z = quantize_int4(linear.weight, 32)
    right = F.linear(x.bfloat16().float(), dequantize_int4(q, s, z))
    wrong = F.linear(x.bfloat16().float(), (q.float() * s.repeat_interleave(32, 1) + z.repeat_interleave(32, 1)))  # forgot "- 8"
    torch.testing.assert_close(layer(x), right, atol=2e-2, rtol=2e-2)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(layer(x), wrong, atol=2e-2, rtol=2e-2)


def test_unsupported_kernel_device_and_shapes_list_what_is_supported():
    linear = nn.Linear(64, 100)
    with pytest.raises(ValueError, match="no packed int4 kernel for cpu with N=100; supported: packed: int8 and int4 on cpu"):
        Int4Linear.from_linear(linear, 32, kernel="packed")
    assert Int4Linear.from_linear(linear, 32).kernel == "reference"  # auto falls back
    with pytest.raises(ValueError, match="no packed int8 kernel for meta.*reference: int8 and int4 on any device"):
        Int8Linear.from_linear(copy.deepcopy(linear).to("meta"), kernel="packed")
    with pytest.raises(ValueError, match="kernel must be one of auto, packed, reference"):
        Int8Linear.from_linear(linear, kernel="fast")
    with pytest.raises(ValueError, match="group_size is for int4"):
        Int8Linear.from_linear(linear, group_size=32)
    with pytest.raises(ValueError, match="input has 32 features, expected K=64"):
        Int8Linear.from_linear(linear)(torch.randn(2, 32))


@pytest.mark.parametrize("kernel", ["reference", "packed"])
@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_a_wrong_input_width_is_named_by_every_kernel(cls, kernel):
    layer = cls.from_linear(nn.Linear(64, 32), kernel=kernel)
    for x in (torch.randn(2, 32), torch.randn(3, 5, 96), torch.randn(1, 128)):  # 128: as many numbers as 2 x 64
        with pytest.raises(ValueError, match=rf"input has {x.shape[-1]} features, expected K=64"):
            layer(x)


# ---------------------------------------------------------------- GGUF blocks


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_bit_exact_against_gguf(qtype):
    values = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32) * 3
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
    ours = GGUF_DEQUANTIZE[qtype](torch.from_numpy(raw), (8, 96))
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)
    assert torch.equal(GGUF_DEQUANTIZE[qtype](torch.from_numpy(raw).flatten(), (8, 96)), theirs)  # flat bytes too


def test_gguf_blocks_bit_exact_on_the_embedded_file():
    reader = gguf.GGUFReader(embedded_gguf_path())
    wanted = {"token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"}
    seen = set()
    for t in reader.tensors:
        if t.name in wanted:
            rows = t.data[:2048]  # (rows, bytes per row): the first rows are enough (token_embd has 49152)
            shape = (rows.shape[0], int(t.shape[0]))
            ours = GGUF_DEQUANTIZE[t.tensor_type.name](torch.from_numpy(rows.copy()), shape)
            theirs = torch.from_numpy(gguf.quants.dequantize(rows, t.tensor_type).copy()).reshape(shape)
            assert torch.equal(ours, theirs), t.name
            seen.add(t.tensor_type.name)
    assert seen == {"Q8_0", "Q4_1"}


def test_planted_bug_gguf_nibble_order_is_caught():
    values = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1))
    b = torch.from_numpy(raw).reshape(-1, 20)
    d, m = (b[:, :2].contiguous().view(torch.float16).float(), b[:, 2:4].contiguous().view(torch.float16).float())
    wrong = (d * unpack_int4(b[:, 4:]).float() + m).reshape(4, 64)  # our pairing (j, j+1) instead of (j, j+16)
    assert not torch.equal(wrong, theirs)
    assert torch.equal(dequantize_q4_1(torch.from_numpy(raw), (4, 64)), theirs)


def test_malformed_gguf_raw_data():
    raw = torch.zeros(34 * 4, dtype=torch.uint8)
    assert dequantize_q8_0(raw, (2, 64)).shape == (2, 64)
    with pytest.raises(ValueError, match=r"Q8_0: shape \(2, 64\) is 4 blocks of 34 bytes = 136 bytes, raw has 135"):
        dequantize_q8_0(raw[:-1], (2, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize_q4_0(torch.zeros(18, dtype=torch.uint8), (1, 16))
    with pytest.raises(ValueError, match="positive multiple of 32"):
        dequantize_q4_1(torch.zeros(0, dtype=torch.uint8), (0, 32))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_q4_1(torch.zeros(20, dtype=torch.int8), (1, 32))


def test_q4_blocks_become_int4_linear_with_the_same_values():
    values = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)
    for qtype in ("Q4_0", "Q4_1"):
        raw = torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype]))
        exact = GGUF_DEQUANTIZE[qtype](raw, (32, 64))
        layer = gguf_linear(raw, (32, 64), qtype, kernel="reference")
        assert isinstance(layer, Int4Linear) and layer.group_size == 32
        err = (layer.dequantize() - exact).abs().max() / exact.abs().max()
        assert err < 2**-8  # only the bf16 rounding of d and m + 8d
        packed = gguf_linear(raw, (32, 64), qtype)
        x = torch.randn(3, 64)
        torch.testing.assert_close(packed(x), F.linear(x.bfloat16().float(), exact), atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="supported: Q8_0, Q4_0, Q4_1"):
        gguf_linear(raw, (32, 64), "Q5_K")


# ---------------------------------------------------------------- whole models


@pytest.fixture(scope="module")
def tiny():
    return from_folder(DATA / "tiny-llama")  # tied embeddings, like SmolLM2


def dequantized_copy(model: nn.Module, mode: str, group_size: int = 32) -> nn.Module:
    """The reference for quantize_model: float layers holding the dequantized weights."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for _name, module in ref.named_modules():
            if isinstance(module, nn.Linear):
                if mode == "int8":
                    module.weight.copy_(dequantize_int8(*quantize_int8(module.weight)))
                else:
                    q, s, z = quantize_int4(module.weight, group_size)  # the layer keeps s and z in bf16
                    module.weight.copy_(dequantize_int4(q, s.bfloat16(), z.bfloat16()))
        emb = ref.model.embed_tokens.weight
        emb.copy_(dequantize_int8(*quantize_int8(emb)))  # tied: the head reads the same int8 table
    return ref


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_model_matches_the_dequantized_float_model(tiny, mode):
    ids = torch.tensor([[5, 9, 17, 33, 65, 129, 250, 3]])
    q = quantize_model(copy.deepcopy(tiny), mode, 32, kernel="reference")
    assert isinstance(q.model.layers[2].mlp.down_proj, Int8Linear if mode == "int8" else Int4Linear)
    assert isinstance(q.model.embed_tokens, Int8Embedding) and isinstance(q.lm_head, Int8Linear)
    assert q.lm_head.qweight is q.model.embed_tokens.qweight  # still tied: one int8 table
    with torch.no_grad():
        reference = q(ids)
        assert_logits_close(reference, dequantized_copy(tiny, mode)(ids))
        packed = quantize_model(copy.deepcopy(tiny), mode, 32)(ids)  # bf16 activations in the kernels
        float_logits = tiny(ids)
    assert kl_divergence(reference[0], packed[0]) < 0.01
    assert kl_divergence(float_logits[0], packed[0]) < (0.05 if mode == "int8" else 1.0)  # int4: random weights suffer
    assert model_bytes(q) < model_bytes(tiny) / (3 if mode == "int8" else 4)


def test_quantize_model_untied_head_and_bias():
    model = from_folder(DATA / "tiny-qwen2-untied")
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        ref = model(ids)
        q = quantize_model(model, "int8")
        assert isinstance(q.lm_head, Int8Linear) and q.model.layers[0].self_attn.q_proj.bias is not None
        assert kl_divergence(ref[0], q(ids)[0]) < 0.02


def test_quantize_model_bad_mode_and_group_size_leave_the_model_intact(tiny):
    model = copy.deepcopy(tiny)
    with pytest.raises(ValueError, match="mode must be one of int8, int4, got 'int3'"):
        quantize_model(model, "int3")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: input features K=160 is not a multiple of group_size 64"):
        quantize_model(model, "int4", 64)
    assert all(type(m) is not Int4Linear for m in model.modules())  # nothing was replaced
    quantize_model(model, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "int8")


def test_perplexity_kl_and_agreement_helpers(tiny):
    ids = list(range(3, 40))
    with torch.no_grad():
        logits = tiny(torch.tensor([ids[:16]]))[0]
    manual = math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:16])).item())
    assert perplexity(tiny, ids[:16], window=16) == pytest.approx(manual, rel=1e-5)
    assert perplexity(tiny, ids, window=16) > 1
    assert kl_divergence(logits, logits) == pytest.approx(0, abs=1e-6)
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    continuation = logits.argmax(-1)[-1:].tolist()
    assert forced_choices(tiny, ids[:16], continuation) == continuation  # its own greedy choice
    with pytest.raises(ValueError, match="window >= 2"):
        perplexity(tiny, ids, window=1)


def test_gguf_kept_quantized_matches_transformers_on_the_dequantized_file():
    from safetensors.torch import load_file

    kept = load_gguf_quantized(embedded_gguf_path())
    assert isinstance(kept.model.layers[0].self_attn.q_proj, Int4Linear)
    assert model_bytes(kept) < 110e6
    ref = load_file(DATA / "smollm2" / "reference.safetensors")  # transformers, the GGUF dequantized to fp32
    with torch.no_grad():
        last = [kept(ref[f"prompt_ids_{i}"][None])[0, -1] for i in range(3)]  # 3 x (V,)
    for i in range(3):
        assert kl_divergence(ref[f"last_logits_{i}"], last[i]) < 0.02, i
    # The next token, where it is decided by a wide margin: prompt 1's top two differ by more than
    # 1 in float32 and by 1.5 in the bf16 kernels' logits (prompt 0's tie in bf16, step 0.125).
    assert float(top2_margin(ref["last_logits_1"])) > 1.0
    assert int(last[1].argmax()) == int(ref["greedy_1"][0])


# ---------------------------------------------------------------- load() and the CLI


def test_load_rejects_bad_quantize_and_group_size_before_loading():
    with pytest.raises(ValueError, match="unknown quantize 'int3'; choose one of: int8, int4, gguf"):
        load(quantize="int3")
    with pytest.raises(ValueError, match="group_size must be one of 32, 64, 128, 256, got 48"):
        load(quantize="int4", group_size=48)
    with pytest.raises(ValueError, match="applies to quantize='int4' only"):
        load(quantize="int8", group_size=64)
    with pytest.raises(ValueError, match="keeps a .gguf file's blocks"):
        load(str(DATA / "tiny-llama"), quantize="gguf")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minillm", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_generate_with_int4_weights():
    """The CLI's int4 answer equals the in-process int4 model's, in the same run. Not a fixed
    text: the packed int4 kernels return bf16 logits, and on this prompt the first token's top two
    tie on some CPUs ("The capital..." on one, "L'Étoile..." on another)."""
    question = "What is the capital of France?"
    result = run_cli("generate", question, "--quantize", "int4", "--group-size", "32",
                     "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    llm = load(quantize="int4", group_size=32, device="cpu")
    assert all(layer.group_size == 32 for layer in llm.model.modules() if isinstance(layer, Int4Linear))
    want = llm.chat([{"role": "user", "content": question}], max_new_tokens=8)
    assert len(want.token_ids) == 8 and result.stdout == want.text + "\n"


@pytest.mark.parametrize("args,message", [
    (["--quantize", "int3"], "invalid choice: 'int3' (choose from 'int8', 'int4', 'gguf')"),
    (["--quantize", "int4", "--group-size", "48"], "group_size must be one of 32, 64, 128, 256, got 48"),
    (["--group-size", "64"], "--group-size applies to --quantize int4"),
])
def test_cli_bad_quantize_flags(args, message):
    result = run_cli("generate", "hi", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
