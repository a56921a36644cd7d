# Generated from notebooks/15_performance.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The C++ source of minillm's CPU kernel, as strings: minillm/cpu_kernel.py compiles and loads it.

Built step by step in notebooks/15_performance.ipynb ("An int4 kernel of our own"): int8
activations, unpacking nibbles, integer dot products, four rows in flight, the torch ops.
"""

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

// a group's header in the interleaved int4 layout: 4 scales d, then 4 mins m, float16 -> float32 (F16C)
static inline void group_scales(const uint8_t* group, float* d, float* m) {
  _mm_storeu_ps(d, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)group)));
  _mm_storeu_ps(m, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(group + 8))));
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
    float d[4], m[4];
    group_scales(group, d, m);
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
      group_scales(group, d, m);
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
