// Skinny matrix products for the fast CPU kernels: a few activation rows (a decode batch, one expert's
// tokens) against a weight matrix read in place, in float32, with no packing and no library call.
//
// At one to a few rows a product is a matrix-vector product bound by reading the weight; what costs is
// keeping enough independent accumulators in flight and the fixed cost around the call (MKL's sgemm
// spends several microseconds choosing a path for a 1 x 192 x 96 product that takes a fraction of one).
// Two weight layouts are read as they lie:
// - rows:    w[c * ldw + k]  (nn.Linear's [N, K], unit stride along K): dot products, several weight rows
//            at a time against every activation row, each reduced across lanes at the end;
// - columns: w[k * ldw + c]  (a [N, K] view of a [K, N] matrix, unit stride along N; the D-major LM head,
//            MLA's absorbed W_UK): broadcast-and-add over blocks of up to 128 columns, no reduction.
// Weights are float32, bfloat16 or float16 (widened to float32 as they are loaded); activations are
// float32 rows (callers widen them once). Each output is one float32 sum over k; the summation order is
// fixed by K and the layout alone (lanes of 16, then the lanes added in a fixed tree for the row layout;
// k in order for the column layout), whatever the thread or the call's other rows.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

// Dispatch over the weight dtypes the skinny products read: float32, bfloat16, float16.
#define DEEPINFER_DISPATCH_WEIGHTS(TYPE, NAME, ...)                          \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)   \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace deepinfer_cpu {

constexpr int64_t kSkinnyRows = 4;  // activation rows per pass
constexpr int64_t kColsC = 128;     // output columns a thread's share is cut in (column layout)

#ifdef __AVX512F__
// 16 weights from p (fewer under `mask`, the others 0), widened to float32.
template <typename W>
inline __m512 load16(const W* p, __mmask16 mask) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (std::is_same_v<W, c10::BFloat16>) {
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    static_assert(std::is_same_v<W, c10::Half>, "weights are float, bfloat16 or half");
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// Stores 16 float32 lanes (those under `mask`) as W: rounded to nearest even for bfloat16 and float16.
template <typename W>
inline void store16(W* p, __m512 v, __mmask16 mask) {
  if constexpr (std::is_same_v<W, float>) {
    _mm512_mask_storeu_ps(p, mask, v);
  } else if constexpr (std::is_same_v<W, c10::BFloat16>) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    for (int i = 0; i < 16; ++i)
      if (mask >> i & 1) p[i] = static_cast<c10::BFloat16>(lanes[i]);
  } else {
    static_assert(std::is_same_v<W, c10::Half>, "outputs are float, bfloat16 or half");
    _mm256_mask_storeu_epi16(p, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// Weight rows ahead of the block being computed whose lines rows_block requests: a block's rows are
// short (K of 64-512 here), too short for the hardware prefetcher to ramp up on, and at one activation
// row the weight comes from memory (a decode step reads about 11 MB of weights, more than this host's
// share of the L3 keeps); two blocks ahead covers the memory latency at the rate a block is computed.
constexpr int64_t kPrefetchRows = 16;

// Weights of type W in one 64-byte cache line.
template <typename W>
constexpr int64_t kLineOf = 64 / sizeof(W);

// Row layout: NR activation rows (1..4) x NC weight rows per pass over K, NR * NC independent
// accumulators (at least 8 keeps both FMA pipes busy through their latency), each reduced across its
// lanes at the end. Requests the lines of the rows kPrefetchRows ahead as it goes (a prefetch never
// faults, so rows past the matrix's end cost nothing but the request).
template <int NR, int NC, typename W>
inline void rows_block(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* out, int64_t ldo) {
  __m512 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NC; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail_mask(K - k);
    __m512 wv[NC];
    for (int j = 0; j < NC; ++j) prefetch_line(w + (kPrefetchRows + j) * ldw + k);
    for (int j = 0; j < NC; ++j) wv[j] = load16(w + j * ldw + k, m);
    for (int r = 0; r < NR; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * ldx + k);
      for (int j = 0; j < NC; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NC; ++j) out[r * ldo + j] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int NR, typename W>
inline void rows_range(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, int64_t c0, int64_t c1,
                       float* out, int64_t ldo) {
  constexpr int kWide = NR <= 2 ? 8 : 4;  // weight rows per pass: NR * kWide accumulators
  for (int64_t c = c0; c < std::min(c1, c0 + kPrefetchRows); ++c)  // the rows the first blocks read
    for (int64_t k = 0; k < K; k += kLineOf<W>) prefetch_line(w + c * ldw + k);
  int64_t c = c0;
  for (; c + kWide <= c1; c += kWide) rows_block<NR, kWide>(x, ldx, w + c * ldw, ldw, K, out + c, ldo);
  for (; c < c1; ++c) rows_block<NR, 1>(x, ldx, w + c * ldw, ldw, K, out + c, ldo);
}

// Weight rows (steps along K) ahead whose lines cols_block requests: its rows are ldw apart (the LM
// head's vocabulary), a stride the hardware prefetcher does not follow far enough.
constexpr int64_t kPrefetchCols = 8;

// Column layout, NR activation rows x columns [c, c + n) with n <= 16 * V: NR * V accumulators.
// Requests the block's lines kPrefetchCols steps ahead as it goes (past K: harmless requests).
template <int NR, int V, typename W>
inline void cols_block(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, int64_t c, int64_t n,
                       float* out, int64_t ldo) {
  __m512 acc[NR][V];
  __mmask16 m[V];
  for (int v = 0; v < V; ++v) m[v] = n > 16 * v ? tail_mask(n - 16 * v) : __mmask16(0);
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < std::min(K, kPrefetchCols); ++k)  // the rows the first steps read
    for (int64_t i = 0; i < n; i += kLineOf<W>) prefetch_line(w + k * ldw + c + i);
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[V];
    for (int64_t i = 0; i < n; i += kLineOf<W>) prefetch_line(w + (k + kPrefetchCols) * ldw + c + i);
    for (int v = 0; v < V; ++v) wv[v] = load16(w + k * ldw + c + 16 * v, m[v]);
    for (int r = 0; r < NR; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(wv[v], xv, acc[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(out + r * ldo + c + 16 * v, m[v], acc[r][v]);
}

template <int NR, typename W>
inline void cols_range(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, int64_t c0, int64_t c1,
                       float* out, int64_t ldo) {
  constexpr int kVecs = NR <= 2 ? 8 : 4;  // 16-column vectors per block: NR * kVecs accumulators
  for (int64_t c = c0; c < c1; c += 16 * kVecs)
    cols_block<NR, kVecs>(x, ldx, w, ldw, K, c, std::min<int64_t>(16 * kVecs, c1 - c), out, ldo);
}
#else
template <typename W>
inline float widen(W v) {
  return static_cast<float>(v);
}

template <int NR, typename W>
inline void rows_range(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, int64_t c0, int64_t c1,
                       float* out, int64_t ldo) {
  for (int64_t c = c0; c < c1; ++c)
    for (int r = 0; r < NR; ++r) {
      float lane[16] = {};
      for (int64_t k = 0; k < K; ++k) lane[k % 16] += widen(w[c * ldw + k]) * x[r * ldx + k];
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += lane[j];
      out[r * ldo + c] = s;
    }
}

template <int NR, typename W>
inline void cols_range(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, int64_t c0, int64_t c1,
                       float* out, int64_t ldo) {
  for (int r = 0; r < NR; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += widen(w[k * ldw + c]) * x[r * ldx + k];
      out[r * ldo + c] = s;
    }
}
#endif

// out[r * ldo + c] = sum_k x[r * ldx + k] * W[c, k] for rows r < R and columns c in [c0, c1), where
// W[c, k] = w[c * ldw + k] (columns == false) or w[k * ldw + c] (columns == true). Any R: taken four
// rows at a time.
template <typename W>
inline void skinny_product(const float* x, int64_t ldx, int64_t R, const W* w, int64_t ldw, bool columns,
                           int64_t K, int64_t c0, int64_t c1, float* out, int64_t ldo) {
  for (int64_t r0 = 0; r0 < R; r0 += kSkinnyRows) {
    const int64_t nr = std::min<int64_t>(kSkinnyRows, R - r0);
    const float* xr = x + r0 * ldx;
    float* o = out + r0 * ldo;
    if (columns) {
      switch (nr) {
        case 4: cols_range<4>(xr, ldx, w, ldw, K, c0, c1, o, ldo); break;
        case 3: cols_range<3>(xr, ldx, w, ldw, K, c0, c1, o, ldo); break;
        case 2: cols_range<2>(xr, ldx, w, ldw, K, c0, c1, o, ldo); break;
        default: cols_range<1>(xr, ldx, w, ldw, K, c0, c1, o, ldo); break;
      }
    } else {
      switch (nr) {
        case 4: rows_range<4>(xr, ldx, w, ldw, K, c0, c1, o, ldo); break;
        case 3: rows_range<3>(xr, ldx, w, ldw, K, c0, c1, o, ldo); break;
        case 2: rows_range<2>(xr, ldx, w, ldw, K, c0, c1, o, ldo); break;
        default: rows_range<1>(xr, ldx, w, ldw, K, c0, c1, o, ldo); break;
      }
    }
  }
}

}  // namespace deepinfer_cpu
