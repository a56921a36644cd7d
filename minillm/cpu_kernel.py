# Generated from notebooks/15_performance.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""int4 and int8 matrix-vector products on int8 activations, llama.cpp's way, in a small C++ kernel.

Built in notebooks/15_performance.ipynb ("An int4 kernel of our own"). The activations are quantized
to int8 per block of 32, so the inner loop is an integer dot product of 32 weight nibbles with 32
int8 values; per block, y += d * dx * dot(q, qx) + m * dx * sum(qx) for weights w = d * q + m.
The C++ (strings below) is compiled on first use for torch's instruction set (AVX2 or AVX-512 VNNI)
and registered as torch ops, which torch.compile can call; where it cannot be built, the fast path
keeps torch's packed kernels and says why once.

Shape legend: N output features, K input features, M rows of activations, G groups per row.

References: ggml-quants.c (block_q4_1, block_q8_1, ggml_vec_dot_q4_1_q8_1); Intel's intrinsics
guide (_mm256_maddubs_epi16, _mm256_dpbusd_epi32); PyTorch's custom C++ ops tutorial.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minillm.quant import Int8Linear, _bias, _check_input, int8_table, quantize_int4, quantize_int8, quantize_linear

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
    (N, K), G, nb = q.shape, scales.shape[1], q.shape[1] // BLOCK
    dots = torch.einsum("nbj,mbj->mnb", q.reshape(N, nb, BLOCK).int(), qx.reshape(-1, nb, BLOCK).int())  # (M, N, K/32)
    group = torch.arange(nb) // (nb // G)  # (K/32,): the group of each block
    d, m = scales.half()[:, group].double(), (zeros - 8 * scales).half()[:, group].double()  # stored as float16
    return (dots.double() * d * dx.double()[:, None] + m * sx.double()[:, None]).sum(dim=-1).float()


def pack_int4_rows(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """quantize_int4's (q, scales, zeros) -> the kernel's bytes, (ceil(N/4), G * (16 + 64 * g/32)) uint8.

    Rows go in fours (N padded with zero rows). Per group: the 4 rows' scales d and mins m as
    float16 (w = d * q + m; 0.625 bytes a weight in all, as ggml's Q4_1), then each block of 32
    values as 4 x 16 bytes, value j in the low nibble of byte j and value j + 16 in its high
    nibble (ggml's order: one shift and one mask unpack 16 values)."""
    (N, K), G = q.shape, scales.shape[1]
    N4, per_group = -(-N // 4), K // BLOCK // G
    pad = (0, 0, 0, 4 * N4 - N)  # zero rows up to a multiple of 4
    q = F.pad(q, pad).reshape(N4, 4, G, per_group, 2, 16)  # (N4, 4, G, blocks, halves, 16)
    nibbles = q[..., 0, :] | (q[..., 1, :] << 4)  # (N4, 4, G, blocks, 16): halves -> low, high
    nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(N4, G, per_group * 64)  # rows inside each block
    d, m = F.pad(scales.float(), pad), F.pad((zeros - 8 * scales).float(), pad)  # (4 N4, G)
    head = torch.stack([d, m], dim=-1).reshape(N4, 4, G, 2).permute(0, 2, 3, 1)  # (N4, G, [d, m], 4)
    head = head.half().contiguous().view(torch.uint8).reshape(N4, G, 16)  # 8 float16 as bytes
    return torch.cat([head, nibbles], dim=-1).reshape(N4, -1).contiguous()


ACTIVATIONS_CPP = r"""
// x (K,) float -> qx (K,) int8, dx (K/32,) block scales, sx (K/32,) = dx * sum of qx per block
static void quantize_row(const float* x, int64_t K, int8_t* qx, float* dx, float* sx) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      int q = (int)std::nearbyint(xb[j] * inv);  // round half to even, as torch.round
      qx[b * 32 + j] = (int8_t)q;
      sum += q;
    }
    dx[b] = d;
    sx[b] = d * (float)sum;
  }
}

struct Quantized { at::Tensor qx, dx, sx; };  // (M, K) int8, (M, K/32) and (M, K/32) float

static Quantized quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  Quantized a{at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({M, K / 32}, x.options()),
              at::empty({M, K / 32}, x.options())};
  for (int64_t i = 0; i < M; ++i)
    quantize_row(x.data_ptr<float>() + i * K, K, a.qx.data_ptr<int8_t>() + i * K,
                 a.dx.data_ptr<float>() + i * K / 32, a.sx.data_ptr<float>() + i * K / 32);
  return a;
}
"""


SIMD_CPP = r"""
// 16 bytes of nibbles -> 32 bytes 0..15: low nibbles (values 0..15) first, high nibbles (16..31) after
static inline __m256i unpack_nibbles(const uint8_t* p) {
  __m128i raw = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

// 32 unsigned bytes times 32 signed bytes -> 8 int32 lanes, each the sum of 4 products
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);  // one VNNI instruction
#else
  __m256i pairs = _mm256_maddubs_epi16(u, s);  // 16 int16 sums of 2 products (no overflow: 2*15*127)
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));  // 8 int32 sums of 4
#endif
}

static inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
"""


INT4_ROWS_CPP = r"""
// Four rows of int4 weights against one quantized activation row. The rows are stored
// interleaved, one group after another: per group, 4 scales d and 4 mins m in float16 (16 bytes),
// then per block of 32 values 4 x 16 bytes of nibbles: the loop reads one sequential stream.
static void int4_four_rows(const uint8_t* rows, int64_t K, int64_t G, const int8_t* qx, const float* dx,
                           const float* sx, float* out) {
  const int64_t per_group = K / 32 / G, group_bytes = 16 + per_group * 64;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  float mins[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* group = rows + g * group_bytes;
    float d[4], m[4];  // float16 -> float32 (F16C)
    _mm_storeu_ps(d, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)group)));
    _mm_storeu_ps(m, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(group + 8))));
    for (int64_t k = 0; k < per_group; ++k) {
      const int64_t b = g * per_group + k;  // the block's index in the activation row
      const uint8_t* nibbles = group + 16 + k * 64;
      _mm_prefetch((const char*)nibbles + 4096, _MM_HINT_T1);  // 4 KiB ahead: the hardware prefetcher alone lags
      const __m256i x = _mm256_loadu_si256((const __m256i*)(qx + b * 32));
      for (int r = 0; r < 4; ++r) {
        __m256i dots = dot_u8_s8(unpack_nibbles(nibbles + r * 16), x);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(d[r] * dx[b]), acc[r]);
        mins[r] += m[r] * sx[b];
      }
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = sum_lanes(acc[r]) + mins[r];
}
"""


INT8_ROWS_CPP = r"""
// R rows of int8 weights (one scale s per row) against one quantized activation row.
// Signed times signed: |w| is unsigned, and x takes w's sign, so dot_u8_s8 applies.
template <int R>
static void int8_rows(const int8_t* w, const float* s, int64_t K, const int8_t* qx, const float* dx,
                      float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)(qx + b * 32));
    const __m256 scale = _mm256_set1_ps(dx[b]);
    for (int r = 0; r < R; ++r) {
      __m256i wv = _mm256_loadu_si256((const __m256i*)(w + r * K + b * 32));
      __m256i dots = dot_u8_s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x, wv));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sum_lanes(acc[r]) * s[r];
}
"""


CHECKS_CPP = r"""
static void check(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 2 && t.is_contiguous(),
              "minillm_cpu: ", name, " must be a contiguous 2-d ", c10::toString(dtype), " CPU tensor, got ",
              t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
}

static void check_int4(const at::Tensor& packed, int64_t N, int64_t K, int64_t G) {
  TORCH_CHECK(K % 32 == 0 && G > 0 && (K / 32) % G == 0 && packed.size(0) == (N + 3) / 4
              && packed.size(1) == G * (16 + K / 32 / G * 64), "minillm_cpu: int4 weights ", packed.sizes(),
              " do not hold N=", N, " rows of K=", K, " values in G=", G, " groups");
}
"""

INT4_OP_CPP = r"""
// y (M, N) = x (M, K) @ W.T: the activations quantized once, then 4 weight rows at a time on each thread
at::Tensor int4_matvec(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t G) {
  check(x, at::kFloat, "x"); check(packed, at::kByte, "packed");
  const int64_t M = x.size(0), K = x.size(1), row_bytes = packed.size(1);
  check_int4(packed, N, K, G);
  Quantized a = quantize_rows(x);
  auto y = at::empty({M, N}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int8_t* qx = a.qx.data_ptr<int8_t>();
  const float *dx = a.dx.data_ptr<float>(), *sx = a.sx.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t c0, int64_t c1) {  // torch's threads, 16 x 4 rows or more each
    float four[4];
    for (int64_t c = c0; c < c1; ++c)  // rows 4c .. 4c + 3
      for (int64_t i = 0; i < M; ++i) {
        int4_four_rows(w + c * row_bytes, K, G, qx + i * K, dx + i * K / 32, sx + i * K / 32, four);
        for (int64_t r = 0; r < 4 && 4 * c + r < N; ++r) out[i * N + 4 * c + r] = four[r];  // not the padding
      }
  });
  return y;
}
"""


INT8_OP_CPP = r"""
at::Tensor int8_matvec(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s) {
  check(x, at::kFloat, "x"); check(w, at::kChar, "w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K && s.dim() == 1 && s.size(0) == N && s.scalar_type() == at::kFloat
              && s.is_contiguous(), "int8_matvec: x ", x.sizes(), ", w ", w.sizes(), ", s ", s.sizes(), " do not fit");
  Quantized a = quantize_rows(x);
  auto y = at::empty({M, N}, x.options());
  const int8_t *q = w.data_ptr<int8_t>(), *qx = a.qx.data_ptr<int8_t>();
  const float *scale = s.data_ptr<float>(), *dx = a.dx.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t n = c0 * 4; n < std::min(c1 * 4, N); n += n + 4 <= N ? 4 : 1)  // 4 rows, then one by one
      for (int64_t i = 0; i < M; ++i)
        (n + 4 <= N ? int8_rows<4> : int8_rows<1>)(q + n * K, scale + n, K, qx + i * K, dx + i * K / 32,
                                                   out + i * N + n);
  });
  return y;
}
"""


DEQUANTIZE_CPP = r"""
// the float (N, K) weight, for prompts: one float matmul beats M integer passes over the weights
at::Tensor int4_dequantize(const at::Tensor& packed, int64_t N, int64_t K, int64_t G) {
  check(packed, at::kByte, "packed");
  check_int4(packed, N, K, G);
  const int64_t per_group = K / 32 / G, group_bytes = 16 + per_group * 64;
  auto w = at::empty({N, K}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* out = w.data_ptr<float>();
  at::parallel_for(0, (N + 3) / 4 * G, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {  // group t % G of rows 4 (t / G) ..
      const uint8_t* group = src + t * group_bytes;
      float d[4], m[4];
      _mm_storeu_ps(d, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)group)));
      _mm_storeu_ps(m, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(group + 8))));
      for (int64_t r = 0; r < 4 && t / G * 4 + r < N; ++r)
        for (int64_t k = 0; k < per_group; ++k) {
          const uint8_t* nibbles = group + 16 + k * 64 + r * 16;
          float* row = out + (t / G * 4 + r) * K + (t % G * per_group + k) * 32;
          for (int j = 0; j < 16; ++j) {
            row[j] = d[r] * (nibbles[j] & 0x0F) + m[r];
            row[j + 16] = d[r] * (nibbles[j] >> 4) + m[r];
          }
        }
    }
  });
  return w;
}
"""


REGISTER_CPP = r"""
TORCH_LIBRARY(minillm_cpu, lib) {  // the schemas; what they return, for torch.compile, is told in Python
  lib.def("int4_matvec(Tensor x, Tensor packed, int N, int G) -> Tensor");
  lib.def("int8_matvec(Tensor x, Tensor w, Tensor s) -> Tensor");
  lib.def("int4_dequantize(Tensor packed, int N, int K, int G) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm_cpu, CPU, lib) {
  lib.impl("int4_matvec", int4_matvec);
  lib.impl("int8_matvec", int8_matvec);
  lib.impl("int4_dequantize", int4_dequantize);
}
"""

HEADER_CPP = """#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
"""
KERNEL_CPP = (HEADER_CPP + ACTIVATIONS_CPP + SIMD_CPP + INT4_ROWS_CPP + INT8_ROWS_CPP + CHECKS_CPP + INT4_OP_CPP
              + INT8_OP_CPP + DEQUANTIZE_CPP + REGISTER_CPP)


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
    fake("minillm_cpu::int4_matvec")(lambda x, packed, N, G: x.new_empty(x.shape[0], N))
    fake("minillm_cpu::int8_matvec")(lambda x, w, s: x.new_empty(x.shape[0], w.shape[0]))
    fake("minillm_cpu::int4_dequantize")(lambda packed, N, K, G: packed.new_empty(N, K, dtype=torch.float32))


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


MATVEC_ROWS = 16  # up to this many activation rows the integer kernel runs; beyond, one float matmul


class DotLinear(nn.Module):
    """What both layers share: (..., K) in any float dtype -> (..., N) in that dtype, the bias added in float."""

    mode = ""  # "int4" or "int8", for messages

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        try:
            y = self.products(x.reshape(-1, self.in_features).float().contiguous())  # (M, K) -> (M, N) float32
        except RuntimeError:  # the input is checked only when the kernel fails, as notebook 13's layers
            _check_input(x, self.in_features, "dot8", self.mode)
            raise
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4DotLinear(DotLinear):
    """y = x @ W.T + bias, W int4 (w = d * q + m per group), x int8 per block of 32: llama.cpp's Q4_1 x Q8_1.
    Up to MATVEC_ROWS rows run the C++ kernel; a prompt dequantizes W once into a float matmul."""

    mode = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__()
        (N, K), G = qweight.shape, scales.shape[1]
        self.out_features, self.in_features, self.group_size = N, K, K // G
        self.register_buffer("packed", pack_int4_rows(qweight, scales, zeros))  # (N/4, ...) uint8
        self.bias = _bias(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32, name: str = "linear") -> Int4DotLinear:
        return cls(*quantize_int4(linear.weight, group_size, name), linear.bias)

    def products(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N)
        N, K, G = self.out_features, self.in_features, self.in_features // self.group_size
        if x.shape[0] <= MATVEC_ROWS:
            return torch.ops.minillm_cpu.int4_matvec(x, self.packed, N, G)
        return F.linear(x, torch.ops.minillm_cpu.int4_dequantize(self.packed, N, K, G))


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
        return F.linear(x, self.qweight.float() * self.scales[:, None])


def use_dot8(kernel: str, mode: str | None, device: torch.device | str) -> bool:
    """Whether a quantized layer runs this module's kernel: 'auto' takes it wherever it builds,
    'dot8' insists (ValueError saying why it cannot), other kernels leave it to minillm.quant."""
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
    return Int8DotLinear(Int8Linear(*quantize_int8(linear.weight, name), linear.bias))


def fast_int8_table(weight: torch.Tensor, kernel: str) -> tuple[nn.Module, nn.Module]:
    """quant.int8_table (lookup and head sharing int8 rows), the head on the integer-dot kernel if it builds."""
    embed, head = int8_table(weight, "auto" if kernel == "dot8" else kernel)
    return embed, Int8DotLinear(head) if use_dot8(kernel, "int8", weight.device) else head
