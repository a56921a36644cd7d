# Generated from notebooks/A4_a_cpu_kernel.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The C++ source of appendix A4's decode layer (step 5), as strings, and the whole kernel's, joined.

Built in notebooks/A4_a_cpu_kernel.ipynb on steps 1 to 4 (minillm/speed/cpu_kernel_cpp.py): a decoder
layer's decode tokens in one call, with notebook 08's dense cache or notebook 15's paged pool.
"""

from minillm.speed.cpu_kernel_cpp import (ACTIVATIONS_CPP, CHECKS_CPP, INT4_OP_CPP, INT4_ROWS_CPP, INT4_TILE_CPP,
                                          INT8_HELPERS_CPP, INT8_OP_CPP, INT8_ROWS_CPP, NARROW_CPP, WIDE_CPP)

DECODE_STEPS_CPP = r"""
// The small steps of a decode layer, per token: each a loop over a few hundred floats.
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
"""


ATTEND_CPP = r"""
// Where a layer's keys and values lie: key p of kv head j for row b starts at
// k + slot * slot_stride + j * head_stride, slot = tables[b][p / block] * block + p % block. Notebook 08's
// dense cache (1, Hkv, S, D) is one block of S slots, D floats apart, its heads S * D apart; notebook 15's
// pool (N, bs, Hkv, D) has blocks of bs slots, Hkv * D apart, heads D apart, found through block tables.
struct KeyLayout {
  float *k, *v;
  int64_t slot_stride, head_stride, block;
  const int64_t* tables;  // (B, width) each row's blocks
  int64_t width;
  int64_t at(int64_t b, int64_t p, int64_t j) const {
    return (tables[b * width + p / block] * block + p % block) * slot_stride + j * head_stride;
  }
};

// Row b's H query heads (q + b * stride: (H, D)) attend to its keys 0..lengths[b]-1; out (B, H * D)
static void attend_rows(const float* q, int64_t stride, const KeyLayout& kv, const int64_t* lengths, int64_t B,
                        int64_t H, int64_t Hkv, int64_t D, float* out) {
  const float scale = 1.f / std::sqrt((float)D);
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {  // (row, head) pairs over torch's threads
    std::vector<float> p;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, j = i % H / (H / Hkv), n = lengths[b];  // GQA: H / Hkv heads share kv head j
      const float* qh = q + b * stride + i % H * D;
      p.resize(n);
      float top = -INFINITY, total = 0.f;
      for (int64_t s = 0; s < n; ++s) top = std::max(top, p[s] = dot(qh, kv.k + kv.at(b, s, j), D) * scale);
      for (int64_t s = 0; s < n; ++s) total += p[s] = std::exp(p[s] - top);
      float* o = out + i * D;
      std::fill(o, o + D, 0.f);
      for (int64_t s = 0; s < n; ++s) {
        const float* vs = kv.v + kv.at(b, s, j);
        for (int64_t d = 0; d < D; ++d) o[d] += p[s] * vs[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= total;
    }
  });
}
"""


INT4_PRODUCT_CPP = r"""
// y (M, N) = x (M, K) W^T (+ bias) for M rows: each row quantized, then the tiles' loop over all of them
static void int4_product(const float* x, int64_t M, int64_t K, const at::Tensor& packed, int64_t N, int64_t G,
                         const std::optional<at::Tensor>& bias, float* y) {
  const int64_t NP = 16 * packed.size(0);  // N rounded up to whole tiles
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * K / 32), sx(M * K / 32), out(M * NP);
  for (int64_t i = 0; i < M; ++i)
    quantize_row(x + i * K, K, qx.data() + i * K, dx.data() + i * K / 32, sx.data() + i * K / 32);
  int4_rows(qx.data(), dx.data(), sx.data(), M, K, packed, G, out.data());
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) y[i * N + n] = out[i * NP + n] + (b ? b[n] : 0.f);
}
"""


LAYER_ROWS_CPP = r"""
// B tokens, one per sequence, through a decoder layer as FastLayer.forward: r (B, h), the residual stream,
// updated in place. Token b sits at position lengths[b] - 1: its key and value go there, and it attends to
// keys 0..lengths[b] - 1. norms: input, post[, q_norm, k_norm]; packed: qkv, o, gate_up, down; sizes: H, Hkv,
// D, I, group size; cos, sin: (B, D), each token's angles.
static void layer_rows(float* r, int64_t B, int64_t h, at::TensorList norms, at::TensorList packed,
                       const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef sizes, double eps,
                       const KeyLayout& kv, const int64_t* lengths, const float* cos, const float* sin) {
  const int64_t H = sizes[0], Hkv = sizes[1], D = sizes[2], I = sizes[3], g = sizes[4], Q = H * D, KV = Hkv * D;
  const int64_t W = Q + 2 * KV;  // a token's q, k and v side by side
  std::vector<float> normed(B * h), qkv(B * W), att(B * Q), gu(B * 2 * I), act(B * I), delta(B * h);
  for (int64_t b = 0; b < B; ++b) rms_norm_row(r + b * h, norms[0].data_ptr<float>(), h, eps, normed.data() + b * h);
  int4_product(normed.data(), B, h, packed[0], W, h / g, biases[0], qkv.data());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < H + Hkv; ++j) {  // q's heads, then k's: (Qwen3's per-head norm), RoPE
      float* head = qkv.data() + b * W + j * D;
      if (norms.size() == 4) rms_norm_row(head, norms[j < H ? 2 : 3].data_ptr<float>(), D, eps, head);
      rope_row(head, cos + b * D, sin + b * D, D);
    }
    for (int64_t j = 0; j < Hkv; ++j) {  // the token's key and value, into its slot of each kv head
      const int64_t at = kv.at(b, lengths[b] - 1, j);
      std::memcpy(kv.k + at, qkv.data() + b * W + Q + j * D, D * sizeof(float));
      std::memcpy(kv.v + at, qkv.data() + b * W + Q + KV + j * D, D * sizeof(float));
    }
  }
  attend_rows(qkv.data(), W, kv, lengths, B, H, Hkv, D, att.data());
  int4_product(att.data(), B, Q, packed[1], h, Q / g, biases[1], delta.data());
  for (int64_t i = 0; i < B * h; ++i) r[i] += delta[i];
  for (int64_t b = 0; b < B; ++b) rms_norm_row(r + b * h, norms[1].data_ptr<float>(), h, eps, normed.data() + b * h);
  int4_product(normed.data(), B, h, packed[2], 2 * I, h / g, biases[2], gu.data());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < I; ++i) {  // SwiGLU: silu(gate) * up
      const float gate = gu[b * 2 * I + i];
      act[b * I + i] = gate / (1.f + std::exp(-gate)) * gu[b * 2 * I + I + i];
    }
  int4_product(act.data(), B, I, packed[3], h, I / g, biases[3], delta.data());
  for (int64_t i = 0; i < B * h; ++i) r[i] += delta[i];
}
"""


DECODE_LAYER_CPP = r"""
// One token at position pos with notebook 08's dense cache (1, Hkv, S, D): x (1, h) -> (1, h); cos, sin (D,)
at::Tensor decode_layer(const at::Tensor& x, at::TensorList norms, at::TensorList packed,
                        const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef sizes, double eps,
                        at::Tensor& k_cache, at::Tensor& v_cache, int64_t pos, const at::Tensor& cos,
                        const at::Tensor& sin) {
  check_layer(x, norms, packed, biases, sizes, cos, sin);  // before any size is read
  check_dense(x, sizes, k_cache, v_cache, pos);
  const int64_t S = k_cache.size(2), D = sizes[2], table = 0, length = pos + 1;
  const KeyLayout kv{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), D, S * D, S, &table, 1};
  at::Tensor y = x.clone();  // the residual stream
  layer_rows(y.data_ptr<float>(), 1, x.size(1), norms, packed, biases, sizes, eps, kv, &length,
             cos.data_ptr<float>(), sin.data_ptr<float>());
  return y;
}

// B tokens, one per sequence, with notebook 15's pool (N, bs, Hkv, D): tables (B, width) each sequence's
// blocks, lengths (B,) its tokens counting the new one; x (B, h) -> (B, h); cos, sin (B, D)
at::Tensor decode_layer_paged(const at::Tensor& x, at::TensorList norms, at::TensorList packed,
                              const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef sizes, double eps,
                              at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& tables,
                              const at::Tensor& lengths, const at::Tensor& cos, const at::Tensor& sin) {
  check_layer(x, norms, packed, biases, sizes, cos, sin);
  check_paged(x, sizes, k_pool, v_pool, tables, lengths);
  const int64_t Hkv = sizes[1], D = sizes[2];
  const KeyLayout kv{k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), Hkv * D, D, k_pool.size(1),
                     tables.data_ptr<int64_t>(), tables.size(1)};
  at::Tensor y = x.clone();
  layer_rows(y.data_ptr<float>(), x.size(0), x.size(1), norms, packed, biases, sizes, eps, kv,
             lengths.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
  return y;
}
"""


CHECK_LAYER_CPP = r"""
static void check_layer(const at::Tensor& x, at::TensorList norms, at::TensorList packed,
                        const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef sizes,
                        const at::Tensor& cos, const at::Tensor& sin) {
  check(x, at::kFloat, "x");
  TORCH_CHECK(x.size(0) > 0 && sizes.size() == 5 && (norms.size() == 2 || norms.size() == 4) && packed.size() == 4
              && biases.size() == 4, "decode_layer: tokens (B, h), 5 sizes, 2 or 4 norms, 4 matrices and 4 biases");
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
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous()
              && sin.is_contiguous() && cos.numel() == x.size(0) * D && sin.numel() == x.size(0) * D,
              "decode_layer: cos and sin must be ", x.size(0), " x ", D, " contiguous floats");
}
"""


CHECK_CACHES_CPP = r"""
static void check_kv(const at::Tensor& k, const at::Tensor& v, int64_t Hkv, int64_t D, int head_dim, const char* want) {
  for (const at::Tensor* c : {&k, &v})
    TORCH_CHECK(c->device().is_cpu() && c->scalar_type() == at::kFloat && c->is_contiguous() && c->dim() == 4
                && c->size(head_dim) == Hkv && c->size(3) == D && c->sizes() == k.sizes(),
                "decode_layer: caches must be contiguous float ", want, ", got ", c->sizes());
}

static void check_dense(const at::Tensor& x, at::IntArrayRef sizes, const at::Tensor& k, const at::Tensor& v,
                        int64_t pos) {
  TORCH_CHECK(x.size(0) == 1, "decode_layer: one token with a dense cache, got ", x.size(0));
  check_kv(k, v, sizes[1], sizes[2], 1, "(1, Hkv, S, D)");
  TORCH_CHECK(k.size(0) == 1 && 0 <= pos && pos < k.size(2), "decode_layer: position ", pos,
              " outside the cache's ", k.size(2), " slots");
}

static void check_paged(const at::Tensor& x, at::IntArrayRef sizes, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& tables, const at::Tensor& lengths) {
  check_kv(k, v, sizes[1], sizes[2], 2, "(N, bs, Hkv, D)");
  check(tables, at::kLong, "tables");
  TORCH_CHECK(tables.size(0) == x.size(0) && tables.size(1) > 0 && lengths.scalar_type() == at::kLong
              && lengths.is_contiguous() && lengths.dim() == 1 && lengths.size(0) == x.size(0),
              "decode_layer_paged: a block table (B, width) and a length (B,) per token, got ", tables.sizes(),
              " and ", lengths.sizes(), " for ", x.size(0), " tokens");
  const int64_t *t = tables.data_ptr<int64_t>(), *n = lengths.data_ptr<int64_t>(), bs = k.size(1);
  for (int64_t b = 0; b < x.size(0); ++b) {  // every slot a token reads or writes is in the pool
    TORCH_CHECK(0 < n[b] && n[b] <= tables.size(1) * bs, "decode_layer_paged: length ", n[b], " of row ", b,
                " outside 1..", tables.size(1) * bs);
    for (int64_t i = 0; i < (n[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(0 <= t[b * tables.size(1) + i] && t[b * tables.size(1) + i] < k.size(0), "decode_layer_paged: block ",
                  t[b * tables.size(1) + i], " of row ", b, " outside the pool's ", k.size(0));
  }
}
"""


REGISTER_CPP = r"""
TORCH_LIBRARY(minillm_cpu, lib) {  // the schemas; what they return, for torch.compile, is told in Python
  lib.def("int4_matmul(Tensor x, Tensor packed, int N, int G) -> Tensor");
  lib.def("int8_matvec(Tensor x, Tensor w, Tensor s) -> Tensor");
  lib.def("decode_layer(Tensor x, Tensor[] norms, Tensor[] packed, Tensor?[] biases, int[] sizes, float eps, "
          "Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, Tensor cos, Tensor sin) -> Tensor");
  lib.def("decode_layer_paged(Tensor x, Tensor[] norms, Tensor[] packed, Tensor?[] biases, int[] sizes, float eps, "
          "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor tables, Tensor lengths, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm_cpu, CPU, lib) {
  lib.impl("int4_matmul", int4_matmul);
  lib.impl("int8_matvec", int8_matvec);
  lib.impl("decode_layer", decode_layer);
  lib.impl("decode_layer_paged", decode_layer_paged);
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
              + CHECKS_CPP + INT4_ROWS_CPP + INT4_OP_CPP + INT8_OP_CPP + DECODE_STEPS_CPP + ATTEND_CPP + INT4_PRODUCT_CPP
              + CHECK_LAYER_CPP + CHECK_CACHES_CPP + LAYER_ROWS_CPP + DECODE_LAYER_CPP + REGISTER_CPP)
