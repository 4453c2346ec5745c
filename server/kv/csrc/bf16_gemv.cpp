// A bf16 linear product for a decode step's few rows (1 to 8), each weight read once for all of them.
//
// At a decode step a small model's products are a read of every weight: they cost what streaming the weights
// from memory costs. oneDNN's kernels, called on 1 to 8 rows, read them at under half of this CPU's bandwidth
// (docs/architecture.md, "Linear products at decode"). This kernel reads a copy of the weight laid out for it
// (`bf16_gemv_pack`): blocks of 16 outputs, each block one contiguous run of K / 2 vectors, vector p holding the
// 16 outputs' weights at inputs 2p and 2p + 1, so a block is one stream the prefetcher follows, and a vector
// times a broadcast pair of inputs (AVX512-BF16) adds to 16 outputs at once, with no reduction across lanes. The
// blocks are split among the threads. A product's sums are in one fixed order: an output adds the pairs 2p, 2p+1
// of even p in turn into one float, those of odd p into another, then the two, then the bias, rounded to bf16 to
// nearest even. So a row's result does not depend on which or how many rows share the call; it is not oneDNN's
// (another order): the engine uses this kernel only outside deterministic mode.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace {

constexpr int64_t kLanes = 16;  // outputs in a block
#ifndef KAHEAD
#define KAHEAD 48
#endif
constexpr int64_t kAhead = KAHEAD;  // vectors (64 bytes each) prefetched ahead of the one read

#if defined(__AVX512BF16__)
template <int R>
__attribute__((always_inline)) inline void block(const uint32_t* x, int64_t pairs, const uint32_t* w,
                                                const uint16_t* bias, uint16_t* out, int64_t n, int64_t n0) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 1 < pairs; p += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (p + kAhead) * kLanes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (p + kAhead + 1) * kLanes), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * kLanes);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + (p + 1) * kLanes);
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], w0, (__m512bh)_mm512_set1_epi32(x[r * pairs + p]));
      odd[r] = _mm512_dpbf16_ps(odd[r], w1, (__m512bh)_mm512_set1_epi32(x[r * pairs + p + 1]));
    }
  }
  if (p < pairs) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * kLanes);
    for (int r = 0; r < R; ++r)
      even[r] = _mm512_dpbf16_ps(even[r], w0, (__m512bh)_mm512_set1_epi32(x[r * pairs + p]));
  }
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n0));
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  for (int r = 0; r < R; ++r) {
    const __m512 sums = _mm512_add_ps(_mm512_add_ps(even[r], odd[r]), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * n + n0), (__m256i)_mm512_cvtneps_pbh(sums));
  }
}

template <int R>
void product(const uint32_t* x, int64_t pairs, const uint32_t* w, const uint16_t* bias, uint16_t* out, int64_t n) {
  const int64_t blocks = n / kLanes;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) block<R>(x, pairs, w + i * pairs * kLanes, bias, out, n, i * kLanes);
  });
}
#endif

bool bf16_gemv_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// [N, K] -> blocks of 16 outputs: [N / 16, K / 2, 16] pairs of bf16 (N a multiple of 16, K even).
at::Tensor bf16_gemv_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "bf16_gemv_pack: a bf16 [N, K] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kLanes == 0 && k % 2 == 0, "bf16_gemv_pack: N a multiple of 16 and K even");
  return weight.contiguous().view({n / kLanes, kLanes, k / 2, 2}).transpose(1, 2).contiguous();
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_gemv_available(), "bf16_gemv: this build has no AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16_gemv: bf16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_gemv: a weight from bf16_gemv_pack");
  const int64_t n = packed.size(0) * kLanes, pairs = packed.size(1), k = 2 * pairs;
  TORCH_CHECK(x.size(-1) == k, "bf16_gemv: x's last size is not the weight's K");
  const at::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m = rows.size(0);
  TORCH_CHECK(m >= 1 && m <= 8, "bf16_gemv: 1 to 8 rows");
  const uint16_t* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n, "bf16_gemv: a bf16 bias of N values");
    bias_c = bias->contiguous();
    b = reinterpret_cast<const uint16_t*>(bias_c.data_ptr());
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
  kvserve::bf16_gemv_into(reinterpret_cast<const uint16_t*>(rows.data_ptr()), m, packed, b,
                          reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

}  // namespace

namespace kvserve {
void bf16_gemv_into(const uint16_t* x, int64_t m, const at::Tensor& packed, const uint16_t* bias, uint16_t* out) {
#if defined(__AVX512BF16__)
  const int64_t n = packed.size(0) * kLanes, pairs = packed.size(1);
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  switch (m) {
    case 1: product<1>(xp, pairs, wp, bias, out, n); break;
    case 2: product<2>(xp, pairs, wp, bias, out, n); break;
    case 3: product<3>(xp, pairs, wp, bias, out, n); break;
    case 4: product<4>(xp, pairs, wp, bias, out, n); break;
    case 5: product<5>(xp, pairs, wp, bias, out, n); break;
    case 6: product<6>(xp, pairs, wp, bias, out, n); break;
    case 7: product<7>(xp, pairs, wp, bias, out, n); break;
    default: product<8>(xp, pairs, wp, bias, out, n); break;
  }
#else
  TORCH_CHECK(false, "bf16_gemv: this build has no AVX512-BF16");
#endif
}
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("bf16_gemv(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("bf16_gemv_pack(Tensor weight) -> Tensor");
  m.def("bf16_gemv_available() -> bool", &bf16_gemv_available);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("bf16_gemv", &bf16_gemv);
  m.impl("bf16_gemv_pack", &bf16_gemv_pack);
}
