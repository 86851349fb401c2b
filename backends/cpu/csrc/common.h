// Helpers shared by the fast CPU kernels (kernels.cpp, moe.cpp): row casts to and from float32 and a
// vectorisable exp. Header-only; everything is inline.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace deepinfer_cpu {

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// exp(x) for float32, written so that loops over it vectorise (std::exp does not without -ffast-math):
// x = n ln2 + f ln2 with |f| <= 1/2, 2^f by its Taylor series to degree 7 (relative error < 1e-7),
// 2^n by building the exponent bits. Below -87.3 (where expf underflows to denormals) it returns 0.
inline float fast_exp(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const float t = std::max(-88.f, std::min(x, 88.f)) * 1.44269504088896341f;
  const float shifted = t + kRound;
  const float n = shifted - kRound;
  const float f = (t - n) * 0.693147180559945309f;
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  bits = (bits - 0x4B400000 + 127) << 23;  // 2^n from the rounded integer n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.f : p * scale;
}

#ifdef __AVX512F__
// fast_exp on 16 lanes, the same steps as the scalar version.
inline __m512 fast_exp16(__m512 x) {
  const __m512 round = _mm512_set1_ps(12582912.f);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(_mm512_set1_ps(-88.f), _mm512_min_ps(x, _mm512_set1_ps(88.f))),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 shifted = _mm512_add_ps(t, round);
  const __m512 n = _mm512_sub_ps(shifted, round);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.f / 720.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.f / 120.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.f / 24.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.f / 6.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(0.5f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_set1_epi32(0x4B400000)),
                       _mm512_set1_epi32(127)),
      23);
  const __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ), result);
}
#endif

// max(x[0..n)) (n > 0; -inf when every element is -inf). A plain `omp simd reduction(max)` over std::max
// compiles to a serial chain of scalar maxima here (its NaN ordering keeps the compiler from
// reassociating): 4 cycles an element. NaN never reaches it (scores of finite inputs).
// Requests the cache line holding p. GCC deletes __builtin_prefetch / _mm_prefetch when they sit in a loop
// it finds otherwise free of side effects (a loop over a tile's lines), so on x86 the instruction is
// written as inline assembly, which the optimiser keeps.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

inline float max_of(const float* x, int64_t n) {
#ifdef __AVX512F__
  __m512 m = _mm512_set1_ps(-__builtin_inff());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  if (i < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, __mmask16((1u << (n - i)) - 1), x + i));
  return _mm512_reduce_max_ps(m);
#else
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
#endif
}

// x[i] = fast_exp(x[i] - m) for i < n (n a multiple of 16), returning their sum: 16 lanes summed, then the
// lanes in a fixed tree (the same order for every row and call).
inline float exp_shift_sum(float* x, int64_t n, float m) {
#ifdef __AVX512F__
  const __m512 shift = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), shift));
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#else
  float lanes[16] = {};
  for (int64_t i = 0; i < n; i += 16)
    for (int64_t j = 0; j < 16; ++j) lanes[j] += x[i + j] = fast_exp(x[i + j] - m);
  float sum = 0.f;
  for (int64_t j = 0; j < 16; ++j) sum += lanes[j];
  return sum;
#endif
}

}  // namespace deepinfer_cpu
