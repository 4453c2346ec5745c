// What our kernels share across their files: a decode step's products and attention, called from the fused
// decode step (decode_step.cpp) without a trip through the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kvserve {

// out[m, N] = x[m, K] @ W.T (+ bias), W packed by bf16_gemv_pack; 1 <= m <= 8, bf16 (bf16_gemv.cpp).
void bf16_gemv_into(const uint16_t* x, int64_t m, const at::Tensor& packed, const uint16_t* bias, uint16_t* out);

// kvserve::paged_decode without cascade heads, window or softcap (paged_decode.cpp).
void paged_decode_into(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& out,
                       const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                       int64_t block_size, double scale);

// kvserve::paged_decode_rows (the tiled walk) without cascade heads (paged_prefill.cpp).
void paged_decode_rows_into(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            at::Tensor& out, const at::Tensor& rows, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size, double scale);

}  // namespace kvserve
