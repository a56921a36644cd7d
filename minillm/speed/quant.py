# Generated from notebooks/12_quantization.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Weight-only quantization: int8 per channel, int4 per group, and GGUF's Q8_0 / Q4_0 / Q4_1 blocks.

Built in notebooks/12_quantization.ipynb. Weights are stored in 8 or 4 bits with a float scale
(and, for int4, a zero) per output channel or per group of inputs; activations stay in floating
point. A quantized linear has a `reference` path (dequantize, then `F.linear`) and a `packed` path
(torch's weight-only int8/int4 CPU kernels, fast on bf16 activations).

Shapes: N output features, K input features, g group size, M rows of activations (B*T), V vocab,
h hidden.

References: LLM.int8() (arXiv:2208.07339; its outliers are activations'); GPTQ (arXiv:2210.17323)
and gpt-fast's quantize.py for int4 on torch's kernels; ggml-quants.c and gguf-py's quants.py for
the block layouts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minillm.weights.gguf_types import gguf_float
from minillm.weights.loading import validate_names_and_shapes, open_gguf, hf_rows

MODES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)
KERNELS = ("auto", "packed", "reference")
SUPPORTED = "packed: int8 and int4 on cpu (int4 needs N % 16 == 0); reference: int8 and int4 on any device"


def _validate_weight(w: torch.Tensor, name: str) -> None:
    if not isinstance(w, torch.Tensor) or w.ndim != 2 or not w.is_floating_point():
        got = f"shape {tuple(w.shape)} {w.dtype}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{name}: expected a 2-D floating weight (N, K), got {got}")


def validate_group_size(K: int, group_size: int, name: str = "weight") -> None:
    """ValueError unless group_size is one of GROUP_SIZES and divides K (names the layer and sizes)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size!r}")
    if K % group_size:
        fits = [g for g in GROUP_SIZES if K % g == 0]
        raise ValueError(f"{name}: input features K={K} is not a multiple of group_size {group_size} "
                         f"(remainder {K % group_size}); group sizes that divide {K}: "
                         f"{', '.join(map(str, fits)) or 'none'}")


def _pick_kernel(kernel: str, mode: str, device: torch.device, n_out: int) -> str:
    """'packed' where torch has the kernel for this device and shape, else 'reference' (for 'auto')."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    packed_ok = device.type == "cpu" and (mode == "int8" or n_out % 16 == 0)
    if kernel == "packed" and not packed_ok:
        raise ValueError(f"no packed {mode} kernel for {device.type} with N={n_out}; supported: {SUPPORTED}")
    return kernel if kernel != "auto" else ("packed" if packed_ok else "reference")


def validate_quant_input(x: torch.Tensor, K: int, kernel: str, mode: str) -> None:
    if x.shape[-1] != K:
        raise ValueError(f"{mode} linear: input has {x.shape[-1]} features, expected K={K}")
    if kernel == "packed" and x.device.type != "cpu":
        raise ValueError(f"the packed {mode} kernel got an input on {x.device.type}; supported: {SUPPORTED}")


def _validate_int4_buffers(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
    (N, K), G = qweight.shape, scales.shape[1]
    if qweight.dtype != torch.uint8 or K % G or tuple(scales.shape) != (N, G) or tuple(zeros.shape) != (N, G):
        raise ValueError(f"Int4Linear: expected q (N, K) uint8 with scales and zeros (N, K/g), got "
                         f"{tuple(qweight.shape)} {qweight.dtype}, {tuple(scales.shape)}, {tuple(zeros.shape)}")


def _validate_quantizable(model: nn.Module, mode: str, group_size: int, kernel: str, quantize_mlp=None) -> None:
    """quantize_model's checks, all before any layer is replaced: a refused model is left as it was."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    other = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "gate_proj")]
    if other and quantize_mlp is None:
        i, mlp = other[0]
        raise ValueError(f"model.layers.{i}.mlp is {type(mlp).__name__}, not notebook 04's MLP: pass quantize_mlp "
                         "(for a mixture of experts, notebook 23's quantize_moe_model does)")
    for name, parent, attr in _linears(model):
        if not isinstance(getattr(parent, attr), nn.Linear):
            raise ValueError(f"{name} is {type(getattr(parent, attr)).__name__}, not nn.Linear: already quantized?")
        if mode == "int4":
            validate_group_size(getattr(parent, attr).in_features, group_size, name)
    if mode == "int4" and model.lm_head is not None:
        validate_group_size(model.lm_head.in_features, group_size, "lm_head")


def quantize_int8(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax per output channel: w ≈ q * scale, q int8 in [-127, 127].

    Returns q (N, K) int8 and scales (N,) float32."""
    _validate_weight(w, name)
    w = w.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,): each row's largest |w| maps to 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q * scale as float32 (N, K): the reference the kernels are checked against."""
    return qweight.float() * scales.float()[:, None]


def quantize_int4(w: torch.Tensor, group_size: int = 32, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max per group of `group_size` inputs: w ≈ (q - 8) * scale + zero, q in 0..15.

    Returns q (N, K) uint8, scales (N, K/g) and zeros (N, K/g) float32 (torch's int4 convention)."""
    _validate_weight(w, name)
    N, K = w.shape
    validate_group_size(K, group_size, name)
    wg = w.detach().float().reshape(N, K // group_size, group_size)  # (N, K) -> (N, K/g, g)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # (N, K/g)
    scales = ((hi - lo) / 15).clamp(min=1e-8)  # 16 levels from lo to hi
    q = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, 15)  # lo -> 0, hi -> 15
    zeros = lo + 8 * scales  # (q - 8) * scale + zero = q * scale + lo
    return q.to(torch.uint8).reshape(N, K), scales, zeros


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """(q - 8) * scale + zero as float32 (N, K); the group size is K / scales.shape[1]."""
    N, K = qweight.shape
    G = scales.shape[1]  # groups per row
    if K % G or tuple(scales.shape) != (N, G) or tuple(zeros.shape) != (N, G):
        raise ValueError(f"qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)} and zeros "
                         f"{tuple(zeros.shape)} do not describe (N, K) weights in (N, K/g) groups")
    q = qweight.float().reshape(N, G, K // G)  # (N, K) -> (N, K/g, g)
    return ((q - 8) * scales.float()[..., None] + zeros.float()[..., None]).reshape(N, K)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values per byte: (..., K) uint8 in 0..15 -> (..., K/2), even columns in the low nibble."""
    if q.dtype != torch.uint8 or q.shape[-1] % 2:
        raise ValueError(f"pack_int4: expected uint8 values with an even last dim, got {q.dtype} {tuple(q.shape)}")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: (..., K/2) uint8 -> (..., K) uint8 in 0..15."""
    both = torch.stack([packed & 0x0F, packed >> 4], dim=-1)  # (..., K/2, 2): low nibble first
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)  # (..., K/2, 2) -> (..., K)


def bias_parameter(bias: torch.Tensor | None) -> nn.Parameter | None:
    return None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias: q (N, K) int8, one float32 scale per output channel."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel: str = "auto"):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.kernel = _pick_kernel(kernel, "int8", qweight.device, self.out_features)
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scales", scales)  # (N,) float32
        self.bias = bias_parameter(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int | None = None, name: str = "linear",
                    kernel: str = "auto") -> Int8Linear:
        if group_size is not None:
            raise ValueError(f"{name}: int8 has one scale per output channel; group_size is for int4")
        return cls(*quantize_int8(linear.weight, name), linear.bias, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        try:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            if self.kernel == "reference":
                return F.linear(x, dequantize_int8(self.qweight, self.scales).to(x.dtype), bias)
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # (M, K); bf16: the kernel's fast path
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales.to(torch.bfloat16))  # (M, N)
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias
        except RuntimeError:  # the input is checked only when the kernel fails: no cost per call
            validate_quant_input(x, self.in_features, self.kernel, "int8")  # a wrong input: say what is wrong
            raise

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def _int4_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Linear's buffers: scales_and_zeros (K/g, N, 2) bf16, and q (N, K) packed to (N, K/2) uint8."""
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1)  # (N, K/g, 2) -> (K/g, N, 2)
    if kernel == "packed":  # (N, K) int32 -> (N, K/2) uint8, tiled for the kernel
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qweight.to(torch.int32), 2)
    else:
        packed = pack_int4(qweight)  # (N, K) -> (N, K/2)
    return sz.to(torch.bfloat16).contiguous(), packed


class Int4Linear(nn.Module):
    """y = x @ ((q - 8) * scale + zero).T + bias, q 4-bit, a bf16 scale and zero per group of inputs.

    qweight: (N, K/2) uint8, in torch's tiled layout for the packed kernel, pack_int4's for reference."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, kernel: str = "auto"):
        super().__init__()
        _validate_int4_buffers(qweight, scales, zeros)
        (N, K), G = qweight.shape, scales.shape[1]
        self.out_features, self.in_features, self.group_size = N, K, K // G
        self.kernel = _pick_kernel(kernel, "int4", qweight.device, N)
        sz, packed = _int4_layout(qweight, scales, zeros, self.kernel)
        self.register_buffer("scales_and_zeros", sz)  # (K/g, N, 2) bf16: the kernel's layout
        self.register_buffer("qweight", packed)  # (N, K/2) uint8
        self.bias = bias_parameter(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32, name: str = "linear",
                    kernel: str = "auto") -> Int4Linear:
        return cls(*quantize_int4(linear.weight, group_size, name), linear.bias, kernel)

    def dequantize(self) -> torch.Tensor:
        """The float32 (N, K) weight the reference path multiplies by."""
        if self.kernel != "reference":
            raise ValueError("dequantize() reads the reference layout; build with kernel='reference'")
        sz = self.scales_and_zeros.float().transpose(0, 1)  # (K/g, N, 2) -> (N, K/g, 2)
        return dequantize_int4(unpack_int4(self.qweight), sz[..., 0], sz[..., 1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        try:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            if self.kernel == "reference":
                return F.linear(x, self.dequantize().to(x.dtype), bias)
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # (M, K); fp32 input is many times slower
            sz = self.scales_and_zeros.to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, sz)  # (M, N)
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias
        except RuntimeError:  # checked only on failure, as Int8Linear
            validate_quant_input(x, self.in_features, self.kernel, "int4")
            raise

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, kernel={self.kernel}")


class Int8Embedding(nn.Module):
    """An embedding table as int8 rows, one scale per row (its dtype is the output's)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("qweight", qweight)  # (V, h) int8
        self.register_buffer("scales", scales)  # (V,)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, h)
        return self.qweight[ids].to(self.scales.dtype) * self.scales[ids][..., None]


LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _linears(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(full name, parent module, attribute) of every decoder-layer linear; an MLP without gate_proj
    (notebook 23's experts) is not listed: quantize_model's quantize_mlp takes it whole."""
    out = []
    for i, layer in enumerate(model.model.layers):
        for path in LINEAR_NAMES:
            parent, attr = path.split(".")
            if parent != "mlp" or hasattr(layer.mlp, "gate_proj"):
                out.append((f"model.layers.{i}.{path}", getattr(layer, parent), attr))
    return out


def int8_table(weight: torch.Tensor, kernel: str = "auto") -> tuple[Int8Embedding, Int8Linear]:
    """One int8 copy of an embedding table (V, h), per-row scales, as a lookup and as a tied head."""
    q, s = quantize_int8(weight, "model.embed_tokens.weight")
    return Int8Embedding(q, s.to(weight.dtype)), Int8Linear(q, s, kernel=kernel)


def _quantize_embedding(model: nn.Module, weight: torch.Tensor, kernel: str) -> None:
    """int8 rows for the lookup; a tied head (lm_head None) becomes an Int8Linear on that same table."""
    model.model.embed_tokens, head = int8_table(weight, kernel)
    if model.lm_head is None:  # tied: the head shares the lookup's int8 rows
        model.lm_head = head


def quantize_linear(linear: nn.Linear, mode: str | None, group_size: int = 32, name: str = "linear",
                    kernel: str = "auto") -> nn.Module:
    """The one factory of quantized layers: the layer itself (mode None), Int8Linear or Int4Linear."""
    if mode is None:
        return linear
    if mode == "int8":
        return Int8Linear.from_linear(linear, name=name, kernel=kernel)
    return Int4Linear.from_linear(linear, group_size, name, kernel)


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, group_size: int = 32, kernel: str = "auto",
                   quantize_mlp=None) -> nn.Module:
    """Replace a CausalLM's linears and head by Int8Linear or Int4Linear, in place; the embedding
    becomes int8 rows, shared by a tied head. Every layer is checked before any is replaced.

    quantize_mlp(mlp, mode, group_size, name, kernel) -> module: for an MLP of another kind (no gate_proj)."""
    _validate_quantizable(model, mode, group_size, kernel, quantize_mlp)
    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer.mlp, "gate_proj"):  # checked above: quantize_mlp was given
            layer.mlp = quantize_mlp(layer.mlp, mode, group_size, f"model.layers.{i}.mlp", kernel)
    for name, parent, attr in _linears(model):
        setattr(parent, attr, quantize_linear(getattr(parent, attr), mode, group_size, name, kernel))
    if model.lm_head is not None:
        model.lm_head = quantize_linear(model.lm_head, mode, group_size, "lm_head", kernel)
    _quantize_embedding(model, model.model.embed_tokens.weight, kernel)
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers, each storage counted once (shared tables once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20)}  # type: (values, bytes) per block


def _blocks(raw: torch.Tensor, shape: Sequence[int], qtype: str) -> torch.Tensor:
    """raw bytes -> (n_blocks, bytes per block), after checking the length against the shape."""
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise TypeError(f"{qtype}: raw must be a uint8 tensor, got {getattr(raw, 'dtype', type(raw).__name__)}")
    shape = tuple(int(n) for n in shape)
    n, nbytes = GGUF_BLOCKS[qtype]
    if not shape or min(shape) < 1 or shape[-1] % n:
        raise ValueError(f"{qtype}: shape {shape} must have a last dim that is a positive multiple of {n}")
    blocks = math.prod(shape) // n
    if raw.numel() != blocks * nbytes:
        raise ValueError(f"{qtype}: shape {shape} is {blocks} blocks of {nbytes} bytes = {blocks * nbytes} bytes, "
                         f"raw has {raw.numel()}")
    return raw.reshape(blocks, nbytes)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """(n, 2) little-endian bytes -> (n, 1) float32 through float16."""
    return two_bytes.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32) values: low nibbles are values 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dequantize_q8_0(raw: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Q8_0 blocks of 32: d (fp16) then 32 int8 q; w = d * q. Returns float32 of `shape`."""
    b = _blocks(raw, shape, "Q8_0")  # (n, 34)
    q = b[:, 2:].contiguous().view(torch.int8).float()  # (n, 32)
    return (q * _f16(b[:, :2])).reshape(tuple(shape))


def dequantize_q4_0(raw: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Q4_0 blocks of 32: d (fp16) then 16 bytes of nibbles; w = d * (q - 8)."""
    b = _blocks(raw, shape, "Q4_0")  # (n, 18)
    q = _nibbles(b[:, 2:]).float() - 8  # (n, 32)
    return (_f16(b[:, :2]) * q).reshape(tuple(shape))


def dequantize_q4_1(raw: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Q4_1 blocks of 32: d (fp16), m (fp16), then 16 bytes of nibbles; w = d * q + m."""
    b = _blocks(raw, shape, "Q4_1")  # (n, 20)
    q = _nibbles(b[:, 4:]).float()  # (n, 32)
    return (_f16(b[:, :2]) * q + _f16(b[:, 2:4])).reshape(tuple(shape))


GGUF_DEQUANTIZE = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}


def gguf_linear(raw: torch.Tensor, shape: Sequence[int], qtype: str, kernel: str = "auto",
                name: str = "weight") -> nn.Module:
    """A quantized linear from a GGUF weight's blocks, without a float copy of the weight.

    Q4_0 / Q4_1 -> Int4Linear, group 32, same 4-bit values (scale = d; zero = 0 or m + 8d,
    rounded to bf16 for the kernel). Q8_0 -> Int8Linear, re-quantized per output channel (rounded)."""
    if qtype == "Q8_0":
        return Int8Linear(*quantize_int8(dequantize_q8_0(raw, shape), name), kernel=kernel)
    if qtype not in ("Q4_0", "Q4_1"):
        raise ValueError(f"{name}: GGUF type {qtype} cannot stay quantized; supported: {', '.join(GGUF_BLOCKS)} "
                         "(load_gguf_quantized dequantizes the other types to float32)")
    N, K = shape
    b = _blocks(raw, shape, qtype)  # (N * K/32, bytes)
    d = _f16(b[:, :2]).reshape(N, K // 32)  # (N, K/32)
    if qtype == "Q4_1":  # d * q + m = (q - 8) * d + (m + 8d)
        q, zeros = _nibbles(b[:, 4:]), _f16(b[:, 2:4]).reshape(N, K // 32) + 8 * d
    else:  # d * (q - 8) = (q - 8) * d + 0
        q, zeros = _nibbles(b[:, 2:]), torch.zeros_like(d)
    return Int4Linear(q.reshape(N, K), d, zeros, kernel=kernel)


def load_gguf_quantized(path: str | Path, kernel: str = "auto") -> nn.Module:
    """A CausalLM (CPU) from a GGUF file whose Q4_0/Q4_1/Q8_0 linears stay quantized in memory.

    Every other type gguf-py decodes (Q5_0, the K-quants, ...) becomes a float32 nn.Linear; the
    embedding becomes int8 rows, shared with a tied head. The file is checked first (WeightsError)."""
    path = Path(path)
    config, shapes, infos = open_gguf(path)  # every count, offset, type and block size checked
    model = validate_names_and_shapes(config, shapes, str(path))  # on the meta device: no memory yet
    dense, embed = {}, None
    for name, t in infos:
        qtype, shape = t.tensor_type.name, shapes[name]
        kept = qtype in GGUF_BLOCKS and len(shape) == 2  # the file's blocks; anything else: float32
        w = torch.from_numpy(t.data.copy()).reshape(shape[0], -1) if kept else gguf_float(t, shape)
        w = hf_rows(config, name, w)  # whole rows move: blocks never straddle rows
        if name == "model.embed_tokens.weight":
            embed = GGUF_DEQUANTIZE[qtype](w, shape) if kept else w
        elif kept:
            parent, _, attr = name.removesuffix(".weight").rpartition(".")
            setattr(model.get_submodule(parent), attr, gguf_linear(w, shape, qtype, kernel, name))
        else:
            dense[name] = w
    model.load_state_dict(dense, strict=False, assign=True)  # norms and dequantized linears replace meta tensors
    _quantize_embedding(model, embed, kernel)  # int8 rows, re-quantized; a tied head shares them
    model.reset_rope("cpu")  # built on the meta device
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not still_meta, f"tensors never loaded: {still_meta}"
    return model.eval()
