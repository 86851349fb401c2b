// SwiGLU for the fast CPU kernels: silu(gate) * up over rows [gate | up], shared by the `silu_and_mul` op
// (kernels.cpp) and the routed experts' activations (moe.cpp). Header-only.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "skinny.h"

namespace deepinfer_cpu {

// out[r * ldo + i] = silu(x[r * ldx + i]) * x[r * ldx + inter + i] for rows r < rows and i < inter, in
// float32. Every element goes through the same vector code (16 lanes, the last ones of a row masked),
// whatever the row count, the row's position or the thread: batch-invariant as it is. Rows in parallel,
// small inputs on one thread.
template <typename T, typename O>
void silu_mul_rows(const T* x, int64_t ldx, O* out, int64_t ldo, int64_t rows, int64_t inter) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, 2 * inter));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* gate = x + r * ldx;
      const T* up = gate + inter;
      O* o = out + r * ldo;
#ifdef __AVX512F__
      for (int64_t i0 = 0; i0 < inter; i0 += 16) {
        const __mmask16 m = tail_mask(inter - i0);
        const __m512 g = load16(gate + i0, m), u = load16(up + i0, m);
        const __m512 sig = _mm512_add_ps(_mm512_set1_ps(1.f), fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
        store16(o + i0, _mm512_mul_ps(_mm512_div_ps(g, sig), u), m);
      }
#else
      constexpr int64_t kBlock = 16;
      for (int64_t i0 = 0; i0 < inter; i0 += kBlock) {
        const int64_t n = std::min(kBlock, inter - i0);
        float g[kBlock] = {}, u[kBlock] = {}, v[kBlock];
        for (int64_t i = 0; i < n; ++i) {
          g[i] = static_cast<float>(gate[i0 + i]);
          u[i] = static_cast<float>(up[i0 + i]);
        }
#pragma omp simd
        for (int64_t i = 0; i < kBlock; ++i) v[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
        for (int64_t i = 0; i < n; ++i) o[i0 + i] = static_cast<O>(v[i]);
      }
#endif
    }
  });
}

}  // namespace deepinfer_cpu
