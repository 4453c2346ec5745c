// A decode step of a Llama-family decoder in one call: every layer's norms, products, rotary, K/V writes and
// attention for a step's few rows (1 to 8, one token each), bf16 on a CPU with AVX512-BF16.
//
// transformers' modules run ~35 small torch calls a layer, each a trip through Python and the dispatcher and
// several a fork and join of the OpenMP team; at a decode step's few rows their cost is the step's (on a 2-core
// EPYC, the default model's products took 8 ms of a 15 ms step). Here the small work (RMSNorm, rotary, SiLU
// times up, residual adds) is plain loops on the calling thread, and only the products (bf16_gemv.cpp) and the
// attention (paged_decode.cpp) share a layer among the threads: five parallel regions a layer, no Python.
//
// Each value is rounded to bf16 where transformers' modules round it, in their order (the engine's tests hold
// the step's logits to the modules' on the same rows):
//   RMSNorm     h = bf16(x * rsqrt(mean(x^2) + eps)) in float32, then bf16(weight * h)
//   rotary      bf16(bf16(q * cos) + bf16(rotate_half(q) * sin)), cos and sin given in bf16 (the model's own
//               rotary embedding makes them: every rope type and its scaling stays transformers')
//   MLP         bf16(bf16(silu(gate)) * up), residuals bf16(x + y)
// Sums differ from ATen's in order only (RMSNorm's mean, the products' blocks), so results may differ in the
// last bit: the engine uses this step only outside deterministic mode, as it does bf16_gemv.
//
//   hidden        [T, E] bf16          the rows' embeddings (T = 1 .. 8)
//   cos, sin      [T, D] bf16          the rows' rotary factors
//   slots         [T] int64            where each row's new K/V goes in the pool
//   rows, block_tables, context_lens   the rows for the attention (int32; every row a decode row), attended by
//                                      paged_decode_rows' tiled walk (tiled) or paged_decode
//   per layer     input norm [E], qkv [(H + 2 kvH) D, E] and its bias (or none), o [E, H D], post norm [E],
//                 gate_up [2 I, E], down [E, I]: the products packed by bf16_gemv_pack; k/v pools [kvH, S, D]
//   returns       [T, E] bf16          the final norm's output (the LM head's input)

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

inline float widen(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline uint16_t round_bf16(float x) { return c10::BFloat16(x).x; }  // to nearest even, as ATen rounds

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* bits_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// transformers' LlamaRMSNorm on m rows of e values.
void rms_norm(const uint16_t* x, const uint16_t* weight, int64_t m, int64_t e, float eps, uint16_t* out) {
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* row = x + r * e;
    float sum = 0.f;
    for (int64_t i = 0; i < e; ++i) {
      const float v = widen(row[i]);
      sum += v * v;
    }
    const float scale = 1.f / std::sqrt(sum / static_cast<float>(e) + eps);
    for (int64_t i = 0; i < e; ++i)
      out[r * e + i] = round_bf16(widen(weight[i]) * widen(round_bf16(widen(row[i]) * scale)));
  }
}

// One head's rotary: q*cos + rotate_half(q)*sin, each product and the sum rounded to bf16.
inline void rotate(const uint16_t* q, const uint16_t* cos, const uint16_t* sin, int64_t d, uint16_t* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float turned = i < half ? -widen(q[i + half]) : widen(q[i - half]);
    const float a = widen(round_bf16(widen(q[i]) * widen(cos[i])));
    const float b = widen(round_bf16(turned * widen(sin[i])));
    out[i] = round_bf16(a + b);
  }
}

inline void add_into(uint16_t* x, const uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(widen(x[i]) + widen(y[i]));
}

void check_packed(const at::Tensor& w, int64_t out, int64_t in, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 4 && w.is_contiguous() && w.size(0) * 16 == out &&
                  w.size(1) * 2 == in && w.size(2) == 16 && w.size(3) == 2,
              "decode_step: ", what, " must be a [", out, ", ", in, "] weight packed by bf16_gemv_pack");
}

void check_vector(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == n, "decode_step: ", what,
              " must be ", n, " contiguous bf16 values");
}

at::Tensor decode_step(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                       const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                       at::TensorList input_norms, at::TensorList qkv, at::TensorList qkv_bias, at::TensorList o,
                       at::TensorList post_norms, at::TensorList gate_up, at::TensorList down, at::TensorList k_pools,
                       at::TensorList v_pools, const at::Tensor& final_norm, int64_t num_heads, int64_t num_kv_heads,
                       int64_t block_size, double eps, double scale, bool tiled) {
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.dim() == 2 && hidden.is_contiguous(),
              "decode_step: hidden is [T, E] contiguous bf16");
  const int64_t m = hidden.size(0), e = hidden.size(1), layers = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(m >= 1 && m <= 8, "decode_step: 1 to 8 rows");
  TORCH_CHECK(layers >= 1 && qkv.size() == input_norms.size() && o.size() == input_norms.size() &&
                  post_norms.size() == input_norms.size() && gate_up.size() == input_norms.size() &&
                  down.size() == input_norms.size() && k_pools.size() == input_norms.size() &&
                  v_pools.size() == input_norms.size() && (qkv_bias.empty() || qkv_bias.size() == input_norms.size()),
              "decode_step: one of each weight and pool per layer");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_step: heads a multiple of kv heads");
  const int64_t d = k_pools[0].size(2), qkv_n = (num_heads + 2 * num_kv_heads) * d, inter = down[0].size(1) * 2;
  TORCH_CHECK(d % 2 == 0, "decode_step: an even head size");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == m && cos.size(1) == d &&
                  sin.sizes() == cos.sizes(),
              "decode_step: cos and sin are [T, D] contiguous bf16");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == m,
              "decode_step: one int64 slot per row");
  TORCH_CHECK(rows.numel() == m, "decode_step: every row is a decode row");
  check_vector(final_norm, e, "the final norm");
  const int64_t pool_slots = k_pools[0].size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r)
    TORCH_CHECK(slot[r] >= 0 && slot[r] < pool_slots, "decode_step: slot ", slot[r], " is not in the pool");
  for (int64_t l = 0; l < layers; ++l) {  // every weight and pool checked before any is read
    check_vector(input_norms[l], e, "an input norm");
    check_vector(post_norms[l], e, "a post-attention norm");
    check_packed(qkv[l], qkv_n, e, "qkv");
    if (!qkv_bias.empty()) check_vector(qkv_bias[l], qkv_n, "a qkv bias");
    check_packed(o[l], e, num_heads * d, "o");
    check_packed(gate_up[l], 2 * inter, e, "gate_up");
    check_packed(down[l], e, inter, "down");
    for (const at::Tensor* pool : {&k_pools[l], &v_pools[l]})
      TORCH_CHECK(pool->scalar_type() == at::kBFloat16 && pool->is_contiguous() && pool->dim() == 3 &&
                      pool->size(0) == num_kv_heads && pool->size(1) == pool_slots && pool->size(2) == d,
                  "decode_step: every pool is [kvH, S, D] contiguous bf16");
  }
  const auto options = hidden.options();
  at::Tensor x = hidden.clone();  // the residual stream
  at::Tensor h = at::empty({m, e}, options);
  at::Tensor projected = at::empty({m, qkv_n}, options);
  at::Tensor query = at::empty({m, num_heads, d}, options);
  at::Tensor attended = at::empty({m, num_heads, d}, options);
  at::Tensor y = at::empty({m, e}, options);
  at::Tensor gated = at::empty({m, 2 * inter}, options);
  at::Tensor act = at::empty({m, inter}, options);
  uint16_t *xs = bits_mut(x), *hs = bits_mut(h), *ps = bits_mut(projected), *qs = bits_mut(query);
  uint16_t *ys = bits_mut(y), *gs = bits_mut(gated), *as = bits_mut(act);
  const uint16_t *cs = bits(cos), *ss = bits(sin);
  const float epsilon = static_cast<float>(eps);
  for (int64_t l = 0; l < layers; ++l) {
    rms_norm(xs, bits(input_norms[l]), m, e, epsilon, hs);
    kvserve::bf16_gemv_into(hs, m, qkv[l], qkv_bias.empty() ? nullptr : bits(qkv_bias[l]), ps);
    at::Tensor k_pool = k_pools[l], v_pool = v_pools[l];
    uint16_t *kp = bits_mut(k_pool), *vp = bits_mut(v_pool);
    for (int64_t r = 0; r < m; ++r) {
      const uint16_t* row = ps + r * qkv_n;
      const uint16_t *c = cs + r * d, *s = ss + r * d;
      for (int64_t head = 0; head < num_heads; ++head) rotate(row + head * d, c, s, d, qs + (r * num_heads + head) * d);
      for (int64_t head = 0; head < num_kv_heads; ++head) {
        const int64_t at_slot = (head * pool_slots + slot[r]) * d;
        rotate(row + (num_heads + head) * d, c, s, d, kp + at_slot);
        std::memcpy(vp + at_slot, row + (num_heads + num_kv_heads + head) * d, d * sizeof(uint16_t));
      }
    }
    if (tiled)
      kvserve::paged_decode_rows_into(query, k_pool, v_pool, attended, rows, block_tables, context_lens, block_size,
                                      scale);
    else
      kvserve::paged_decode_into(query, k_pool, v_pool, attended, rows, block_tables, context_lens, block_size, scale);
    kvserve::bf16_gemv_into(bits(attended), m, o[l], nullptr, ys);
    add_into(xs, ys, m * e);
    rms_norm(xs, bits(post_norms[l]), m, e, epsilon, hs);
    kvserve::bf16_gemv_into(hs, m, gate_up[l], nullptr, gs);
    for (int64_t r = 0; r < m; ++r) {
      const uint16_t* g = gs + r * 2 * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float gate = widen(g[i]);
        const float silu = widen(round_bf16(gate / (1.f + std::exp(-gate))));
        as[r * inter + i] = round_bf16(silu * widen(g[inter + i]));
      }
    }
    kvserve::bf16_gemv_into(as, m, down[l], nullptr, ys);
    add_into(xs, ys, m * e);
  }
  at::Tensor normed = at::empty({m, e}, options);
  rms_norm(xs, bits(final_norm), m, e, epsilon, bits_mut(normed));
  return normed;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "decode_step(Tensor hidden, Tensor cos, Tensor sin, Tensor slots, Tensor rows, Tensor block_tables, "
      "Tensor context_lens, Tensor[] input_norms, Tensor[] qkv, Tensor[] qkv_bias, Tensor[] o, Tensor[] post_norms, "
      "Tensor[] gate_up, Tensor[] down, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, Tensor final_norm, int num_heads, "
      "int num_kv_heads, int block_size, float eps, float scale, bool tiled) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("decode_step", &decode_step); }
