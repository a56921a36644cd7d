# Generated from notebooks/A4_a_cpu_kernel.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""int4 and int8 matrix products on int8 activations, llama.cpp's way, in a small C++ kernel.

Built in notebooks/A4_a_cpu_kernel.ipynb, the appendix of notebook 13. The activations are quantized
to int8 per block of 32, so the inner loop is an integer dot product of 32 weight nibbles with 32
int8 values; per block, y += d * dx * dot(q, qx) + m * dx * sum(qx) for weights w = d * q + m.
The int4 weights lie in tiles of 16 rows, one vector lane per row, so that one loop serves a decode
step and a prompt (several activation rows per weight load).
The C++ (minillm/speed/cpu_kernel_cpp.py) is compiled on first use for torch's instruction set (AVX2 or AVX-512 VNNI)
and registered as torch ops, which torch.compile can call; where it cannot be built, the fast path
keeps torch's packed kernels and says why once.

Shape legend: N output features, K input features, M rows of activations, G groups per row.

References: ggml-quants.c (block_q4_1, block_q8_1, ggml_vec_dot_q4_1_q8_1) and ggml-cpu's repacked
kernels (repack.cpp); Intel's intrinsics guide (_mm512_dpbusd_epi32, _mm256_maddubs_epi16);
PyTorch's custom C++ ops tutorial.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minillm.speed.cpu_decode_cpp import KERNEL_CPP  # the C++ source, written below step by step
from minillm.speed.quant import (Int8Linear, bias_parameter, validate_quant_input, dequantize_int8, int8_table, quantize_int4,
                                 quantize_linear)

BLOCK = 32  # values per activation block and per weight block, as in ggml's q8_1 / q4_1


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) float -> qx (M, K) int8, dx (M, K/32) scales, sx (M, K/32) = dx * sum of qx per block.

    Symmetric absmax per block of 32: x ≈ qx * dx with qx in -127..127 (the kernel's first step)."""
    M, K = x.shape
    xb = x.float().reshape(M, K // BLOCK, BLOCK)  # (M, K) -> (M, K/32, 32)
    dx = xb.abs().amax(dim=-1) / 127  # (M, K/32)
    qx = torch.round(xb / torch.where(dx > 0, dx, 1)[..., None])  # 0 where a block is all zeros
    return qx.to(torch.int8).reshape(M, K), dx, dx * qx.sum(dim=-1)


def int4_dot8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """What the int4 kernel computes, in torch, for quantize_int4's (q, scales, zeros): (M, K) -> (M, N).

    With w = d * q + m (d = scale, m = zero - 8 * scale, rounded to float16 as the kernel stores them),
    block b of a row adds d * dx[b] * (integer dot of q and qx) + m * dx[b] * (sum of qx), exact in int32."""
    qx, dx, sx = quantize_activations(x)  # (M, K) int8, (M, K/32), (M, K/32)
    N, G, nb = q.shape[0], scales.shape[1], q.shape[1] // BLOCK  # q: (N, K)
    dots = torch.einsum("nbj,mbj->mnb", q.reshape(N, nb, BLOCK).int(), qx.reshape(-1, nb, BLOCK).int())  # (M, N, K/32)
    group = torch.arange(nb) // (nb // G)  # (K/32,): the group of each block
    d, m = scales.half()[:, group].double(), (zeros - 8 * scales).half()[:, group].double()  # stored as float16
    return (dots.double() * d * dx.double()[:, None] + m * sx.double()[:, None]).sum(dim=-1).float()


TILE = 16  # weight rows per tile: one 32-bit lane each of a 512-bit register (two 256-bit ones on AVX2)


def pack_int4_tiles(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """quantize_int4's (q, scales, zeros) -> the kernel's bytes, (ceil(N/16), G * (64 + 256 * g/32)) uint8.

    Rows go in tiles of 16 (N padded with zero rows). Per group: the 16 rows' scales d, then their
    mins m, as float16 (w = d * q + m; 0.625 bytes a weight in all, as ggml's Q4_1). Then each block
    of 32 values as 4 chunks of 64 bytes: in chunk c, byte 4r + j holds row r's value 8c + j in its
    low nibble and value 8c + 4 + j in its high nibble, so that a 32-bit lane holds one row."""
    (N, K), G = q.shape, scales.shape[1]
    tiles, per_group = -(-N // TILE), K // BLOCK // G
    pad = (0, 0, 0, TILE * tiles - N)  # zero rows up to whole tiles
    q = F.pad(q, pad).reshape(tiles, TILE, G, per_group, 4, 2, 4)  # (tiles, rows, G, blocks, chunks, low/high, 4)
    nibbles = q[..., 0, :] | (q[..., 1, :] << 4)  # (tiles, rows, G, blocks, chunks, 4)
    nibbles = nibbles.permute(0, 2, 3, 4, 1, 5).reshape(tiles, G, per_group * 256)  # a chunk: rows x 4 bytes
    d, m = F.pad(scales.float(), pad), F.pad((zeros - 8 * scales).float(), pad)  # (16 tiles, G)
    head = torch.stack([d, m]).reshape(2, tiles, TILE, G).permute(1, 3, 0, 2)  # (tiles, G, [d, m], 16)
    head = head.half().contiguous().view(torch.uint8).reshape(tiles, G, 64)  # 32 float16 as bytes
    return torch.cat([head, nibbles], dim=-1).reshape(tiles, -1).contiguous()


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def compiler_flags() -> list[str] | None:
    """Flags for the instruction set torch itself runs on here, or None where the kernel has no path.

    torch's choice (ATEN_CPU_CAPABILITY can lower it) is followed, not -march=native: a CPU may
    advertise features its VM forbids, and ATEN_CPU_CAPABILITY=avx2 then measures the AVX2 kernel."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if capability not in ("AVX2", "AVX512"):
        return None
    flags = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]  # -fopenmp: at::parallel_for uses torch's threads
    if capability == "AVX512" and {"avx512_vnni", "avx512vl", "avx512bw"} <= cpu_flags():
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
    return flags


def _register_shapes() -> None:
    """What each op returns, for torch.compile's tracing (which runs no kernel)."""
    fake = torch.library.register_fake
    fake("minillm_cpu::int4_matmul")(lambda x, packed, N, G: x.new_empty(x.shape[0], N))
    fake("minillm_cpu::int8_matvec")(lambda x, w, s: x.new_empty(x.shape[0], w.shape[0]))


_BUILT: dict[str, str | None] = {}  # compiler flags -> None once loaded, else why it could not be


def build_kernel() -> str | None:
    """Compile (first time, ~20 s; then cached by torch) and load the ops; None if loaded, else why not."""
    flags = compiler_flags()
    if flags is None:
        return f"no kernel for torch's CPU capability {torch.backends.cpu.get_cpu_capability()} (needs AVX2)"
    key = " ".join(flags)
    if key not in _BUILT:
        from torch.utils.cpp_extension import load_inline  # imported on use: it pulls in setuptools
        if shutil.which("ninja") is None:  # torch runs `ninja`; the pip package's may be off PATH
            import ninja
            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        name = "minillm_cpu_" + ("avx512" if "-mavx512vnni" in flags else "avx2")
        try:
            load_inline(name, cpp_sources=KERNEL_CPP, extra_cflags=flags, is_python_module=False)
            _register_shapes()
            _BUILT[key] = None
        except Exception as error:  # no compiler, no ninja, a failed build: say which, once
            _BUILT[key] = f"the C++ kernel did not build ({type(error).__name__}: {str(error)[-300:]})"
            warnings.warn(f"minillm: {_BUILT[key]}; using torch's packed kernels", stacklevel=2)
    return _BUILT[key]


MATVEC_ROWS = 16  # the int8 head's integer kernel runs up to this many rows; beyond, one float matmul


class DotLinear(nn.Module):
    """What both layers share: (..., K) in any float dtype -> (..., N) in that dtype, the bias added in float."""

    mode = ""  # "int4" or "int8", for messages

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        try:
            y = self.products(x.reshape(-1, self.in_features).float().contiguous())  # (M, K) -> (M, N) float32
        except RuntimeError:  # the input is checked only when the kernel fails, as notebook 12's layers
            validate_quant_input(x, self.in_features, "dot8", self.mode)
            raise
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4DotLinear(DotLinear):
    """y = x @ W.T + bias, W int4 (w = d * q + m per group), x int8 per block of 32: llama.cpp's Q4_1 x Q8_1,
    on the C++ kernel for any number of rows, from one decode step to a whole prompt."""

    mode = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__()
        (N, K), G = qweight.shape, scales.shape[1]
        self.out_features, self.in_features, self.group_size = N, K, K // G
        self.register_buffer("packed", pack_int4_tiles(qweight, scales, zeros))  # (N/16, ...) uint8
        self.bias = bias_parameter(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32, name: str = "linear") -> Int4DotLinear:
        return cls(*quantize_int4(linear.weight, group_size, name), linear.bias)

    def products(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N)
        G = self.in_features // self.group_size
        return torch.ops.minillm_cpu.int4_matmul(x, self.packed, self.out_features, G)


class Int8DotLinear(DotLinear):
    """y = x @ (q * scale).T + bias, q int8 per output channel, x int8 per block of 32 (llama.cpp's Q8_0).

    Shares quant.Int8Linear's buffers, so a tied head stays one table with the embedding."""

    mode = "int8"

    def __init__(self, linear: Int8Linear):
        super().__init__()
        self.out_features, self.in_features = linear.out_features, linear.in_features
        self.register_buffer("qweight", linear.qweight)  # (N, K) int8, the same storage
        self.register_buffer("scales", linear.scales)  # (N,) float32
        self.bias = linear.bias

    def products(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N)
        if x.shape[0] <= MATVEC_ROWS:
            return torch.ops.minillm_cpu.int8_matvec(x, self.qweight, self.scales)
        return F.linear(x, dequantize_int8(self.qweight, self.scales))  # notebook 12's float table


def use_dot8(kernel: str, mode: str | None, device: torch.device | str) -> bool:
    """Whether a quantized layer runs this module's kernel: 'auto' takes it wherever it builds,
    'dot8' insists (ValueError saying why it cannot), other kernels leave it to minillm.speed.quant."""
    if kernel not in ("auto", "dot8") or mode is None:
        return False
    why = build_kernel() if torch.device(device).type == "cpu" else f"it runs on the CPU, not {device}"
    if why is not None and kernel == "dot8":
        raise ValueError(f"kernel='dot8' is not available: {why}")
    return why is None


def fast_quantized_linear(linear: nn.Linear, mode: str | None, group_size: int, name: str,
                          kernel: str) -> nn.Module:
    """quant.quantize_linear, with the integer-dot kernel where use_dot8 says so."""
    if not use_dot8(kernel, mode, linear.weight.device):
        return quantize_linear(linear, mode, group_size, name, "auto" if kernel == "dot8" else kernel)
    if mode == "int4":
        return Int4DotLinear.from_linear(linear, group_size, name)
    return Int8DotLinear(Int8Linear.from_linear(linear, name=name))


def fast_int8_table(weight: torch.Tensor, kernel: str) -> tuple[nn.Module, nn.Module]:
    """quant.int8_table (lookup and head sharing int8 rows), the head on the integer-dot kernel if it builds."""
    embed, head = int8_table(weight, "auto" if kernel == "dot8" else kernel)
    return embed, Int8DotLinear(head) if use_dot8(kernel, "int8", weight.device) else head


def decode_layer_parts(layer) -> dict | None:
    """The C++ decode layer's fixed arguments for notebook 13's FastLayer, or None where it cannot run it."""
    mlp = layer.mlp
    linears = [layer.qkv_proj, layer.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)]
    if (not all(isinstance(lin, Int4DotLinear) for lin in linears) or len({lin.group_size for lin in linears}) != 1
            or layer.input_norm.dtype != torch.float32 or layer.D % 16):
        return None
    norms = [layer.input_norm, layer.post_norm] + ([] if layer.q_norm is None else [layer.q_norm, layer.k_norm])
    return {"norms": [n.detach() for n in norms], "packed": [lin.packed for lin in linears],
            "biases": [None if lin.bias is None else lin.bias.detach().float() for lin in linears],
            "sizes": [layer.H, layer.Hkv, layer.D, mlp.intermediate_size, linears[0].group_size], "eps": layer.eps}


def decode_in_one_call(parts: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                       pos: int) -> torch.Tensor:
    """Decode tokens through a layer in one op, x (B, T, h) -> (B, T, h), their keys and values written: one
    token at pos of a dense KVCache, or one per sequence of an engine step (a cache with `decode_rows`)."""
    D, rows = parts["sizes"][2], getattr(cache, "decode_rows", None)
    args = (x.reshape(-1, x.shape[-1]), parts["norms"], parts["packed"], parts["biases"], parts["sizes"], parts["eps"])
    if rows is None:  # notebook 08's cache
        y = torch.ops.minillm_cpu.decode_layer(*args, cache.k, cache.v, pos, cos.view(-1), sin.view(-1))  # (1, h)
    else:  # notebook 17's paged pool, read through the block tables
        y = torch.ops.minillm_cpu.decode_layer_paged(*args, rows.k, rows.v, rows.tables, rows.lengths,
                                                     cos.reshape(-1, D), sin.reshape(-1, D))  # (Bd, h)
    return y.view(x.shape)
