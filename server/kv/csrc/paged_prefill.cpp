// Paged attention for prefill chunks on the CPU (bf16, AVX512-BF16): every multi-token span of a step, in one
// call, reading each span's context where it lies in the pool through its block table (no gather, no mask).
//
// A span is a sequence's chunk of q_len new tokens at the end of its ctx_len keys (its own K/V already written
// to the pool by the caller): query token i sits at position ctx_len - q_len + i and sees keys 0 .. that
// position. Work runs in two parallel phases:
//   1. per (span, kv head): the context's keys are laid out once in the AVX512-BF16 pair layout (16 keys in the
//      lanes, two head dimensions per 32-bit lane) and its values converted to fp32, 16 keys per tile;
//   2. per (span, kv head, query head of the group, R consecutive tokens): the R rows walk the tiles up to the
//      last token's position with an online softmax. Scores come from vdpbf16ps (each key tile read once for
//      R rows); the output accumulates in registers in fp32 (probabilities times fp32 values). The rows of a
//      tile past a row's own position are masked; keys past the context are zero and always masked.
//
//   query        [T, H, D] bf16  the packed row's queries (any strides; D contiguous)
//   k_pool/v_pool [kvH, S, D]    the layer's pool (contiguous, bf16)
//   out          [T, H, D] bf16  written at the spans' rows only (D contiguous)
//   q_starts     [N] int32       each span's first row in the packed row
//   q_lens       [N] int32       its tokens
//   context_lens [N] int32       its keys (its own tokens last)
//   block_tables [N, M] int32    its blocks, in order
// D is 64 or 128. No sliding window and no softcap (the caller sends those spans to SDPA).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 16;  // keys per tile: one zmm of fp32 scores
constexpr int kTiles = 4;      // tiles per softmax update: its max, rescale and sums are paid once per 64 keys
// Keys per partition: a row's keys are walked a partition at a time, each from a fresh state, and the partitions'
// states merged in order. Cut by key position, so the same for every path; it lets a long decode row's
// partitions run on several threads at once (a batch of one row has as few items as kv heads otherwise).
constexpr int64_t kPart = 256;
std::atomic<int64_t> scratch_limit{int64_t{64} << 20};  // bytes of key/value layout one pass may hold
std::atomic<int64_t> passes_run{0};                      // passes since load (tests count them)

int64_t paged_prefill_passes() { return passes_run.load(); }

// Sets the scratch limit when bytes > 0 (tests make passes small); returns the limit before.
int64_t paged_prefill_scratch_limit(int64_t bytes) {
  return bytes > 0 ? scratch_limit.exchange(bytes) : scratch_limit.load();
}

#if defined(__AVX512BF16__)
constexpr bool kAvailable = true;

// A span's kv heads h0 .. h1 - 1 in one pass of the kernel (a step's spans and heads are cut into passes whose
// key and value layouts fit the scratch limit together).
struct SpanLayout {
  int64_t q_start, q_len, ctx, tiles;
  int64_t kt_offset, vf_offset;  // into the scratch buffers, for head h0; each further head adds its size
  int64_t table_row, h0, h1;     // its row of the block tables; its kv heads in this pass
};

// e^x for x <= 0 in 16 lanes: 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor series to r^6
// (relative error below 4e-7, as fine as fp32 resolves); x below -88 gives at most 2^-127, a zero next to the
// row's largest term e^0 = 1.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts: r stays exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The R rows' scores against one tile of keys: two sums per row (twice the independent chains for the units'
// latency), kept in registers: the caller's arrays are written once, at the end.
template <int D, int R>
__attribute__((always_inline)) inline void scores(__m512* out, const uint32_t* kb, const uint32_t* const* q32) {
  constexpr int DP = D / 2;
  __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  for (int c = 0; c < DP; c += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + c * kTile);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + (c + 1) * kTile);
    e0 = _mm512_dpbf16_ps(e0, k0, (__m512bh)_mm512_set1_epi32(q32[0][c]));
    o0 = _mm512_dpbf16_ps(o0, k1, (__m512bh)_mm512_set1_epi32(q32[0][c + 1]));
    e1 = _mm512_dpbf16_ps(e1, k0, (__m512bh)_mm512_set1_epi32(q32[1][c]));
    o1 = _mm512_dpbf16_ps(o1, k1, (__m512bh)_mm512_set1_epi32(q32[1][c + 1]));
    if constexpr (R > 2) {
      e2 = _mm512_dpbf16_ps(e2, k0, (__m512bh)_mm512_set1_epi32(q32[2][c]));
      o2 = _mm512_dpbf16_ps(o2, k1, (__m512bh)_mm512_set1_epi32(q32[2][c + 1]));
      e3 = _mm512_dpbf16_ps(e3, k0, (__m512bh)_mm512_set1_epi32(q32[3][c]));
      o3 = _mm512_dpbf16_ps(o3, k1, (__m512bh)_mm512_set1_epi32(q32[3][c + 1]));
    }
  }
  out[0] = _mm512_add_ps(e0, o0);
  out[1] = _mm512_add_ps(e1, o1);
  if constexpr (R > 2) {
    out[2] = _mm512_add_ps(e2, o2);
    out[3] = _mm512_add_ps(e3, o3);
  }
}

// acc[r] += sum over key pairs jp of the pair's probabilities times its values, 16 head dimensions a vector;
// the accumulators are copied into locals for the loop (the compiler keeps those in registers).
template <int D, int R>
__attribute__((always_inline)) inline void accumulate_values(__m512 (*acc)[D / 16], const uint32_t* vb,
                                                             const uint32_t (*pairs)[kTiles * kTile / 2], int n) {
  constexpr int DV = D / 16, NA = R * DV;
  static_assert(NA <= 16, "R rows of D / 16 vectors: at most 16 accumulators");
  __m512 a[NA];
#pragma GCC unroll 16
  for (int i = 0; i < NA; ++i) a[i] = acc[i / DV][i % DV];
  for (int jp = 0; jp < n; ++jp) {
    __m512bh p[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) p[r] = (__m512bh)_mm512_set1_epi32(pairs[r][jp]);
#pragma GCC unroll 16
    for (int i = 0; i < NA; ++i) {
      a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(vb + jp * D + (i % DV) * 16), p[i / DV]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NA; ++i) acc[i / DV][i % DV] = a[i];
}

// The online softmax of R rows part way through their keys: what one walk over some key tiles leaves for the
// walk over the next ones. A row's numbers depend on its own query and keys only (never on the other rows it is
// walked with), and every path (prefill chunks, decode rows, cascade heads and the tails that resume them) walks
// a row's keys in the same steps of kTiles tiles from key 0: so a token's attention comes out bit for bit the same
// whichever path computed it.
template <int D, int R>
struct Walk {
  __m512 acc[R][D / 16];
  float run_max[R], run_sum[R];
};

template <int D, int R>
inline void walk_start(Walk<D, R>& w) {
  const float lowest = std::numeric_limits<float>::lowest();  // not -inf: built with -ffast-math
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < D / 16; ++v) w.acc[r][v] = _mm512_setzero_ps();
    w.run_max[r] = lowest;
    w.run_sum[r] = 0.f;
  }
}

// One softmax update of the walk: `tiles` (1 .. kTiles) key tiles, the first holding key first_key, laid out at kt
// (keys) and vt (values) as lay_out_tiles writes them. Keys past a row's position are masked. Not inlined: every
// path runs this one machine code, so no caller's optimisation can round a row otherwise.
template <int D, int R>
__attribute__((noinline)) void walk_step(Walk<D, R>& w, const uint32_t* kt, const uint32_t* vt, int tiles,
                                         int64_t first_key, const uint32_t* const* q32, const int64_t* row_pos,
                                         float scale) {
  constexpr int DV = D / 16, DP = D / 2;
  const float lowest = std::numeric_limits<float>::lowest();
  alignas(64) float p[R][kTiles * kTile];
  alignas(64) uint32_t pairs[R][kTiles * kTile / 2];
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 scale_v = _mm512_set1_ps(scale);
  // scores of the tiles, scaled and masked, into p
  for (int tt = 0; tt < tiles; ++tt) {
    const uint32_t* kb = kt + tt * DP * kTile;
    __m512 sc[R];
    scores<D, R>(sc, kb, q32);
    const int64_t key0 = first_key + tt * kTile;
    for (int r = 0; r < R; ++r) {
      __m512 x = _mm512_mul_ps(sc[r], scale_v);
      if (key0 + kTile - 1 > row_pos[r]) {  // keys past this row's position: masked
        const __m512 limit = _mm512_set1_ps(static_cast<float>(row_pos[r] - key0));
        x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(lane, limit, _CMP_GT_OQ), _mm512_set1_ps(lowest));
      }
      _mm512_store_ps(p[r] + tt * kTile, x);
    }
  }
  for (int r = 0; r < R; ++r) {  // the online softmax, once per kTiles tiles
    __m512 m = _mm512_load_ps(p[r]);
    for (int tt = 1; tt < tiles; ++tt) m = _mm512_max_ps(m, _mm512_load_ps(p[r] + tt * kTile));
    const float new_max = std::max(w.run_max[r], _mm512_reduce_max_ps(m));
    const __m512 max_v = _mm512_set1_ps(new_max);
    const float correction = _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(w.run_max[r] - new_max)));
    float* pr = p[r];
    __m512 sum = _mm512_setzero_ps();
    for (int tt = 0; tt < tiles; ++tt) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(pr + tt * kTile), max_v));
      _mm512_store_ps(pr + tt * kTile, e);
      sum = _mm512_add_ps(sum, e);
    }
    w.run_sum[r] = w.run_sum[r] * correction + _mm512_reduce_add_ps(sum);
    w.run_max[r] = new_max;
    for (int tt = 0; tt < tiles; ++tt) {
      const __m256bh half = _mm512_cvtneps_pbh(_mm512_load_ps(pr + tt * kTile));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r] + tt * (kTile / 2)), (__m256i)half);
    }
    const __m512 corr = _mm512_set1_ps(correction);
    for (int v = 0; v < DV; ++v) w.acc[r][v] = _mm512_mul_ps(w.acc[r][v], corr);
  }
  // values: pairs of keys in each 32-bit lane, one lane per head dimension; probabilities in bf16 pairs
  accumulate_values<D, R>(w.acc, vt, pairs, tiles * kTile / 2);
}

// Folds one partition's walk into the merged walk of the partitions before it, for the rows that saw a key of it
// (seen[r]; a partition wholly past a row's position leaves the row as it was). The first fold of an empty total
// gives the partition's own state exactly (its old sum and accumulator are zeros times a factor near 2^-127). Not
// inlined, for the same reason as walk_step.
template <int D, int R>
__attribute__((noinline)) void merge_part(Walk<D, R>& total, const Walk<D, R>& part, const bool* seen) {
  for (int r = 0; r < R; ++r) {
    if (!seen[r]) continue;
    const float m = std::max(total.run_max[r], part.run_max[r]);
    const float ct = _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(total.run_max[r] - m)));
    const float cp = _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(part.run_max[r] - m)));
    total.run_sum[r] = total.run_sum[r] * ct + part.run_sum[r] * cp;
    const __m512 vt = _mm512_set1_ps(ct), vp = _mm512_set1_ps(cp);
    for (int v = 0; v < D / 16; ++v) {
      total.acc[r][v] = _mm512_fmadd_ps(part.acc[r][v], vp, _mm512_mul_ps(total.acc[r][v], vt));
    }
    total.run_max[r] = m;
  }
}

// A walk's rows as 32-bit words, to keep in memory between the threads that walk a row's partitions and the one that
// merges them: per row its D accumulators, then its max and sum.
template <int D, int R>
inline void store_walk(const Walk<D, R>& w, float* dst) {
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < D / 16; ++v) _mm512_storeu_ps(dst + r * (D + 2) + v * 16, w.acc[r][v]);
    dst[r * (D + 2) + D] = w.run_max[r];
    dst[r * (D + 2) + D + 1] = w.run_sum[r];
  }
}

template <int D, int R>
inline void load_walk(Walk<D, R>& w, const float* src) {
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < D / 16; ++v) w.acc[r][v] = _mm512_loadu_ps(src + r * (D + 2) + v * 16);
    w.run_max[r] = src[r * (D + 2) + D];
    w.run_sum[r] = src[r * (D + 2) + D + 1];
  }
}

// Where a walk's rows go when it ends: their attention (bf16), or the walk's state itself (fp32 acc, max and sum per row: a head that a tail walk resumes exactly).
struct RowsOut {
  uint16_t* dst[4] = {};  // [D] bf16 per row, or null
  float* acc[4] = {};     // [D] fp32 per row: the unnormalised output (with max and sum), or null
  float* max[4] = {};
  float* sum[4] = {};
};

template <int D, int R>
void walk_finish(const Walk<D, R>& w, int rows, const RowsOut& out) {
  constexpr int DV = D / 16;
  for (int r = 0; r < rows; ++r) {
    if (out.acc[r] != nullptr) {
      for (int v = 0; v < DV; ++v) _mm512_storeu_ps(out.acc[r] + v * 16, w.acc[r][v]);
      *out.max[r] = w.run_max[r];
      *out.sum[r] = w.run_sum[r];
    }
    if (out.dst[r] != nullptr) {
      const __m512 inv = _mm512_set1_ps(1.f / w.run_sum[r]);
      for (int v = 0; v < DV; ++v) {
        const __m256bh half = _mm512_cvtneps_pbh(_mm512_mul_ps(w.acc[r][v], inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.dst[r] + v * 16), (__m256i)half);
      }
    }
  }
}

// R rows (R consecutive tokens of one query head) over a laid-out context, from key 0 to the last row's position: a
// partition at a time, each merged into the total of those before it.
template <int D, int R>
void rows_of_group(const uint32_t* kt, const uint32_t* vt, const uint16_t* const* q, const int64_t* pos, int rows,
                   float scale, const RowsOut& out) {
  constexpr int DP = D / 2;
  Walk<D, R> total, part;
  walk_start(total);
  const uint32_t* q32[R];
  int64_t row_pos[R];
  for (int r = 0; r < R; ++r) {
    q32[r] = reinterpret_cast<const uint32_t*>(q[r < rows ? r : rows - 1]);
    row_pos[r] = pos[r < rows ? r : rows - 1];
  }
  const int64_t num_tiles = pos[rows - 1] / kTile + 1;  // tiles holding a key some row sees
  for (int64_t first = 0; first < num_tiles * kTile; first += kPart) {
    walk_start(part);
    const int64_t end = std::min(num_tiles, (first + kPart) / kTile);
    for (int64_t t0 = first / kTile; t0 < end; t0 += kTiles) {
      const int tiles = static_cast<int>(std::min<int64_t>(kTiles, end - t0));
      walk_step<D, R>(part, kt + t0 * DP * kTile, vt + t0 * (kTile / 2) * D, tiles, t0 * kTile, q32, row_pos, scale);
    }
    bool seen[R];
    for (int r = 0; r < R; ++r) seen[r] = first <= row_pos[r];
    merge_part(total, part, seen);
  }
  walk_finish(total, rows, out);
}

// 16 vectors of 16 32-bit words transposed in place: word c of vector l becomes word l of vector c. Unpacks of
// 32- and 64-bit words within 128-bit lanes, then a 4 x 4 transpose of the 128-bit lanes (64 shuffles in all).
inline void transpose16(__m512i* r) {
  __m512i t[16], s[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int m = 0; m < 4; ++m) {  // s[4m + c] lane j: word 4j + c of vectors 4m .. 4m + 3
    s[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
    s[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
    s[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
    s[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(s[c], s[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(s[c], s[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Tiles t0 .. t1 - 1 of one kv head's context of ctx keys, read through its block table, written from kdst / vdst32
// on (tile t at t - t0): keys in the AVX512-BF16 pair layout (pair c of 16 keys' rows in one vector: 16 keys across
// the lanes), values with keys 2jp and 2jp + 1 interleaved (one lane per head dimension). Keys past the context are
// zeros (always masked).
template <int D>
void lay_out_tiles(uint32_t* kdst, uint32_t* vdst32, const uint32_t* k_head, const uint16_t* v_head,
                   const int32_t* table, int64_t block_size, int64_t ctx, int64_t t0, int64_t t1) {
  constexpr int DP = D / 2;
  uint16_t* vdst = reinterpret_cast<uint16_t*>(vdst32);
  alignas(64) static const uint16_t zeros[D] = {};
  // bf16 pairs (a[i], b[i]): lanes 2i and 2i + 1 of the output take a's and b's element i
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 32; ++i) {
    lo_idx[i] = static_cast<uint16_t>((i % 2 ? 32 : 0) + i / 2);
    hi_idx[i] = static_cast<uint16_t>((i % 2 ? 32 : 0) + 16 + i / 2);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t t = t0; t < t1; ++t) {
    const uint32_t* krows[kTile];
    const uint16_t* vrows[kTile];
    for (int l = 0; l < kTile; ++l) {
      const int64_t key = t * kTile + l;
      if (key < ctx) {
        const int64_t slot = static_cast<int64_t>(table[key / block_size]) * block_size + key % block_size;
        krows[l] = k_head + slot * DP;
        vrows[l] = v_head + slot * D;
      } else {
        krows[l] = reinterpret_cast<const uint32_t*>(zeros);
        vrows[l] = zeros;
      }
    }
    uint32_t* kt_tile = kdst + (t - t0) * DP * kTile;
    // keys: 16 rows of DP 32-bit pairs transposed, 16 pairs at a time (a 16 x 16 transpose of 32-bit words)
    for (int c0 = 0; c0 < DP; c0 += 16) {
      __m512i r[16];
#pragma GCC unroll 16
      for (int l = 0; l < 16; ++l) r[l] = _mm512_loadu_si512(krows[l] + c0);
      transpose16(r);
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(kt_tile + (c0 + c) * kTile, r[c]);
    }
    uint16_t* vt_tile = vdst + 2 * (t - t0) * (kTile / 2) * D;
    for (int jp = 0; jp < kTile / 2; ++jp) {
      const uint16_t* a = vrows[2 * jp];
      const uint16_t* b = vrows[2 * jp + 1];
      for (int d = 0; d < D; d += 32) {
        const __m512i va = _mm512_loadu_si512(a + d), vb = _mm512_loadu_si512(b + d);
        uint16_t* dst = vt_tile + 2 * (jp * D + d);
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(va, lo, vb));
        _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(va, hi, vb));
      }
    }
  }
}

// Where attend_laid_out puts each (row, query head)'s result: its attention in bf16, or the walk's state in fp32
// (a cascade head, resumed by the tail walk of paged_decode_rows).
struct Sink {
  uint16_t* out = nullptr;  // [T, H, D] bf16
  int64_t out_row = 0, out_head = 0;
  float* acc = nullptr;  // [n, H, D] fp32, and max, sum [n, H]
  float* max = nullptr;
  float* sum = nullptr;
  int64_t acc_row = 0, acc_head = 0, st_row = 0, st_head = 0;
};

// Phase 2: every span's rows against its laid-out keys and values (kt, vf as lay_out_tiles writes them, at the
// spans' offsets). Items: (span, kv head, group head, group of R tokens); a span's groups are numbered from its base.
template <int D>
void attend_laid_out(const at::Tensor& query, const Sink& sink, const std::vector<SpanLayout>& spans,
                     const uint32_t* kt, const uint32_t* vf, int64_t groups, double scale, bool causal) {
  constexpr int DP = D / 2;
  constexpr int R = D == 64 ? 4 : 2;  // rows walked together: their 16 accumulators stay in registers
  const int64_t num_spans = static_cast<int64_t>(spans.size());
  std::vector<int64_t> first_item(num_spans + 1, 0);
  for (int64_t si = 0; si < num_spans; ++si) {
    first_item[si + 1] = first_item[si] + (spans[si].h1 - spans[si].h0) * groups * ((spans[si].q_len + R - 1) / R);
  }
  const uint16_t* q_ptr = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  at::parallel_for(0, first_item[num_spans], 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t si = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const SpanLayout& s = spans[si];
      const int64_t local = item - first_item[si];
      const int64_t num_groups = (s.q_len + R - 1) / R;
      const int64_t h = s.h0 + local / (groups * num_groups), g = (local / num_groups) % groups;
      const int64_t grp = local % num_groups;
      const int64_t head = h * groups + g, i0 = grp * R;
      const int rows = static_cast<int>(std::min<int64_t>(R, s.q_len - i0));
      const uint16_t* q[R];
      int64_t pos[R];
      RowsOut out;
      for (int r = 0; r < rows; ++r) {
        const int64_t row = s.q_start + i0 + r;
        q[r] = q_ptr + row * q_row + head * q_head;
        pos[r] = causal ? s.ctx - s.q_len + i0 + r : s.ctx - 1;  // not causal: every row sees every key
        if (sink.out != nullptr) out.dst[r] = sink.out + row * sink.out_row + head * sink.out_head;
        if (sink.acc != nullptr) {
          out.acc[r] = sink.acc + row * sink.acc_row + head * sink.acc_head;
          out.max[r] = sink.max + row * sink.st_row + head * sink.st_head;
          out.sum[r] = sink.sum + row * sink.st_row + head * sink.st_head;
        }
      }
      const uint32_t* kh = kt + s.kt_offset + (h - s.h0) * s.tiles * kTile * DP;
      const uint32_t* vh = vf + s.vf_offset + (h - s.h0) * s.tiles * (kTile / 2) * D;
      rows_of_group<D, R>(kh, vh, q, pos, rows, static_cast<float>(scale), out);
    }
  });
}

template <int D>
void prefill(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, const Sink& sink,
             const std::vector<SpanLayout>& spans, const int32_t* tables, int64_t max_blocks, int64_t block_size,
             double scale, bool causal) {
  constexpr int DP = D / 2;
  const int64_t num_heads = query.size(1), num_kv_heads = k_pool.size(0), pool_slots = k_pool.size(1);
  const int64_t groups = num_heads / num_kv_heads;
  int64_t kt_total = 0, vf_total = 0;
  for (const auto& s : spans) {
    kt_total = std::max(kt_total, s.kt_offset + (s.h1 - s.h0) * s.tiles * kTile * DP);
    vf_total = std::max(vf_total, s.vf_offset + (s.h1 - s.h0) * s.tiles * (kTile / 2) * D);
  }
  // Scratch of the calling thread, grown when a step needs more (every element is written before it is read).
  static thread_local std::vector<uint32_t> kt_buffer;
  static thread_local std::vector<uint32_t> vf_buffer;
  if (static_cast<int64_t>(kt_buffer.size()) < kt_total) kt_buffer.resize(kt_total);
  if (static_cast<int64_t>(vf_buffer.size()) < vf_total) vf_buffer.resize(vf_total);
  uint32_t* const kt = kt_buffer.data();
  uint32_t* const vf = vf_buffer.data();
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(k_pool.data_ptr<at::BFloat16>());
  const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>());
  const int64_t num_spans = static_cast<int64_t>(spans.size());
  std::vector<int64_t> first_pair(num_spans + 1, 0);  // phase 1 items: (span, kv head) pairs
  for (int64_t si = 0; si < num_spans; ++si) first_pair[si + 1] = first_pair[si] + spans[si].h1 - spans[si].h0;

  at::parallel_for(0, first_pair[num_spans], 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t si = std::upper_bound(first_pair.begin(), first_pair.end(), item) - first_pair.begin() - 1;
      const SpanLayout& s = spans[si];
      const int64_t h = s.h0 + item - first_pair[si];
      lay_out_tiles<D>(kt + s.kt_offset + (h - s.h0) * s.tiles * kTile * DP,
                       vf + s.vf_offset + (h - s.h0) * s.tiles * (kTile / 2) * D, k32 + h * pool_slots * DP,
                       v16 + h * pool_slots * D, tables + s.table_row * max_blocks, block_size, s.ctx, 0, s.tiles);
    }
  });

  attend_laid_out<D>(query, sink, spans, kt, vf, groups, scale, causal);
}

// Decode rows (one query token each) walked as every other path walks them, their keys laid out a step's tiles at a
// time in a buffer of the thread's own (no scratch pass over the whole context, nothing kept). Two phases:
//   1. items (row, kv head, group of R query heads, partition): the group's heads walk the partition's keys, so each
//      tile is laid out once for the G query heads sharing its kv head; the partition's state goes to `parts`;
//   2. items (row, kv head, group): the partitions' states merged in order, from the row's head state where it has
//      one (first_keys[b] > 0, a multiple of kPart: the head's partitions merged already), then written out.
template <int D, int R>
void walk_partition(const uint16_t* q_base, int64_t q_head, int heads, const uint32_t* k_head, const uint16_t* v_head,
                    const int32_t* table, int64_t block_size, int64_t ctx, int64_t first, float scale, float* part_out) {
  constexpr int DP = D / 2;
  alignas(64) uint32_t kbuf[kTiles * kTile * DP];
  alignas(64) uint32_t vbuf[kTiles * (kTile / 2) * D];
  Walk<D, R> w;
  walk_start(w);
  const uint32_t* q32[R];
  int64_t row_pos[R];
  for (int r = 0; r < R; ++r) {
    q32[r] = reinterpret_cast<const uint32_t*>(q_base + (r < heads ? r : heads - 1) * q_head);
    row_pos[r] = ctx - 1;
  }
  const int64_t end = std::min((ctx - 1) / kTile + 1, (first + kPart) / kTile);
  for (int64_t t0 = first / kTile; t0 < end; t0 += kTiles) {
    const int64_t t1 = std::min<int64_t>(t0 + kTiles, end);
    lay_out_tiles<D>(kbuf, vbuf, k_head, v_head, table, block_size, ctx, t0, t1);
    walk_step<D, R>(w, kbuf, vbuf, static_cast<int>(t1 - t0), t0 * kTile, q32, row_pos, scale);
  }
  store_walk(w, part_out);
}

template <int D, int R>
void merge_partitions(int heads, const float* parts, int64_t part_stride, int64_t num_parts, const float* acc_in,
                      const float* max_in, const float* sum_in, int64_t acc_head, int64_t st_head, uint16_t* o_base,
                      int64_t o_head) {
  constexpr int DV = D / 16;
  Walk<D, R> total, part;
  walk_start(total);
  if (acc_in != nullptr) {  // the head's partitions, merged by the head's walk
    for (int r = 0; r < heads; ++r) {
      for (int v = 0; v < DV; ++v) total.acc[r][v] = _mm512_loadu_ps(acc_in + r * acc_head + v * 16);
      total.run_max[r] = max_in[r * st_head];
      total.run_sum[r] = sum_in[r * st_head];
    }
  }
  bool seen[R];
  for (int r = 0; r < R; ++r) seen[r] = true;  // a decode row sees every key of each of its partitions
  for (int64_t j = 0; j < num_parts; ++j) {
    load_walk(part, parts + j * part_stride);
    merge_part(total, part, seen);
  }
  RowsOut out;
  for (int r = 0; r < heads; ++r) out.dst[r] = o_base + r * o_head;
  walk_finish(total, heads, out);
}

// R as small as the group: a row's numbers do not depend on R, its cost does.
template <int D, typename F>
void with_rows(int heads, F&& run) {
  constexpr int RMAX = D == 64 ? 4 : 2;
  if (heads == 1) {
    run(std::integral_constant<int, 1>{});
  } else if (heads == 2) {
    run(std::integral_constant<int, 2>{});
  } else if constexpr (RMAX == 4) {
    if (heads == 3) {
      run(std::integral_constant<int, 3>{});
    } else {
      run(std::integral_constant<int, 4>{});
    }
  }
}

template <int D>
void decode_rows_tiled(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& out,
                       const int32_t* row_ids, const int32_t* tables, int64_t max_blocks, const int32_t* lens,
                       const int32_t* starts, const float* acc, const float* max, const float* sum, int64_t num_rows,
                       int64_t acc_row, int64_t acc_head, int64_t st_row, int64_t st_head, int64_t block_size,
                       double scale) {
  constexpr int DP = D / 2;
  constexpr int RMAX = D == 64 ? 4 : 2;
  constexpr int64_t kSlot = RMAX * (D + 2);  // floats of one partition's state
  const int64_t num_heads = query.size(1), kv_heads = k_pool.size(0), pool_slots = k_pool.size(1);
  const int64_t groups = num_heads / kv_heads, head_groups = (groups + RMAX - 1) / RMAX;
  const int64_t lanes = kv_heads * head_groups;  // (kv head, group) pairs of a row
  std::vector<int64_t> first_part(num_rows), num_parts(num_rows), first_item(num_rows + 1, 0);
  for (int64_t b = 0; b < num_rows; ++b) {
    first_part[b] = (starts != nullptr ? starts[b] : 0) / kPart;
    num_parts[b] = (lens[b] + kPart - 1) / kPart - first_part[b];
    first_item[b + 1] = first_item[b] + lanes * num_parts[b];
  }
  std::vector<float> parts(first_item[num_rows] * kSlot);
  const uint16_t* q_ptr = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  uint16_t* o_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(k_pool.data_ptr<at::BFloat16>());
  const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>());
  const int64_t q_row = query.stride(0), q_head = query.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, first_item[num_rows], 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t local = item - first_item[b];
      const int64_t lane = local / num_parts[b], j = first_part[b] + local % num_parts[b];
      const int64_t h = lane / head_groups, g0 = lane % head_groups * RMAX;
      const int heads = static_cast<int>(std::min<int64_t>(RMAX, groups - g0));
      const uint16_t* qb = q_ptr + row_ids[b] * q_row + (h * groups + g0) * q_head;
      const int32_t* table = tables + b * max_blocks;
      float* slot = parts.data() + item * kSlot;
      with_rows<D>(heads, [&](auto r) {
        walk_partition<D, decltype(r)::value>(qb, q_head, heads, k32 + h * pool_slots * DP, v16 + h * pool_slots * D,
                                              table, block_size, lens[b], j * kPart, sc, slot);
      });
    }
  });
  at::parallel_for(0, num_rows * lanes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / lanes, lane = item % lanes;
      const int64_t h = lane / head_groups, g0 = lane % head_groups * RMAX, first_head = h * groups + g0;
      const int heads = static_cast<int>(std::min<int64_t>(RMAX, groups - g0));
      const bool resumes = starts != nullptr && starts[b] > 0;
      const float* a_in = resumes ? acc + b * acc_row + first_head * acc_head : nullptr;
      const float* m_in = resumes ? max + b * st_row + first_head * st_head : nullptr;
      const float* s_in = resumes ? sum + b * st_row + first_head * st_head : nullptr;
      const float* row_parts = parts.data() + (first_item[b] + lane * num_parts[b]) * kSlot;
      uint16_t* ob = o_ptr + row_ids[b] * o_row + first_head * o_head;
      with_rows<D>(heads, [&](auto r) {
        merge_partitions<D, decltype(r)::value>(heads, row_parts, kSlot, num_parts[b], a_in, m_in, s_in, acc_head,
                                                st_head, ob, o_head);
      });
    }
  });
}
#else
constexpr bool kAvailable = false;
#endif

#if defined(__AVX512BF16__)
// Cuts the spans' (span, kv head) pairs into passes whose key and value layouts fit the scratch limit (a pair
// larger than the limit makes a pass of its own) and runs each.
void run_in_passes(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, const Sink& sink,
                   const std::vector<SpanLayout>& spans, const int32_t* tables, int64_t max_blocks, int64_t block_size,
                   double scale, bool causal) {
  const int64_t dim = query.size(2), limit = scratch_limit.load();
  std::vector<SpanLayout> pass;
  int64_t used = 0;
  auto run = [&]() {
    if (pass.empty()) return;
    passes_run.fetch_add(1);
    if (dim == 64) {
      prefill<64>(query, k_pool, v_pool, sink, pass, tables, max_blocks, block_size, scale, causal);
    } else {
      prefill<128>(query, k_pool, v_pool, sink, pass, tables, max_blocks, block_size, scale, causal);
    }
    pass.clear();
    used = 0;
  };
  for (const SpanLayout& span : spans) {
    const int64_t pair_bytes = span.tiles * kTile * dim * 4;  // keys and values of one kv head, 32-bit lanes
    for (int64_t h = span.h0; h < span.h1; ++h) {
      if (used > 0 && used + pair_bytes > limit) run();
      SpanLayout* last = pass.empty() ? nullptr : &pass.back();
      if (last != nullptr && last->table_row == span.table_row && last->q_start == span.q_start && last->h1 == h) {
        last->h1 = h + 1;  // the next head of the same span
      } else {
        SpanLayout piece = span;
        piece.h0 = h;
        piece.h1 = h + 1;
        piece.kt_offset = used / 2 / 4;  // offsets in 32-bit elements: keys and values take half each
        piece.vf_offset = used / 2 / 4;
        pass.push_back(piece);
      }
      used += pair_bytes;
    }
  }
  run();
}
#endif

bool paged_prefill_available(int64_t head_dim) {
  return kAvailable && (head_dim == 64 || head_dim == 128);
}

void check_pool(const char* op, const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool) {
  TORCH_CHECK(paged_prefill_available(query.size(2)), op, ": needs AVX512-BF16 and a head size of 64 or 128");
  TORCH_CHECK(query.dim() == 3 && k_pool.dim() == 3, op, ": query [T,H,D], pool [kvH,S,D]");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && k_pool.scalar_type() == at::kBFloat16 &&
                  v_pool.scalar_type() == at::kBFloat16,
              op, ": bf16 only");
  TORCH_CHECK(query.stride(2) == 1, op, ": the head dimension must be contiguous");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && v_pool.sizes() == k_pool.sizes(), op,
              ": the pool must be contiguous");
  TORCH_CHECK(query.size(2) == k_pool.size(2), op, ": head sizes must agree");
  TORCH_CHECK(query.size(1) % k_pool.size(0) == 0, op, ": heads must be a multiple of kv heads");
}

void paged_prefill(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& out,
                   const at::Tensor& q_starts, const at::Tensor& q_lens, const at::Tensor& context_lens,
                   const at::Tensor& block_tables, int64_t block_size, double scale) {
  check_pool("paged_prefill", query, k_pool, v_pool);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.sizes() == query.sizes() && out.stride(2) == 1,
              "paged_prefill: out is bf16 like the query, D contiguous");
  for (const auto* t : {&q_starts, &q_lens, &context_lens, &block_tables}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "paged_prefill: metadata is contiguous int32");
  }
  const int64_t num_spans = q_starts.size(0);
  TORCH_CHECK(q_lens.size(0) == num_spans && context_lens.size(0) == num_spans && block_tables.size(0) == num_spans,
              "paged_prefill: one start, length, context and table per span");
#if defined(__AVX512BF16__)
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* starts = q_starts.data_ptr<int32_t>();
  const int32_t* lens = q_lens.data_ptr<int32_t>();
  const int32_t* ctxs = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_pool.size(1) / block_size;
  std::vector<SpanLayout> spans(num_spans);
  for (int64_t si = 0; si < num_spans; ++si) {  // every index the kernel will follow, checked before it runs
    const int64_t q0 = starts[si], n = lens[si], ctx = ctxs[si];
    TORCH_CHECK(n >= 1 && q0 >= 0 && q0 + n <= query.size(0), "paged_prefill: span ", si, " is not in the row");
    TORCH_CHECK(ctx >= n && ctx <= max_blocks * block_size, "paged_prefill: context ", ctx, " does not fit its table");
    for (int64_t blk = 0; blk * block_size < ctx; ++blk) {
      const int32_t id = tables[si * max_blocks + blk];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_prefill: block ", id, " is not in the pool");
    }
    spans[si] = SpanLayout{q0, n, ctx, (ctx + kTile - 1) / kTile, 0, 0, si, 0, k_pool.size(0)};
  }
  Sink sink;
  sink.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  sink.out_row = out.stride(0);
  sink.out_head = out.stride(1);
  run_in_passes(query, k_pool, v_pool, sink, spans, tables, max_blocks, block_size, scale, true);
#endif
}

// A cascade head's state: for each row and query head, the walk's fp32 accumulator (the output before dividing by
// the sum) [n, H, D], its running max and sum [n, H]. Checked before a kernel writes or reads it.
void check_state(const char* op, int64_t n, int64_t heads, int64_t dim, const at::Tensor& acc, const at::Tensor& max,
                 const at::Tensor& sum) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.dim() == 3 && acc.size(0) == n && acc.size(1) == heads &&
                  acc.size(2) == dim && acc.stride(2) == 1,
              op, ": the head state's acc is [n, H, D] float32, D contiguous");
  TORCH_CHECK(max.scalar_type() == at::kFloat && sum.scalar_type() == at::kFloat && max.dim() == 2 &&
                  max.size(0) == n && max.size(1) == heads && sum.sizes() == max.sizes() && sum.strides() == max.strides(),
              op, ": the head state's max and sum are [n, H] float32, alike");
}

Sink state_sink(at::Tensor& acc, at::Tensor& max, at::Tensor& sum) {
  Sink sink;
  sink.acc = acc.data_ptr<float>();
  sink.max = max.data_ptr<float>();
  sink.sum = sum.data_ptr<float>();
  sink.acc_row = acc.stride(0);
  sink.acc_head = acc.stride(1);
  sink.st_row = max.stride(0);
  sink.st_head = max.stride(1);
  return sink;
}

// Decode rows: every row of query named by rows attends to its context (context_lens[b] keys, its own last) read
// through its block table, in the walk every other path takes, so its output is bit for bit what a prefill chunk
// computes for the same token. A row with first_keys[b] > 0 resumes a cascade head's state (head_acc, head_max,
// head_sum, row b of them, from paged_shared_keys or shared_keys_from_layout over its first first_keys[b] keys, a
// multiple of 64: the walk's step) and walks only the rest.
//   query [T, H, D] bf16, out [T, H, D] bf16 (written at the rows only), rows [B], block_tables [B, M],
//   context_lens [B], first_keys [B] int32 or empty; head_acc [Bh, H, D], head_max / head_sum [Bh, H] float32
void paged_decode_rows(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& out,
                       const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                       const at::Tensor& first_keys, const at::Tensor& head_acc, const at::Tensor& head_max,
                       const at::Tensor& head_sum, int64_t block_size, double scale) {
  check_pool("paged_decode_rows", query, k_pool, v_pool);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.sizes() == query.sizes() && out.stride(2) == 1,
              "paged_decode_rows: out is bf16 like the query, D contiguous");
  for (const auto* t : {&rows, &block_tables, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "paged_decode_rows: metadata is contiguous int32");
  }
  const int64_t num_rows = rows.size(0), width = block_tables.size(1);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_rows && context_lens.size(0) == num_rows,
              "paged_decode_rows: one block table and one context length per row");
  const bool has_heads = first_keys.numel() > 0;
  const int64_t num_heads_given = has_heads ? head_acc.size(0) : 0;
  if (has_heads) {
    TORCH_CHECK(first_keys.scalar_type() == at::kInt && first_keys.is_contiguous() && first_keys.size(0) == num_rows,
                "paged_decode_rows: first_keys is int32, one per row");
    check_state("paged_decode_rows", num_heads_given, query.size(1), query.size(2), head_acc, head_max, head_sum);
  }
  const int32_t* row_ids = rows.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = has_heads ? first_keys.data_ptr<int32_t>() : nullptr;
  const int64_t num_blocks = k_pool.size(1) / block_size;
  for (int64_t b = 0; b < num_rows; ++b) {  // every index the kernel will follow, checked before it runs
    TORCH_CHECK(row_ids[b] >= 0 && row_ids[b] < query.size(0), "paged_decode_rows: row ", row_ids[b], " out of range");
    const int64_t ctx = lens[b];
    TORCH_CHECK(ctx >= 1 && ctx <= width * block_size, "paged_decode_rows: context ", ctx, " does not fit its table");
    if (starts != nullptr) {
      TORCH_CHECK(starts[b] >= 0 && starts[b] < ctx && starts[b] % kPart == 0,
                  "paged_decode_rows: a head is a multiple of ", kPart, " keys and leaves the row's own key");
      TORCH_CHECK(starts[b] == 0 || b < num_heads_given, "paged_decode_rows: row ", b, " has a head but no state");
    }
    for (int64_t blk = 0; blk * block_size < ctx; ++blk) {
      const int32_t id = tables[b * width + blk];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode_rows: block ", id, " is not in the pool");
    }
  }
  if (num_rows == 0) return;
#if defined(__AVX512BF16__)
  const float* acc = has_heads ? head_acc.data_ptr<float>() : nullptr;
  const float* max = has_heads ? head_max.data_ptr<float>() : nullptr;
  const float* sum = has_heads ? head_sum.data_ptr<float>() : nullptr;
  const int64_t acc_row = has_heads ? head_acc.stride(0) : 0, acc_head = has_heads ? head_acc.stride(1) : 0;
  const int64_t st_row = has_heads ? head_max.stride(0) : 0, st_head = has_heads ? head_max.stride(1) : 0;
  if (query.size(2) == 64) {
    decode_rows_tiled<64>(query, k_pool, v_pool, out, row_ids, tables, width, lens, starts, acc, max, sum, num_rows,
                          acc_row, acc_head, st_row, st_head, block_size, scale);
  } else {
    decode_rows_tiled<128>(query, k_pool, v_pool, out, row_ids, tables, width, lens, starts, acc, max, sum, num_rows,
                           acc_row, acc_head, st_row, st_head, block_size, scale);
  }
#endif
}

// A head's block table, checked before a kernel follows it: contiguous int32, long enough for num_keys keys, and
// every block it reads for them inside the pool.
void check_head_table(const char* op, const at::Tensor& block_table, int64_t num_keys, int64_t block_size,
                      int64_t pool_slots) {
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.dim() == 1, op,
              ": the block table is contiguous int32");
  TORCH_CHECK(num_keys >= 1 && num_keys <= block_table.size(0) * block_size, op, ": ", num_keys,
              " keys do not fit the table");
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t num_blocks = pool_slots / block_size;
  for (int64_t blk = 0; blk * block_size < num_keys; ++blk) {
    TORCH_CHECK(table[blk] >= 0 && table[blk] < num_blocks, op, ": block ", table[blk], " is not in the pool");
  }
}

// Rows that all see the same keys (a head of cascade attention: keys several decode rows share): every row of
// query attends to keys 0 .. num_keys - 1 read through block_table, no mask; acc, max and sum get each row and
// head's walk state (for paged_decode_rows to resume from; the attention over the head alone is acc / sum).
//   query [n, H, D] bf16 (D contiguous), acc [n, H, D], max / sum [n, H] float32, block_table [M] int32
void paged_shared_keys(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& acc,
                       at::Tensor& max, at::Tensor& sum, const at::Tensor& block_table, int64_t num_keys,
                       int64_t block_size, double scale) {
  check_pool("paged_shared_keys", query, k_pool, v_pool);
  TORCH_CHECK(query.size(0) >= 1, "paged_shared_keys: no rows");
  check_state("paged_shared_keys", query.size(0), query.size(1), query.size(2), acc, max, sum);
  check_head_table("paged_shared_keys", block_table, num_keys, block_size, k_pool.size(1));
#if defined(__AVX512BF16__)
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t tiles = (num_keys + kTile - 1) / kTile;
  std::vector<SpanLayout> spans{SpanLayout{0, query.size(0), num_keys, tiles, 0, 0, 0, 0, k_pool.size(0)}};
  run_in_passes(query, k_pool, v_pool, state_sink(acc, max, sum), spans, table, block_table.size(0), block_size,
                scale, false);
#endif
}


// A head's keys and values laid out once, for steps to reuse while its blocks hold the same contents (the keys
// of a cached system prompt that several conversations decode behind): keys [kvH, tiles * 16 * D / 2] and
// values [kvH, tiles * 8 * D], int32 words of bf16 pairs, as the kernel reads them.
std::tuple<at::Tensor, at::Tensor> paged_keys_layout(const at::Tensor& k_pool, const at::Tensor& v_pool,
                                                     const at::Tensor& block_table, int64_t num_keys,
                                                     int64_t block_size) {
  TORCH_CHECK(k_pool.dim() == 3 && paged_prefill_available(k_pool.size(2)),
              "paged_keys_layout: needs AVX512-BF16, a pool [kvH, S, D] and a head size of 64 or 128");
  TORCH_CHECK(k_pool.scalar_type() == at::kBFloat16 && v_pool.scalar_type() == at::kBFloat16 &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() && v_pool.sizes() == k_pool.sizes(),
              "paged_keys_layout: the pool is contiguous bf16");
  check_head_table("paged_keys_layout", block_table, num_keys, block_size, k_pool.size(1));
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t kv_heads = k_pool.size(0), dim = k_pool.size(2), slots = k_pool.size(1);
  const int64_t tiles = (num_keys + kTile - 1) / kTile;
  at::Tensor keys = at::empty({kv_heads, tiles * kTile * dim / 2}, k_pool.options().dtype(at::kInt));
  at::Tensor values = at::empty({kv_heads, tiles * (kTile / 2) * dim}, k_pool.options().dtype(at::kInt));
#if defined(__AVX512BF16__)
  constexpr int64_t kChunk = 8;  // tiles an item lays out: the kv heads alone are too few to share out evenly
  const int64_t chunks = (tiles + kChunk - 1) / kChunk;
  uint32_t* kt = reinterpret_cast<uint32_t*>(keys.data_ptr<int32_t>());
  uint32_t* vt = reinterpret_cast<uint32_t*>(values.data_ptr<int32_t>());
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(k_pool.data_ptr<at::BFloat16>());
  const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>());
  at::parallel_for(0, kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / chunks, t0 = item % chunks * kChunk, t1 = std::min(tiles, t0 + kChunk);
      if (dim == 64) {
        lay_out_tiles<64>(kt + h * keys.size(1) + t0 * kTile * 32, vt + h * values.size(1) + t0 * (kTile / 2) * 64,
                          k32 + h * slots * 32, v16 + h * slots * 64, table, block_size, num_keys, t0, t1);
      } else {
        lay_out_tiles<128>(kt + h * keys.size(1) + t0 * kTile * 64, vt + h * values.size(1) + t0 * (kTile / 2) * 128,
                           k32 + h * slots * 64, v16 + h * slots * 128, table, block_size, num_keys, t0, t1);
      }
    }
  });
#endif
  return {keys, values};
}

// paged_shared_keys on a head laid out by paged_keys_layout: every row of query attends to all num_keys keys; acc,
// max and sum get the walk's state.
void shared_keys_from_layout(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                             at::Tensor& acc, at::Tensor& max, at::Tensor& sum, int64_t num_keys, double scale) {
  TORCH_CHECK(query.dim() == 3 && paged_prefill_available(query.size(2)),
              "shared_keys_from_layout: needs AVX512-BF16 and queries [n, H, D] with a head size of 64 or 128");
  const int64_t n = query.size(0), heads = query.size(1), dim = query.size(2);
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && query.stride(2) == 1,
              "shared_keys_from_layout: the queries are bf16 [n, H, D], D contiguous");
  TORCH_CHECK(n >= 1 && num_keys >= 1, "shared_keys_from_layout: no rows or no keys");
  check_state("shared_keys_from_layout", n, heads, dim, acc, max, sum);
  const int64_t tiles = (num_keys + kTile - 1) / kTile;
  TORCH_CHECK(keys.scalar_type() == at::kInt && values.scalar_type() == at::kInt && keys.is_contiguous() &&
                  values.is_contiguous() && keys.dim() == 2 && values.dim() == 2 && keys.size(0) == values.size(0) &&
                  keys.size(0) >= 1 && heads % keys.size(0) == 0,
              "shared_keys_from_layout: keys and values are a layout of [kvH, ...] int32, heads a multiple of kvH");
  TORCH_CHECK(keys.size(1) == tiles * kTile * dim / 2 && values.size(1) == tiles * (kTile / 2) * dim,
              "shared_keys_from_layout: the layout does not hold ", num_keys, " keys of head size ", dim);
#if defined(__AVX512BF16__)
  const int64_t kv_heads = keys.size(0);
  std::vector<SpanLayout> spans{SpanLayout{0, n, num_keys, tiles, 0, 0, 0, 0, kv_heads}};
  const uint32_t* kt = reinterpret_cast<const uint32_t*>(keys.data_ptr<int32_t>());
  const uint32_t* vt = reinterpret_cast<const uint32_t*>(values.data_ptr<int32_t>());
  const Sink sink = state_sink(acc, max, sum);
  if (dim == 64) {
    attend_laid_out<64>(query, sink, spans, kt, vt, heads / kv_heads, scale, false);
  } else {
    attend_laid_out<128>(query, sink, spans, kt, vt, heads / kv_heads, scale, false);
  }
#endif
}

}  // namespace

namespace kvserve {
void paged_decode_rows_into(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            at::Tensor& out, const at::Tensor& rows, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size, double scale) {
  static const at::Tensor empty = at::empty({0});
  paged_decode_rows(query, k_pool, v_pool, out, rows, block_tables, context_lens, empty, empty, empty, empty,
                    block_size, scale);
}
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "paged_shared_keys(Tensor query, Tensor k_pool, Tensor v_pool, Tensor(a!) acc, Tensor(b!) max, Tensor(c!) sum, "
      "Tensor block_table, int num_keys, int block_size, float scale) -> ()");
  m.def(
      "paged_prefill(Tensor query, Tensor k_pool, Tensor v_pool, Tensor(a!) out, Tensor q_starts, Tensor q_lens, "
      "Tensor context_lens, Tensor block_tables, int block_size, float scale) -> ()");
  m.def(
      "paged_decode_rows(Tensor query, Tensor k_pool, Tensor v_pool, Tensor(a!) out, Tensor rows, Tensor block_tables, "
      "Tensor context_lens, Tensor first_keys, Tensor head_acc, Tensor head_max, Tensor head_sum, int block_size, "
      "float scale) -> ()");
  m.def("paged_keys_layout(Tensor k_pool, Tensor v_pool, Tensor block_table, int num_keys, int block_size) -> "
        "(Tensor, Tensor)");
  m.def(
      "shared_keys_from_layout(Tensor query, Tensor keys, Tensor values, Tensor(a!) acc, Tensor(b!) max, "
      "Tensor(c!) sum, int num_keys, float scale) -> ()");
  m.def("paged_prefill_available(int head_dim) -> bool", &paged_prefill_available);
  m.def("paged_prefill_scratch_limit(int bytes) -> int", &paged_prefill_scratch_limit);
  m.def("paged_prefill_passes() -> int", &paged_prefill_passes);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_prefill", &paged_prefill);
  m.impl("paged_decode_rows", &paged_decode_rows);
  m.impl("paged_shared_keys", &paged_shared_keys);
  m.impl("paged_keys_layout", &paged_keys_layout);
  m.impl("shared_keys_from_layout", &shared_keys_from_layout);
}
