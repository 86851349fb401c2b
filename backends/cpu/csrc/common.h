// Helpers shared by the fast CPU kernels (kernels.cpp, moe.cpp): row casts to and from float32 and a
// vectorisable exp. Header-only; everything is inline.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

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

}  // namespace deepinfer_cpu
