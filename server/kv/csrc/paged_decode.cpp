// Paged attention for decode rows on the CPU: every sequence of a step that feeds one token, in one call.
//
// Each decode row's query attends to its sequence's context where it lies in the pool, read through the
// sequence's block table: no K/V is gathered or copied. Work is split over (row, kv head) pairs; each pair
// walks its context one block at a time with an online softmax (scores, running max and sum in the opmath
// type: float for bf16/fp16/fp32, double for fp64), so the G query heads sharing a kv head read each key and
// value once. The new token's own K/V must already be in the pool (the caller writes it first).
//
//   query        [T, H, D]       the packed row's queries (any strides; D contiguous)
//   k_pool/v_pool [kvH, S, D]    the layer's pool (contiguous), in the query's dtype; or quantized (int8, fp8 e4m3)
//                 [kvH, S, D + 4] rows: D values then their float32 scale (server/kv/pool.py), dequantized as read
//   out          [T, H, D]       written at the decode rows only (D contiguous)
//   rows         [B] int32       which rows of the packed row are decode rows
//   block_tables [B, M] int32    each decode row's blocks, in order
//   context_lens [B] int32       keys each decode row attends to (its own token is the last)
//   window > 0: a key is visible when (ctx - 1) - key_pos < window; softcap > 0: tanh(s / cap) * cap.
//
// A row may come with its head already attended (cascade attention: keys a group of rows share, done by the
// caller in one batched call): first_keys[b] > 0 says keys 0 .. first_keys[b] - 1 are done, head_out[b] holds
// their attention output and head_lse[b] the log of their softmax sum per query head. The row's online softmax
// then starts from that state (max = lse, sum = 1, acc = head_out) and walks only keys first_keys[b] .. ctx - 1,
// which gives the attention over the whole context. Rows with a head come first (b < head_out.size(0)); heads
// are taken only without window or softcap. first_keys, head_out and head_lse are empty when no row has one.
//
//   first_keys   [B] int32                 or empty
//   head_out     [Bh, H, D] query's dtype  (D contiguous) or empty
//   head_lse     [Bh, H] opmath dtype      (float; double for fp64) or empty

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Converts n contiguous elements to the accumulation type (a plain loop the compiler vectorizes).
template <typename scalar_t, typename acc_t>
inline void load(acc_t* dst, const scalar_t* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t>(src[i]);
}

template <>
inline void load<c10::BFloat16, float>(float* dst, const c10::BFloat16* src, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;  // bf16 is fp32's top half
}

// The value of every fp8 e4m3 bit pattern, built once.
inline const float* fp8_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

template <typename cache_t>
constexpr bool kQuantized = std::is_same_v<cache_t, int8_t> || std::is_same_v<cache_t, c10::Float8_e4m3fn>;

// n rows of the pool as `dim` values each, in the accumulation type. A quantized row is `dim` values and its
// float32 scale (`width` = dim + 4 elements): each value times its row's scale. Otherwise rows are contiguous.
template <typename cache_t, typename acc_t>
inline void load_rows(acc_t* dst, const cache_t* src, int64_t n, int64_t dim, int64_t width) {
  if constexpr (kQuantized<cache_t>) {
    for (int64_t j = 0; j < n; ++j) {
      const cache_t* row = src + j * width;
      float scale;
      std::memcpy(&scale, row + dim, sizeof(float));
      acc_t* out = dst + j * dim;
      if constexpr (std::is_same_v<cache_t, int8_t>) {
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<acc_t>(static_cast<float>(row[d]) * scale);
      } else {  // fp8: each of the 256 bit patterns' value looked up (c10's conversion is bit by bit, per value)
        const uint8_t* bits = reinterpret_cast<const uint8_t*>(row);
        const float* values = fp8_values();
        for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<acc_t>(values[bits[d]] * scale);
      }
    }
  } else {
    load(dst, src, n * dim);
  }
}

// scores[j] = q . keys[j] for n keys of `dim` elements, four keys at a time: four independent sums keep the
// vector units busy where one sum at a time would wait on each horizontal add.
template <typename acc_t>
inline void dot_keys(const acc_t* q, const acc_t* keys, acc_t* scores, int64_t n, int64_t dim) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const acc_t *k0 = keys + j * dim, *k1 = k0 + dim, *k2 = k1 + dim, *k3 = k2 + dim;
    acc_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t d = 0; d < dim; ++d) {
      s0 += q[d] * k0[d];
      s1 += q[d] * k1[d];
      s2 += q[d] * k2[d];
      s3 += q[d] * k3[d];
    }
    scores[j] = s0;
    scores[j + 1] = s1;
    scores[j + 2] = s2;
    scores[j + 3] = s3;
  }
  for (; j < n; ++j) {
    const acc_t* k = keys + j * dim;
    acc_t s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < dim; ++d) s += q[d] * k[d];
    scores[j] = s;
  }
}

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
// The bf16 form: pairs of bf16 products summed into fp32 by one AVX512-BF16 instruction (vdpbf16ps), read
// straight from the pool with no conversion; `dim` is a multiple of 32. `q` is unscaled: the scale comes after.
inline void dot_keys_bf16(const c10::BFloat16* q, const c10::BFloat16* keys, float* scores, int64_t n, int64_t dim,
                          float scale) {
  auto at = [](const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const c10::BFloat16* k0 = keys + j * dim;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512bh qd = at(q + d);
      s0 = _mm512_dpbf16_ps(s0, qd, at(k0 + d));
      s1 = _mm512_dpbf16_ps(s1, qd, at(k0 + dim + d));
      s2 = _mm512_dpbf16_ps(s2, qd, at(k0 + 2 * dim + d));
      s3 = _mm512_dpbf16_ps(s3, qd, at(k0 + 3 * dim + d));
    }
    scores[j] = _mm512_reduce_add_ps(s0) * scale;
    scores[j + 1] = _mm512_reduce_add_ps(s1) * scale;
    scores[j + 2] = _mm512_reduce_add_ps(s2) * scale;
    scores[j + 3] = _mm512_reduce_add_ps(s3) * scale;
  }
  for (; j < n; ++j) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 32) s = _mm512_dpbf16_ps(s, at(q + d), at(keys + j * dim + d));
    scores[j] = _mm512_reduce_add_ps(s) * scale;
  }
}
#else
constexpr bool kHasBf16Dot = false;
inline void dot_keys_bf16(const c10::BFloat16*, const c10::BFloat16*, float*, int64_t, int64_t, float) {}
#endif

// acc = acc * correction + sum_j p[j] * values[j], sixteen lanes of acc at a time: each lane's running sum stays
// in a register across the block's keys instead of going through memory once per key.
template <typename acc_t>
inline void accumulate_values(acc_t* acc, acc_t correction, const acc_t* p, const acc_t* values, int64_t n,
                              int64_t dim) {
  constexpr int64_t kLanes = 16;
  int64_t d0 = 0;
  for (; d0 + kLanes <= dim; d0 += kLanes) {
    acc_t lane[kLanes];
#pragma omp simd
    for (int64_t t = 0; t < kLanes; ++t) lane[t] = acc[d0 + t] * correction;
    for (int64_t j = 0; j < n; ++j) {
      const acc_t pj = p[j];
      const acc_t* row = values + j * dim + d0;
#pragma omp simd
      for (int64_t t = 0; t < kLanes; ++t) lane[t] += pj * row[t];
    }
#pragma omp simd
    for (int64_t t = 0; t < kLanes; ++t) acc[d0 + t] = lane[t];
  }
  for (; d0 < dim; ++d0) {  // a head size that is not a multiple of 16
    acc_t sum = acc[d0] * correction;
    for (int64_t j = 0; j < n; ++j) sum += p[j] * values[j * dim + d0];
    acc[d0] = sum;
  }
}

template <typename scalar_t, typename cache_t>
void decode_rows(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& out,
                 const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                 const at::Tensor& first_keys, const at::Tensor& head_out, const at::Tensor& head_lse,
                 int64_t block_size, int64_t window, double scale, double softcap) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_rows = rows.size(0), num_heads = query.size(1), dim = query.size(2);
  const int64_t num_kv_heads = k_pool.size(0), pool_slots = k_pool.size(1), width = k_pool.size(2);
  const int64_t groups = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* k_ptr = k_pool.data_ptr<cache_t>();
  const cache_t* v_ptr = v_pool.data_ptr<cache_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* row_ids = rows.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* starts = first_keys.numel() > 0 ? first_keys.data_ptr<int32_t>() : nullptr;
  const scalar_t* h_out = head_out.numel() > 0 ? head_out.data_ptr<scalar_t>() : nullptr;
  const acc_t* h_lse = head_lse.numel() > 0 ? head_lse.data_ptr<acc_t>() : nullptr;
  const int64_t ho_row = head_out.numel() > 0 ? head_out.stride(0) : 0, ho_head = head_out.numel() > 0 ? head_out.stride(1) : 0;
  const int64_t hl_row = head_lse.numel() > 0 ? head_lse.stride(0) : 0, hl_head = head_lse.numel() > 0 ? head_lse.stride(1) : 0;
  const acc_t cap = static_cast<acc_t>(softcap);
  const acc_t lowest = std::numeric_limits<acc_t>::lowest();  // not -inf: built with -ffast-math
  constexpr bool kSameType = std::is_same_v<scalar_t, cache_t>;
  const bool bf16_dot = kSameType && std::is_same_v<scalar_t, c10::BFloat16> && kHasBf16Dot && dim % 32 == 0;

  at::parallel_for(0, num_rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> q(groups * dim), acc(groups * dim), scores(groups * block_size), run_max(groups), run_sum(groups);
    std::vector<acc_t> keys(block_size * dim), values(block_size * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t row = row_ids[b], ctx = lens[b];
      const int64_t start = starts != nullptr ? starts[b] : 0;
      const int64_t lo = std::max<int64_t>(start, window > 0 ? ctx - window : 0);
      for (int64_t g = 0; g < groups; ++g) {
        load(q.data() + g * dim, q_ptr + row * q_row + (kv_head * groups + g) * q_head, dim);
        for (int64_t d = 0; d < dim; ++d) q[g * dim + d] *= static_cast<acc_t>(scale);
      }
      if (start > 0) {  // the head's softmax state: its output is acc / sum with sum = 1 at max = its lse
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t h = kv_head * groups + g;
          load(acc.data() + g * dim, h_out + b * ho_row + h * ho_head, dim);
          run_max[g] = h_lse[b * hl_row + h * hl_head];
          run_sum[g] = acc_t(1);
        }
      } else {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        std::fill(run_max.begin(), run_max.end(), lowest);
        std::fill(run_sum.begin(), run_sum.end(), acc_t(0));
      }
      const cache_t* k_head = k_ptr + kv_head * pool_slots * width;
      const cache_t* v_head = v_ptr + kv_head * pool_slots * width;
      for (int64_t blk = lo / block_size; blk * block_size < ctx; ++blk) {
        // A block's slots are consecutive: its keys (and values) are one contiguous run of n rows.
        const int64_t first = std::max(lo, blk * block_size), last = std::min(ctx, (blk + 1) * block_size);
        const int64_t n = last - first;
        const int64_t slot0 = static_cast<int64_t>(tables[b * max_blocks + blk]) * block_size + (first - blk * block_size);
        if (!bf16_dot) load_rows(keys.data(), k_head + slot0 * width, n, dim, width);
        load_rows(values.data(), v_head + slot0 * width, n, dim, width);
        for (int64_t g = 0; g < groups; ++g) {
          const acc_t* qg = q.data() + g * dim;
          acc_t* sg = scores.data() + g * block_size;
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && kSameType) {
            if (bf16_dot) {
              const scalar_t* q_raw = q_ptr + row * q_row + (kv_head * groups + g) * q_head;
              dot_keys_bf16(q_raw, k_head + slot0 * width, sg, n, dim, static_cast<float>(scale));
            } else {
              dot_keys(qg, keys.data(), sg, n, dim);
            }
          } else {
            dot_keys(qg, keys.data(), sg, n, dim);
          }
          if (softcap > 0) {
            for (int64_t j = 0; j < n; ++j) sg[j] = std::tanh(sg[j] / cap) * cap;
          }
          acc_t new_max = run_max[g];
          for (int64_t j = 0; j < n; ++j) new_max = std::max(new_max, sg[j]);
          const acc_t correction = std::exp(run_max[g] - new_max);
          acc_t block_sum = 0;
#pragma omp simd reduction(+ : block_sum)
          for (int64_t j = 0; j < n; ++j) {
            sg[j] = std::exp(sg[j] - new_max);
            block_sum += sg[j];
          }
          run_sum[g] = run_sum[g] * correction + block_sum;
          run_max[g] = new_max;
          acc_t* ag = acc.data() + g * dim;
          accumulate_values(ag, correction, sg, values.data(), n, dim);
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        scalar_t* dst = o_ptr + row * o_row + (kv_head * groups + g) * o_head;
        const acc_t inv = acc_t(1) / run_sum[g];
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * dim + d] * inv);
      }
    }
  });
}

void paged_decode(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& out,
                  const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                  const at::Tensor& first_keys, const at::Tensor& head_out, const at::Tensor& head_lse,
                  int64_t block_size, int64_t window, double scale, double softcap) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && k_pool.dim() == 3, "paged_decode: query/out [T,H,D], pool [kvH,S,D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "paged_decode: the head dimension must be contiguous");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "paged_decode: the pool must be contiguous");
  const bool quantized = k_pool.scalar_type() == at::kChar || k_pool.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((quantized || query.scalar_type() == k_pool.scalar_type()) && out.scalar_type() == query.scalar_type() &&
                  v_pool.scalar_type() == k_pool.scalar_type(),
              "paged_decode: query and out share a dtype, and the pool has it unless it is quantized (int8, fp8)");
  TORCH_CHECK(query.size(1) % k_pool.size(0) == 0, "paged_decode: heads must be a multiple of kv heads");
  TORCH_CHECK(rows.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt,
              "paged_decode: rows, block tables and context lengths are int32");
  TORCH_CHECK(rows.is_contiguous() && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode: metadata must be contiguous");
  const int64_t num_rows = rows.size(0), width = block_tables.size(1);
  TORCH_CHECK(query.size(2) + (quantized ? 4 : 0) == k_pool.size(2) && v_pool.sizes() == k_pool.sizes() &&
                  out.sizes() == query.sizes(),
              "paged_decode: head sizes and shapes must agree (a quantized row holds its scale after the values)");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_rows && context_lens.size(0) == num_rows,
              "paged_decode: one block table and one context length per row");
  const int64_t num_blocks = k_pool.size(1) / block_size;
  const int32_t* row_ids = rows.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const bool has_heads = first_keys.numel() > 0;
  const int64_t num_heads_given = has_heads ? head_out.size(0) : 0;
  if (has_heads) {
    TORCH_CHECK(first_keys.scalar_type() == at::kInt && first_keys.is_contiguous() && first_keys.size(0) == num_rows,
                "paged_decode: first_keys is int32, one per row");
    TORCH_CHECK(window == 0 && softcap == 0, "paged_decode: heads are taken only without window and softcap");
    TORCH_CHECK(!quantized, "paged_decode: heads are taken only on a pool that is not quantized");
    TORCH_CHECK(head_out.dim() == 3 && head_out.size(1) == query.size(1) && head_out.size(2) == query.size(2) &&
                    head_out.stride(2) == 1 && head_out.scalar_type() == query.scalar_type(),
                "paged_decode: head_out is [Bh, H, D] in the query's dtype, D contiguous");
    TORCH_CHECK(head_lse.dim() == 2 && head_lse.size(0) == num_heads_given && head_lse.size(1) == query.size(1) &&
                    head_lse.scalar_type() == at::toOpMathType(query.scalar_type()),
                "paged_decode: head_lse is [Bh, H] in the opmath dtype");
  }
  const int32_t* starts = has_heads ? first_keys.data_ptr<int32_t>() : nullptr;
  for (int64_t b = 0; b < num_rows; ++b) {  // every index the kernel will follow, checked before it runs
    TORCH_CHECK(row_ids[b] >= 0 && row_ids[b] < query.size(0), "paged_decode: row ", row_ids[b], " out of range");
    const int64_t ctx = lens[b];
    TORCH_CHECK(ctx >= 1 && ctx <= width * block_size, "paged_decode: context ", ctx, " does not fit its table");
    if (starts != nullptr) {
      TORCH_CHECK(starts[b] >= 0 && starts[b] < ctx, "paged_decode: a head must leave the row's own key");
      TORCH_CHECK(starts[b] == 0 || b < num_heads_given, "paged_decode: row ", b, " has a head but no head output");
    }
    for (int64_t blk = 0; blk * block_size < ctx; ++blk) {
      const int32_t id = tables[b * width + blk];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode: block ", id, " is not in the pool");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    if (k_pool.scalar_type() == at::kChar) {
      decode_rows<scalar_t, int8_t>(query, k_pool, v_pool, out, rows, block_tables, context_lens, first_keys,
                                    head_out, head_lse, block_size, window, scale, softcap);
    } else if (k_pool.scalar_type() == at::kFloat8_e4m3fn) {
      decode_rows<scalar_t, c10::Float8_e4m3fn>(query, k_pool, v_pool, out, rows, block_tables, context_lens,
                                                first_keys, head_out, head_lse, block_size, window, scale, softcap);
    } else {
      decode_rows<scalar_t, scalar_t>(query, k_pool, v_pool, out, rows, block_tables, context_lens, first_keys,
                                      head_out, head_lse, block_size, window, scale, softcap);
    }
  });
}

// How many threads at::parallel_for shares a range of n items among here. It is a header template: built
// without OpenMP it runs the whole range on the calling thread, and so would every kernel (tests check).
int64_t parallel_threads(int64_t n) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << std::min<int64_t>(at::get_thread_num(), 63));
  });
  return __builtin_popcountll(seen.load());
}

}  // namespace

namespace kvserve {
void paged_decode_into(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& out,
                       const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                       int64_t block_size, double scale) {
  static const at::Tensor empty = at::empty({0});
  paged_decode(query, k_pool, v_pool, out, rows, block_tables, context_lens, empty, empty, empty, block_size, 0, scale,
               0.0);
}
}  // namespace kvserve

TORCH_LIBRARY(kvserve, m) {
  m.def(
      "paged_decode(Tensor query, Tensor k_pool, Tensor v_pool, Tensor(a!) out, Tensor rows, Tensor block_tables, "
      "Tensor context_lens, Tensor first_keys, Tensor head_out, Tensor head_lse, int block_size, int window, "
      "float scale, float softcap) -> ()");
  m.def("parallel_threads(int n) -> int", &parallel_threads);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode", &paged_decode); }
