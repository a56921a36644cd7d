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


DECODE_STEPS_CPP = r"""
// The small steps of a decode layer, for one token: each a loop over a few hundred floats.
static void rms_norm_row(const float* x, const float* w, int64_t n, double eps, float* out) {
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / (float)n + (float)eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

static void rope_row(float* x, const float* cos, const float* sin, int64_t D) {  // rotate_half's pairs (i, i + D/2)
  for (int64_t i = 0; i < D / 2; ++i) {
    const float a = x[i], b = x[i + D / 2];
    x[i] = a * cos[i] - b * sin[i];
    x[i + D / 2] = b * cos[i + D / 2] + a * sin[i + D / 2];
  }
}

static inline float dot(const float* a, const float* b, int64_t D) {  // D a multiple of LANES
  fvec acc = fset(0.f);
  for (int64_t i = 0; i < D; i += LANES) acc = fmadd(floads(a + i), floads(b + i), acc);
  return fsum(acc);
}

// H query heads (H, D) attend to positions 0..n-1 of their kv head's cache (Hkv, S, D); out (H, D)
static void attend_one(const float* q, const float* k, const float* v, int64_t H, int64_t Hkv, int64_t S,
                       int64_t D, int64_t n, float* out) {
  const float scale = 1.f / std::sqrt((float)D);
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> p(n);
    for (int64_t h = h0; h < h1; ++h) {
      const float *kh = k + h / (H / Hkv) * S * D, *vh = v + h / (H / Hkv) * S * D;  // GQA: a shared kv head
      float top = -INFINITY, total = 0.f;
      for (int64_t s = 0; s < n; ++s) top = std::max(top, p[s] = dot(q + h * D, kh + s * D, D) * scale);
      for (int64_t s = 0; s < n; ++s) total += p[s] = std::exp(p[s] - top);
      float* o = out + h * D;
      std::fill(o, o + D, 0.f);
      for (int64_t s = 0; s < n; ++s)
        for (int64_t d = 0; d < D; ++d) o[d] += p[s] * vh[s * D + d];
      for (int64_t d = 0; d < D; ++d) o[d] /= total;
    }
  });
}
"""


INT4_ROW_CPP = r"""
// y (N) = W x (+ bias) for one row x (K): the activations quantized, then the tiles' loop
static void int4_row(const float* x, int64_t K, const at::Tensor& packed, int64_t N, int64_t G,
                     const std::optional<at::Tensor>& bias, float* y) {
  std::vector<int8_t> qx(K);
  std::vector<float> dx(K / 32), sx(K / 32), out(16 * packed.size(0));
  quantize_row(x, K, qx.data(), dx.data(), sx.data());
  int4_rows(qx.data(), dx.data(), sx.data(), 1, K, packed, G, out.data());
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  for (int64_t i = 0; i < N; ++i) y[i] = out[i] + (b ? b[i] : 0.f);
}
"""


DECODE_LAYER_CPP = r"""
// One decoder layer for one token at position pos, as FastLayer.forward: x (1, h) -> (1, h), the
// token's keys and values written into the caches (1, Hkv, S, D). norms: input, post[, q_norm, k_norm];
// packed: qkv, o, gate_up, down; sizes: H, Hkv, D, I, group size; cos, sin: the position's (D,) rows.
at::Tensor decode_layer(const at::Tensor& x, at::TensorList norms, at::TensorList packed,
                        const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef sizes, double eps,
                        at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos, const at::Tensor& cos,
                        const at::Tensor& sin) {
  check_decode(x, norms, packed, biases, sizes, k_cache, v_cache, pos, cos, sin);  // before any size is read
  const int64_t H = sizes[0], Hkv = sizes[1], D = sizes[2], I = sizes[3], g = sizes[4], h = x.size(1);
  const int64_t S = k_cache.size(2), Q = H * D, KV = Hkv * D;
  at::Tensor y = x.clone();  // the residual stream
  float* r = y.data_ptr<float>();
  std::vector<float> normed(std::max(h, I)), qkv(Q + 2 * KV), att(Q), gu(2 * I), delta(h);
  rms_norm_row(r, norms[0].data_ptr<float>(), h, eps, normed.data());
  int4_row(normed.data(), h, packed[0], Q + 2 * KV, h / g, biases[0], qkv.data());
  for (int64_t j = 0; j < H + Hkv; ++j) {  // q's heads, then k's: (Qwen3's per-head norm), RoPE
    float* head = qkv.data() + j * D;
    if (norms.size() == 4) rms_norm_row(head, norms[j < H ? 2 : 3].data_ptr<float>(), D, eps, head);
    rope_row(head, cos.data_ptr<float>(), sin.data_ptr<float>(), D);
  }
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t j = 0; j < Hkv; ++j) {  // the token's key and value, into slot pos of each kv head
    std::memcpy(kc + (j * S + pos) * D, qkv.data() + Q + j * D, D * sizeof(float));
    std::memcpy(vc + (j * S + pos) * D, qkv.data() + Q + KV + j * D, D * sizeof(float));
  }
  attend_one(qkv.data(), kc, vc, H, Hkv, S, D, pos + 1, att.data());
  int4_row(att.data(), Q, packed[1], h, Q / g, biases[1], delta.data());
  for (int64_t i = 0; i < h; ++i) r[i] += delta[i];
  rms_norm_row(r, norms[1].data_ptr<float>(), h, eps, normed.data());
  int4_row(normed.data(), h, packed[2], 2 * I, h / g, biases[2], gu.data());
  for (int64_t i = 0; i < I; ++i) normed[i] = gu[i] / (1.f + std::exp(-gu[i])) * gu[I + i];  // SwiGLU
  int4_row(normed.data(), I, packed[3], h, I / g, biases[3], delta.data());
  for (int64_t i = 0; i < h; ++i) r[i] += delta[i];
  return y;
}
"""


CHECK_DECODE_CPP = r"""
static void check_decode(const at::Tensor& x, at::TensorList norms, at::TensorList packed,
                         const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef sizes,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t pos, const at::Tensor& cos,
                         const at::Tensor& sin) {
  check(x, at::kFloat, "x");
  TORCH_CHECK(x.size(0) == 1 && sizes.size() == 5 && (norms.size() == 2 || norms.size() == 4) && packed.size() == 4
              && biases.size() == 4, "decode_layer: one token, 5 sizes, 2 or 4 norms, 4 matrices and 4 biases");
  const int64_t H = sizes[0], Hkv = sizes[1], D = sizes[2], I = sizes[3], g = sizes[4], h = x.size(1);
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && D % 16 == 0 && g % 32 == 0 && h % g == 0 && I % g == 0
              && (H * D) % g == 0, "decode_layer: sizes ", sizes, " do not fit hidden size ", h);
  const int64_t N[4] = {(H + 2 * Hkv) * D, h, 2 * I, h}, K[4] = {h, H * D, h, I};
  for (int i = 0; i < 4; ++i) {
    check(packed[i], at::kByte, "packed");
    check_int4(packed[i], N[i], K[i], K[i] / g);
    const auto& b = biases.get(i);
    TORCH_CHECK(!b || (b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == N[i]),
                "decode_layer: bias ", i, " must be ", N[i], " contiguous floats");
  }
  for (size_t i = 0; i < norms.size(); ++i)
    TORCH_CHECK(norms[i].scalar_type() == at::kFloat && norms[i].is_contiguous() && norms[i].numel() == (i < 2 ? h : D),
                "decode_layer: norm ", i, " must be ", i < 2 ? h : D, " contiguous floats");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous() && c->dim() == 4 && c->size(0) == 1
                && c->size(1) == Hkv && c->size(3) == D && c->sizes() == k_cache.sizes(),
                "decode_layer: caches must be contiguous float (1, ", Hkv, ", S, ", D, "), got ", c->sizes());
  TORCH_CHECK(0 <= pos && pos < k_cache.size(2), "decode_layer: position ", pos, " outside the cache's ",
              k_cache.size(2), " slots");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous()
              && sin.is_contiguous() && cos.numel() == D && sin.numel() == D, "decode_layer: cos and sin must be ", D,
              " contiguous floats");
}
"""


REGISTER_CPP = r"""
TORCH_LIBRARY(minillm_cpu, lib) {  // the schemas; what they return, for torch.compile, is told in Python
  lib.def("int4_matmul(Tensor x, Tensor packed, int N, int G) -> Tensor");
  lib.def("int8_matvec(Tensor x, Tensor w, Tensor s) -> Tensor");
  lib.def("decode_layer(Tensor x, Tensor[] norms, Tensor[] packed, Tensor?[] biases, int[] sizes, float eps, "
          "Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm_cpu, CPU, lib) {
  lib.impl("int4_matmul", int4_matmul);
  lib.impl("int8_matvec", int8_matvec);
  lib.impl("decode_layer", decode_layer);
}
"""

HEADER_CPP = """#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
"""
KERNEL_CPP = (HEADER_CPP + ACTIVATIONS_CPP + WIDE_CPP + NARROW_CPP + INT4_TILE_CPP + INT8_HELPERS_CPP + INT8_ROWS_CPP
              + CHECKS_CPP + INT4_ROWS_CPP + INT4_OP_CPP + INT8_OP_CPP + DECODE_STEPS_CPP + INT4_ROW_CPP
              + CHECK_DECODE_CPP + DECODE_LAYER_CPP + REGISTER_CPP)
