# Generated from notebooks/A4_a_cpu_kernel.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The C++ source of minillm's CPU kernel, as strings: minillm/speed/cpu_kernel.py compiles and loads it.

Built step by step in notebooks/A4_a_cpu_kernel.ipynb (the appendix of notebook 13): int8
activations, one vector lane per weight row, integer dot products, several activation rows per
weight load, the torch ops.
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

static Quantized quantize_rows(const at::Tensor& x) {  // a prompt's rows on torch's threads, 16 or more each
  const int64_t M = x.size(0), K = x.size(1);
  Quantized a{at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({M, K / 32}, x.options()),
              at::empty({M, K / 32}, x.options())};
  at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_row(x.data_ptr<float>() + i * K, K, a.qx.data_ptr<int8_t>() + i * K,
                   a.dx.data_ptr<float>() + i * K / 32, a.sx.data_ptr<float>() + i * K / 32);
  });
  return a;
}
"""


WIDE_CPP = r"""
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define WIDE 1  // 512-bit registers and VNNI
#else
#define WIDE 0  // 256-bit AVX2
#endif

#if WIDE
constexpr int LANES = 16, TOKENS = 6;  // weight rows per vector (one int32 lane each); activation rows at once
using ivec = __m512i;
using fvec = __m512;
static inline ivec load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline ivec low_nibbles(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline ivec high_nibbles(ivec v) { return low_nibbles(_mm512_srli_epi16(v, 4)); }
static inline ivec broadcast4(const int8_t* x) { int32_t v; std::memcpy(&v, x, 4); return _mm512_set1_epi32(v); }
static inline fvec load_halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline fvec fset(float v) { return _mm512_set1_ps(v); }
static inline fvec fmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
static inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
static inline void fstore(float* p, fvec v) { _mm512_storeu_ps(p, v); }
static inline fvec floads(const float* p) { return _mm512_loadu_ps(p); }
static inline float fsum(fvec v) { return _mm512_reduce_add_ps(v); }  // the 16 lanes added

// lane r: row r's 32 values of a block (w: 8 vectors, 4 values a lane) dotted with the block's 32 activations
static inline fvec block_dot(const ivec w[8], const int8_t* x) {
  ivec dots = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j) dots = _mm512_dpbusd_epi32(dots, w[j], broadcast4(x + 4 * j));  // +4 products a lane
  return _mm512_cvtepi32_ps(dots);
}
#endif
"""


NARROW_CPP = r"""
#if !WIDE
constexpr int LANES = 8, TOKENS = 4;  // 16 registers, not 32: fewer activation rows at once
using ivec = __m256i;
using fvec = __m256;
static inline ivec load_bytes(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline ivec low_nibbles(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline ivec high_nibbles(ivec v) { return low_nibbles(_mm256_srli_epi16(v, 4)); }
static inline ivec broadcast4(const int8_t* x) { int32_t v; std::memcpy(&v, x, 4); return _mm256_set1_epi32(v); }
static inline fvec load_halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline fvec fset(float v) { return _mm256_set1_ps(v); }
static inline fvec fmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
static inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
static inline void fstore(float* p, fvec v) { _mm256_storeu_ps(p, v); }
static inline fvec floads(const float* p) { return _mm256_loadu_ps(p); }
static inline float fsum(fvec v) {  // the 8 lanes added: halves, then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline fvec block_dot(const ivec w[8], const int8_t* x) {
  ivec pairs = _mm256_setzero_si256();  // 16-bit lanes: at most 8 x (2 x 15 x 127) = 30480 < 32767
  for (int j = 0; j < 8; ++j) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], broadcast4(x + 4 * j)));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));  // pairs of 16-bit sums -> int32
}
#endif
"""


INT4_TILE_CPP = r"""
// a block's 32 values for LANES rows of a tile: 4 chunks of 64 bytes, each split into two vectors
static inline void unpack_block(const uint8_t* block, ivec w[8]) {
  for (int c = 0; c < 4; ++c) {
    const ivec raw = load_bytes(block + c * 64);
    w[2 * c] = low_nibbles(raw);  // values 8c .. 8c + 3 of each row
    w[2 * c + 1] = high_nibbles(raw);  // values 8c + 4 .. 8c + 7
  }
}

// T activation rows times LANES weight rows of a 16-row tile (pass 0, or 1 for AVX2's second 8 rows).
// The tile, group after group: 16 scales d and 16 mins m as float16 (64 bytes), then per block of
// 32 values 4 chunks of 64 bytes. out gets T rows of LANES results, ldo floats apart.
template <int T>
static void int4_tile(const uint8_t* tile, int64_t pass, int64_t K, int64_t G, const int8_t* qx, const float* dx,
                      const float* sx, float* out, int64_t ldo) {
  const int64_t per_group = K / 32 / G, group_bytes = 64 + per_group * 256, blocks = K / 32;
  fvec acc[T];
  for (int t = 0; t < T; ++t) acc[t] = fset(0.f);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* group = tile + g * group_bytes;
    _mm_prefetch((const char*)group + 4096, _MM_HINT_T1);  // the scales' line
    const fvec d = load_halves(group + pass * LANES * 2), m = load_halves(group + 32 + pass * LANES * 2);
    for (int64_t k = 0; k < per_group; ++k) {
      const int64_t b = g * per_group + k;  // the block's index in an activation row
      const uint8_t* block = group + 64 + k * 256 + pass * LANES * 4;
      for (int line = 0; line < 4; ++line)  // 4 KiB ahead, each cache line: the hardware prefetcher alone lags
        _mm_prefetch((const char*)block + line * 64 + 4096, _MM_HINT_T1);
      ivec w[8];
      unpack_block(block, w);  // once, for all T activation rows
      for (int t = 0; t < T; ++t) {
        acc[t] = fmadd(block_dot(w, qx + t * K + b * 32), fmul(d, fset(dx[t * blocks + b])), acc[t]);
        acc[t] = fmadd(m, fset(sx[t * blocks + b]), acc[t]);  // the minimums: m * dx * sum(qx)
      }
    }
  }
  for (int t = 0; t < T; ++t) fstore(out + t * ldo, acc[t]);
}
"""


INT8_HELPERS_CPP = r"""
// 32 unsigned bytes times 32 signed bytes -> 8 int32 lanes, each the sum of 4 adjacent products
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if WIDE
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
"""


INT8_ROWS_CPP = r"""
// R rows of int8 weights (one scale s per row, row-major as the embedding reads them) against one
// quantized activation row. Signed times signed: |w| is unsigned, and x takes w's sign.
template <int R>
static void int8_rows(const int8_t* w, const float* s, int64_t K, const int8_t* qx, const float* dx,
                      float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t b = 0;
#if WIDE  // two blocks a 512-bit register: lanes 0-7 dot the first block, lanes 8-15 the second
  __m512 wide[R];
  for (int r = 0; r < R; ++r) wide[r] = _mm512_setzero_ps();
  for (; b + 2 <= K / 32; b += 2) {
    const __m512i x = _mm512_loadu_si512(qx + b * 32);
    const __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(dx[b]), _mm512_set1_ps(dx[b + 1]));
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_loadu_si512(w + r * K + b * 32);  // AVX-512 has no sign_epi8: a masked negate
      const __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), x);
      const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wv), xs);
      wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale, wide[r]);
    }
  }
  for (int r = 0; r < R; ++r)  // the 16 lanes folded into 8, for the odd block left (if any) and the sum
    acc[r] = _mm256_add_ps(_mm512_castps512_ps256(wide[r]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide[r]), 1)));
#endif
  for (; b < K / 32; ++b) {
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
  TORCH_CHECK(K % 32 == 0 && G > 0 && (K / 32) % G == 0 && packed.size(0) == (N + 15) / 16
              && packed.size(1) == G * (64 + K / 32 / G * 256), "minillm_cpu: int4 weights ", packed.sizes(),
              " do not hold N=", N, " rows of K=", K, " values in G=", G, " groups");
}
"""


INT4_ROWS_CPP = r"""
using TileFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const int8_t*, const float*, const float*,
                        float*, int64_t);
static const TileFn int4_tiles[] = {int4_tile<1>, int4_tile<2>, int4_tile<3>, int4_tile<4>, int4_tile<5>, int4_tile<6>};

// out (M, 16 * tiles) = quantized activation rows times a packed matrix, its tiles split between torch's
// threads, each tile run over the rows TOKENS at a time: the loop of int4_matmul, and of a decode layer
static void int4_rows(const int8_t* qx, const float* dx, const float* sx, int64_t M, int64_t K,
                      const at::Tensor& packed, int64_t G, float* out) {
  const int64_t tiles = packed.size(0), passes = 16 / LANES, NP = 16 * tiles, bytes = packed.size(1);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles * passes, 1, [&](int64_t c0, int64_t c1) {  // torch's threads
    for (int64_t c = c0; c < c1; ++c)  // LANES rows from 16 * (c / passes) + LANES * (c % passes)
      for (int64_t i = 0; i < M; i += TOKENS)
        int4_tiles[std::min<int64_t>(TOKENS, M - i) - 1](w + c / passes * bytes, c % passes, K, G, qx + i * K,
            dx + i * K / 32, sx + i * K / 32, out + i * NP + c * LANES, NP);
  });
}
"""

INT4_OP_CPP = r"""
// y (M, N) = x (M, K) @ W.T for any M: the activations quantized once, then int4_rows
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t G) {
  check(x, at::kFloat, "x"); check(packed, at::kByte, "packed");
  const int64_t M = x.size(0), K = x.size(1), NP = 16 * packed.size(0);
  check_int4(packed, N, K, G);
  Quantized a = quantize_rows(x);
  auto y = at::empty({M, NP}, x.options());  // N rounded up to whole tiles
  int4_rows(a.qx.data_ptr<int8_t>(), a.dx.data_ptr<float>(), a.sx.data_ptr<float>(), M, K, packed, G,
            y.data_ptr<float>());
  return NP == N ? y : y.narrow(1, 0, N).contiguous();  // the padding rows' results dropped
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
