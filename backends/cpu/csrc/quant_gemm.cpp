// deepinfer fast CPU ops, quantised weights kept as stored: block-scaled FP8 (e4m3) and MXFP4 (e2m1)
// projections, grouped expert GEMM and the fused routed-expert MLP (the CPU backend's fp8_linear,
// grouped_gemm_quant and fused_moe_quant; contracts in deepinfer/backends/ops.py, layouts in
// deepinfer/backends/quant.py).
//
// The weight bytes stay FP8 / FP4 in memory; they are decoded per vector in registers and every product
// accumulates in float32. Two paths, chosen by the number of activation rows against `skinny_max`:
// - few rows (decode): `skinny` (quant_isa_body.h) streams the weight once per four activation rows.
//   Per K block it sums the block's products, then adds that partial sum times the block's scale to
//   the output's total (the scale is applied per K block, inside the K loop). e4m3 decodes by bit
//   operations: a byte's sign-extended bits shifted into an IEEE half (exponent field 0eeee, mantissa
//   mmm0000000, which is value / 256 exactly, subnormals included), widened by the F16C conversion;
//   the 256 is folded into the block scale. e2m1 decodes through a 16-entry table (one permute).
// - many rows (prefill): panel after panel of weight rows (up to kPanelBytes of float32) is dequantised
//   into a buffer (value x scale, rounded once: the reference's dequantised weight exactly) and
//   multiplied by every activation row at once by oneDNN's inner product (at::mm where torch lacks it).
//
// Instruction sets, chosen at run time (`isa` argument; -1 = the best this CPU supports, by cpuid
// through __builtin_cpu_supports): AVX-512 (F, BW, VL, DQ), AVX2 + FMA + F16C, and a portable scalar
// one. Each is the same kernel body (quant_isa_body.h) compiled under its own `#pragma GCC target`, so
// a library built with -march=native on an AVX2-only host still contains the AVX-512 kernels and never
// runs them. On a host that has AVX-512, the AVX2 kernels are written with 256-bit intrinsics only, but
// the compiler may give their scalar glue AVX-512 encodings (the whole file is built with
// -march=native): forcing `avx2` there tests that path's logic, not the absence of AVX-512.
// The NaN encodings of e4m3fn (0x7F, 0xFF) decode as +-480 in the vector kernels (the portable one and
// the reference give NaN); written checkpoints hold none (quantisers clamp to +-448).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "activation.h"
#include "common.h"
#include "expert_runs.h"

namespace {

// One [N, K] quantised matrix (an expert's slice of a stacked weight), read in place.
struct QMat {
  const uint8_t* v;   // fp8: one byte per column, row stride ldv; mxfp4: two columns per byte
  int64_t ldv;        // bytes between rows
  const float* sf;    // fp8: float32 scale grid [ceil(N / bn), ceil(K / bk)], row stride lds
  const uint8_t* se;  // mxfp4: e8m0 exponents [N, K / 32], row stride lds
  int64_t lds;
  int64_t bn, bk, K;  // block (mxfp4: 1 x 32) and logical (unpacked) columns
  bool fp4;
};

// The vector kernels decode e4m3 as value / 256; their block scale carries the 256.
constexpr float kFp8ScaleFold = 256.f;

inline float e8m0_value(uint8_t e) { return std::ldexp(1.f, static_cast<int>(e) - 127); }

constexpr float kE2m1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// e4m3fn byte -> value / 256, every code (NaN included), for the portable kernels.
const std::array<float, 256>& e4m3_over_256() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b)
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits())) /
             kFp8ScaleFold;
    return t;
  }();
  return table;
}

// ------------------------------------------------------------------------------ portable kernels
namespace isa_generic {
struct Isa {
  struct V {
    float l[8];
  };
  static constexpr int64_t kLanes = 8;
  static constexpr int kCols[5] = {0, 4, 2, 1, 1};
  static constexpr bool kPairs = false;
  static V zero() { return V{}; }
  static V set1(float s) {
    V v;
    for (float& x : v.l) x = s;
    return v;
  }
  static V mul(V a, V b) {
    for (int i = 0; i < 8; ++i) a.l[i] *= b.l[i];
    return a;
  }
  static V fma(V a, V b, V c) {
    for (int i = 0; i < 8; ++i) c.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
    return c;
  }
  static float sum(V v) {
    return ((v.l[0] + v.l[4]) + (v.l[2] + v.l[6])) + ((v.l[1] + v.l[5]) + (v.l[3] + v.l[7]));
  }
  static V load_x(const float* p, int64_t n) {
    V v{};
    for (int64_t i = 0; i < n; ++i) v.l[i] = p[i];
    return v;
  }
  static void store(float* p, V v, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[i] = v.l[i];
  }
  static V fp8(const uint8_t* p, int64_t n) {
    const auto& table = e4m3_over_256();
    V v{};
    for (int64_t i = 0; i < n; ++i) v.l[i] = table[p[i]];
    return v;
  }
  static V fp4(const uint8_t* p) {
    V v;
    for (int i = 0; i < 4; ++i) {
      v.l[2 * i] = kE2m1[p[i] & 0xF];
      v.l[2 * i + 1] = kE2m1[p[i] >> 4];
    }
    return v;
  }
};
#include "quant_isa_body.h"
}  // namespace isa_generic

#if defined(__x86_64__)
// ------------------------------------------------------------------------------ AVX2 + FMA + F16C
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
struct Isa {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int kCols[5] = {0, 4, 2, 1, 1};  // 16 ymm registers
  static constexpr bool kPairs = false;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float s) { return _mm256_set1_ps(s); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static __m256i lanes_below(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V load_x(const float* p, int64_t n) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below(n));
  }
  static void store(float* p, V v, int64_t n) {
    if (n >= 8)
      _mm256_storeu_ps(p, v);
    else
      _mm256_maskstore_ps(p, lanes_below(n), v);
  }
  static V fp8(const uint8_t* p, int64_t n) {
    __m128i b;
    if (n >= 8) {
      b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    } else {
      uint8_t tail[8] = {};
      std::memcpy(tail, p, n);
      b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tail));
    }
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
    return _mm256_cvtph_ps(h);
  }
  static V fp4(const uint8_t* p) {
    int32_t four;
    std::memcpy(&four, p, sizeof(four));
    const __m128i b = _mm_cvtsi32_si128(four);
    const __m256i idx = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)),
                                          _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), idx);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(idx, 28), _mm256_set1_epi32(INT32_MIN));
    return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
  }
};
#include "quant_isa_body.h"
}  // namespace isa_avx2
#pragma GCC pop_options

// ------------------------------------------------------------------------------ AVX-512 (F, BW, VL, DQ)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace isa_avx512 {
struct Isa {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  // Weight rows per pass: NR x NC accumulators and totals, 2 NC decoded vectors and 2 NR activation
  // vectors within the 32 zmm registers.
  static constexpr int kCols[5] = {0, 6, 4, 3, 2};
  static constexpr bool kPairs = true;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float s) { return _mm512_set1_ps(s); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static __mmask16 below(int64_t n) {
    return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
  }
  static V load_x(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(below(n), p); }
  static void store(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, below(n), v); }
  static V fp8(const uint8_t* p, int64_t n) {
    const __m128i b = _mm_maskz_loadu_epi8(below(n), p);
    const __m256i h =
        _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    return _mm512_cvtph_ps(h);
  }
  // 32 e4m3 bytes at once: one sign extension, shift and mask for both halves.
  static void fp8_pair(const uint8_t* p, int64_t n, V& lo, V& hi) {
    const __mmask32 m = n >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << n) - 1);
    const __m256i b = _mm256_maskz_loadu_epi8(m, p);
    const __m512i h =
        _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
  static V fp4(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    // lane 2i holds byte i (its low nibble is column 2i), lane 2i + 1 the same byte shifted by 4; the
    // permute reads the low 4 bits of each lane only.
    const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)),
                                          _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0));
    return _mm512_permutexvar_ps(idx, _mm512_loadu_ps(kE2m1));
  }
};
#include "quant_isa_body.h"
}  // namespace isa_avx512
#pragma GCC pop_options
#endif

// ------------------------------------------------------------------------------ dispatch
enum IsaCode : int64_t { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr const char* kIsaNames[] = {"generic", "avx2", "avx512"};

struct Kernels {
  void (*skinny)(const float*, int64_t, int64_t, const QMat&, int64_t, int64_t, float*, int64_t);
  void (*dequant)(const QMat&, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
};

bool isa_supported(int64_t isa) {
  switch (isa) {
    case kGeneric: return true;
#if defined(__x86_64__)
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && isa_supported(kAvx2);
#endif
    default: return false;
  }
}

// The instruction sets this CPU runs, ascending (cpuid, read once).
const std::vector<int64_t>& supported() {
  static const std::vector<int64_t> isas = [] {
    std::vector<int64_t> out;
    for (int64_t isa = kGeneric; isa <= kAvx512; ++isa)
      if (isa_supported(isa)) out.push_back(isa);
    return out;
  }();
  return isas;
}

std::vector<int64_t> supported_isas() { return supported(); }

// The kernels of instruction set `isa` (-1: the best one this CPU supports). A request the CPU cannot
// run is a ValueError naming what it lacks.
const Kernels& kernels(int64_t isa) {
  static const Kernels generic{&isa_generic::skinny, &isa_generic::dequant_rows};
#if defined(__x86_64__)
  static const Kernels avx2{&isa_avx2::skinny, &isa_avx2::dequant_rows};
  static const Kernels avx512{&isa_avx512::skinny, &isa_avx512::dequant_rows};
#endif
  if (isa < 0) isa = supported().back();
  TORCH_CHECK_VALUE(isa <= kAvx512, "quantised kernels: instruction set code ", isa,
                    " is not one of 0 (generic), 1 (avx2), 2 (avx512)");
  TORCH_CHECK_VALUE(isa_supported(isa), "quantised kernels: this CPU does not support the ", kIsaNames[isa],
                    " kernels (DEEPINFER_CPU_ISA); it supports ", c10::IntArrayRef(supported()),
                    " (0 generic, 1 avx2, 2 avx512)");
#if defined(__x86_64__)
  if (isa == kAvx512) return avx512;
  if (isa == kAvx2) return avx2;
#endif
  return generic;
}

// ------------------------------------------------------------------------------ weights
struct Format {
  bool fp4;
  int64_t bn, bk;
};

Format parse_format(const char* op, int64_t kind, int64_t bn, int64_t bk) {
  TORCH_CHECK_VALUE(kind == 0 || kind == 1, op, ": weight kind must be 0 (fp8) or 1 (mxfp4), got ", kind);
  if (kind == 1) {
    TORCH_CHECK_VALUE(bn == 1 && bk == 32, op, ": mxfp4 has one scale per 1x32, got block ", bn, "x", bk);
    return {true, 1, 32};
  }
  TORCH_CHECK_VALUE(bn >= 1 && bk >= 1, op, ": the fp8 block must be positive, got ", bn, "x", bk);
  return {false, bn, bk};
}

// Checks a stacked ([E, N, K]) or plain ([N, K]) quantised weight with its scale; returns (N, K logical).
std::pair<int64_t, int64_t> check_weight(const char* op, const char* what, const at::Tensor& values,
                                         const at::Tensor& scale, const Format& f, int64_t dims) {
  TORCH_CHECK_VALUE(values.dim() == dims && scale.dim() == dims, op, ": ", what, " and its scale must be ", dims,
                    "-D, got ", values.sizes(), " and ", scale.sizes());
  if (f.fp4) {
    TORCH_CHECK_VALUE(values.scalar_type() == at::kByte && scale.scalar_type() == at::kByte, op, ": mxfp4 ", what,
                      " needs uint8 values and uint8 e8m0 scales, got ", values.scalar_type(), " and ",
                      scale.scalar_type());
  } else {
    TORCH_CHECK_VALUE(values.scalar_type() == at::kFloat8_e4m3fn && scale.scalar_type() == at::kFloat, op,
                      ": fp8 ", what, " needs float8_e4m3fn values and float32 scales, got ", values.scalar_type(),
                      " and ", scale.scalar_type());
  }
  const int64_t n = values.size(dims - 2), k = values.size(dims - 1) * (f.fp4 ? 2 : 1);
  const int64_t sn = (n + f.bn - 1) / f.bn, sk = (k + f.bk - 1) / f.bk;
  TORCH_CHECK_VALUE(scale.size(dims - 2) == sn && scale.size(dims - 1) == sk &&
                        (dims == 2 || scale.size(0) == values.size(0)),
                    op, ": ", what, " scale has shape ", scale.sizes(), ", expected [", (dims == 3 ? "E, " : ""), sn,
                    ", ", sk, "] for a ", n, "x", k, " weight in ", f.bn, "x", f.bk, " blocks");
  return {n, k};
}

// Matrix `e` of a contiguous stacked weight (e = 0 for a plain one).
QMat matrix(const at::Tensor& values, const at::Tensor& scale, const Format& f, int64_t n, int64_t k, int64_t e) {
  const int64_t ldv = f.fp4 ? k / 2 : k, lds = scale.size(-1), scale_rows = scale.size(-2);
  const auto* v = static_cast<const uint8_t*>(values.data_ptr()) + e * n * ldv;
  QMat m{v, ldv, nullptr, nullptr, lds, f.bn, f.bk, k, f.fp4};
  if (f.fp4)
    m.se = scale.data_ptr<uint8_t>() + e * scale_rows * lds;
  else
    m.sf = scale.data_ptr<float>() + e * scale_rows * lds;
  return m;
}

// ------------------------------------------------------------------------------ products
using deepinfer_cpu::kColBlock;  // output columns per work item (skinny path)
constexpr int64_t kMacsPerThread = 1 << 13;       // below this a skinny call stays on one thread
constexpr int64_t kPanelRows = 64;                // weight rows per dequantised panel (at least)
constexpr int64_t kPanelBytes = 4 << 20;          // float32 bytes of one panel (at most, unless kPanelRows)

// out[r * ldo + c] for r < R, c < N through the skinny kernels, parallel over blocks of output columns.
void skinny_matmul(const Kernels& kern, const float* x, int64_t ldx, int64_t R, const QMat& w, int64_t N, float* out,
                   int64_t ldo) {
  const int64_t blocks = (N + kColBlock - 1) / kColBlock;
  const int64_t grain = std::max<int64_t>(1, kMacsPerThread / std::max<int64_t>(1, R * w.K * kColBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    const int64_t c0 = first * kColBlock, c1 = std::min(N, last * kColBlock);
    kern.skinny(x, ldx, R, w, c0, c1, out + c0, ldo);
  });
}

// oneDNN's float32 inner product (`mkldnn::_linear_pointwise`, registered by every x86 and aarch64 torch
// build), when this torch has it: on the AMD EPYC it ran the panels' products 2-2.5x faster than MKL's
// sgemm (at::mm), as it does for the backend's float32 `linear` (deepinfer/backends/cpu/linear.py).
const std::optional<c10::OperatorHandle>& onednn_linear() {
  static const std::optional<c10::OperatorHandle> handle =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return handle;
}

// The same product through dequantised panels: panel after panel of weight rows (as many as fit
// kPanelBytes of float32, at least kPanelRows) is dequantised by all threads into a buffer, then
// multiplied by every activation row at once (oneDNN, else at::mm; all threads). x rows are contiguous
// (ldx == K).
void panel_matmul(const Kernels& kern, const float* x, int64_t ldx, int64_t R, const QMat& w, int64_t N, float* out,
                  int64_t ldo) {
  const int64_t K = w.K;
  TORCH_CHECK(ldx == K, "panel_matmul: activation rows must be contiguous");
  const int64_t rows = std::min(N, std::max(kPanelRows, kPanelBytes / (4 * K) / 16 * 16));
  thread_local std::vector<float> buffer;  // the calling thread's (a thread_local named in the lambda
  if (static_cast<int64_t>(buffer.size()) < rows * K) buffer.resize(rows * K);  // would be each worker's)
  float* const panel = buffer.data();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor a = at::from_blob(const_cast<float*>(x), {R, K}, f32);
  const auto& onednn = onednn_linear();
  for (int64_t c0 = 0; c0 < N; c0 += rows) {
    const int64_t c1 = std::min(N, c0 + rows);
    at::parallel_for(c0, c1, std::max<int64_t>(1, 16384 / K), [&](int64_t first, int64_t last) {
      kern.dequant(w, first, last, 0, K, panel + (first - c0) * K, K);
    });
    const at::Tensor b = at::from_blob(panel, {c1 - c0, K}, f32);
    at::Tensor dst = at::from_blob(out + c0, {R, c1 - c0}, {ldo, 1}, f32);
    if (onednn.has_value()) {
      torch::jit::Stack stack{a, b, c10::IValue(), c10::IValue("none"), c10::IValue(c10::List<std::optional<c10::Scalar>>()),
                              c10::IValue("")};
      onednn->callBoxed(&stack);
      dst.copy_(stack[0].toTensor());
    } else {
      at::mm_out(dst, a, b.t());
    }
  }
}

void quant_matmul(const Kernels& kern, const float* x, int64_t ldx, int64_t R, const QMat& w, int64_t N, float* out,
                  int64_t ldo, int64_t skinny_max) {
  if (R == 0 || N == 0) return;
  if (R <= skinny_max)
    skinny_matmul(kern, x, ldx, R, w, N, out, ldo);
  else
    panel_matmul(kern, x, ldx, R, w, N, out, ldo);
}

void check_activations(const char* op, const at::Tensor& x) {
  const auto t = x.scalar_type();
  TORCH_CHECK_VALUE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, op,
                    ": activations must be float32, bfloat16 or float16, got ", t);
}

// ------------------------------------------------------------------------------ ops
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t kind,
                        int64_t bn, int64_t bk, const std::optional<at::Tensor>& bias, int64_t isa,
                        int64_t skinny_max) {
  const char* op = "fp8_linear";
  const Format f = parse_format(op, kind, bn, bk);
  const auto [N, K] = check_weight(op, "weight", weight, scale, f, 2);
  check_activations(op, x);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == K, op, ": x ", x.sizes(), " must end in the weight's K = ", K);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, op, ": bias must be [", N, "], got ", bias->sizes());
  const Kernels& kern = kernels(isa);
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, K});
  const int64_t R = x2.size(0);
  const at::Tensor xf = x2.to(at::kFloat).contiguous();
  const at::Tensor wv = weight.contiguous(), ws = scale.contiguous();
  at::Tensor out = at::empty({R, N}, x.options().dtype(at::kFloat));
  quant_matmul(kern, xf.data_ptr<float>(), K, R, matrix(wv, ws, f, N, K, 0), N, out.data_ptr<float>(), N, skinny_max);
  if (has_bias) out.add_(*bias);
  if (x.scalar_type() != at::kFloat) out = out.to(x.scalar_type());
  if (x.dim() == 2) return out;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

using deepinfer_cpu::column_items;
using deepinfer_cpu::Item;
using deepinfer_cpu::Run;
using deepinfer_cpu::split_runs;

at::Tensor quant_grouped_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t kind,
                              int64_t bn, int64_t bk, const at::Tensor& group_sizes, int64_t isa,
                              int64_t skinny_max) {
  const char* op = "grouped_gemm_quant";
  const Format f = parse_format(op, kind, bn, bk);
  const auto [N, K] = check_weight(op, "weight", weight, scale, f, 3);
  check_activations(op, x);
  const int64_t E = weight.size(0);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == K, op, ": x must be [rows, ", K, "], got ", x.sizes());
  TORCH_CHECK_VALUE(group_sizes.dim() == 1 && group_sizes.size(0) == E, op, ": group_sizes must be [", E, "], got ",
                    group_sizes.sizes());
  const Kernels& kern = kernels(isa);
  const at::Tensor sizes = group_sizes.to(at::kLong).contiguous();
  const int64_t* sp = sizes.data_ptr<int64_t>();
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK_VALUE(sp[e] >= 0, op, ": group_sizes[", e, "] is negative (", sp[e], ")");
    offsets[e + 1] = offsets[e] + sp[e];
  }
  TORCH_CHECK_VALUE(offsets.back() == x.size(0), op, ": group_sizes sum to ", offsets.back(), ", but x has ",
                    x.size(0), " rows");
  const at::Tensor xf = x.to(at::kFloat).contiguous(), wv = weight.contiguous(), ws = scale.contiguous();
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  std::vector<Run> small, large;
  split_runs(offsets, skinny_max + 1, small, large);
  const float* xp = xf.data_ptr<float>();
  float* op_ = out.data_ptr<float>();
  for (const Run& run : large)
    panel_matmul(kern, xp + run.begin * K, K, run.end - run.begin, matrix(wv, ws, f, N, K, run.expert), N,
                 op_ + run.begin * N, N);
  const std::vector<Item> items = column_items(small, N);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t it = first; it < last; ++it) {
      const Item& item = items[it];
      const Run& run = small[item.run];
      kern.skinny(xp + run.begin * K, K, run.end - run.begin, matrix(wv, ws, f, N, K, run.expert), item.col0,
                  item.col1, op_ + run.begin * N + item.col0, N);
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

template <typename T>
void combine(const float* y, const std::vector<int64_t>& row_of_pair, const float* pair_weight, int64_t tokens,
             int64_t top_k, int64_t dim, T* out) {
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / (top_k * dim)), [&](int64_t first, int64_t last) {
    std::vector<float> acc(dim);
    for (int64_t t = first; t < last; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t row = row_of_pair[t * top_k + j];
        if (row < 0) continue;  // another rank's expert
        const float wj = pair_weight[t * top_k + j];
        const float* yr = y + row * dim;
#pragma omp simd
        for (int64_t c = 0; c < dim; ++c) acc[c] += wj * yr[c];
      }
      deepinfer_cpu::store_row(acc.data(), out + t * dim, dim);
    }
  });
}

at::Tensor quant_fused_moe(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w13_scale,
                           const at::Tensor& w2, const at::Tensor& w2_scale, int64_t kind, int64_t bn, int64_t bk,
                           const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t isa,
                           int64_t skinny_max) {
  const char* op = "fused_moe_quant";
  const Format f = parse_format(op, kind, bn, bk);
  const auto [two_inter, dim13] = check_weight(op, "w13", w13, w13_scale, f, 3);
  const auto [dim, inter] = check_weight(op, "w2", w2, w2_scale, f, 3);
  check_activations(op, hidden);
  const int64_t experts = w13.size(0);
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.size(1) == dim13 && dim == dim13 && two_inter == 2 * inter &&
                        w2.size(0) == experts,
                    op, ": hidden [T, D] ", hidden.sizes(), ", w13 [E, 2I, D] ", w13.sizes(), " and w2 [E, D, I] ",
                    w2.sizes(), " (stored shapes; mxfp4 halves the last) do not match");
  const int64_t tokens = hidden.size(0);
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_weights.sizes() == topk_ids.sizes(), op,
                    ": topk_weights and topk_ids must both be [", tokens, ", k], got ", topk_weights.sizes(), " and ",
                    topk_ids.sizes());
  const Kernels& kern = kernels(isa);
  const int64_t top_k = topk_ids.size(1), pairs = tokens * top_k;
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t* pair_expert = ids.data_ptr<int64_t>();
  // Counting sort of the local pairs by expert (tokens ascending within an expert).
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = pair_expert[p];
    TORCH_CHECK_VALUE(e < experts, op, ": topk_ids holds expert ", e, ", outside [0, ", experts,
                      ") (negative ids mark another rank's experts)");
    if (e >= 0) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  const int64_t local = offsets[experts];
  std::vector<int64_t> row_token(local), row_of_pair(pairs, -1), fill(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = pair_expert[p];
    if (e < 0) continue;
    row_of_pair[p] = fill[e];
    row_token[fill[e]++] = p / top_k;
  }
  std::vector<Run> small, large;
  const int64_t most = split_runs(offsets, skinny_max + 1, small, large);

  const at::Tensor xf = hidden.to(at::kFloat).contiguous();
  const at::Tensor a = w13.contiguous(), as = w13_scale.contiguous(), b = w2.contiguous(), bs = w2_scale.contiguous();
  const float* xp = xf.data_ptr<float>();
  // Every local pair's token row (float32, expert order), activations h [local, I], outputs y [local, D].
  std::vector<float> xs(local * dim), h(local * inter), y(local * dim);
  at::parallel_for(0, local, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, dim)), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) std::memcpy(xs.data() + r * dim, xp + row_token[r] * dim, dim * sizeof(float));
  });

  if (!small.empty()) {
    const std::vector<Item> up_items = column_items(small, inter);
    at::parallel_for(0, static_cast<int64_t>(up_items.size()), 1, [&](int64_t first, int64_t last) {
      std::vector<float> gate_up(most * 2 * kColBlock);
      for (int64_t it = first; it < last; ++it) {
        const Item& item = up_items[it];
        const Run& run = small[item.run];
        const int64_t n = run.end - run.begin, cols = item.col1 - item.col0;
        const QMat we = matrix(a, as, f, two_inter, dim, run.expert);
        const float* x = xs.data() + run.begin * dim;
        // rows [gate columns [col0, col1) | up columns I + [col0, col1)], then SwiGLU into h
        kern.skinny(x, dim, n, we, item.col0, item.col1, gate_up.data(), 2 * cols);
        kern.skinny(x, dim, n, we, inter + item.col0, inter + item.col1, gate_up.data() + cols, 2 * cols);
        deepinfer_cpu::silu_mul_rows(gate_up.data(), 2 * cols, h.data() + run.begin * inter + item.col0, inter, n,
                                     cols);
      }
    });
    const std::vector<Item> down_items = column_items(small, dim);
    at::parallel_for(0, static_cast<int64_t>(down_items.size()), 1, [&](int64_t first, int64_t last) {
      for (int64_t it = first; it < last; ++it) {
        const Item& item = down_items[it];
        const Run& run = small[item.run];
        kern.skinny(h.data() + run.begin * inter, inter, run.end - run.begin, matrix(b, bs, f, dim, inter, run.expert),
                    item.col0, item.col1, y.data() + run.begin * dim + item.col0, dim);
      }
    });
  }

  for (const Run& run : large) {  // dequantised panels and at::mm on the expert's gathered rows
    const int64_t n = run.end - run.begin;
    std::vector<float> gate_up(n * two_inter);
    panel_matmul(kern, xs.data() + run.begin * dim, dim, n, matrix(a, as, f, two_inter, dim, run.expert), two_inter,
                 gate_up.data(), two_inter);
    deepinfer_cpu::silu_mul_rows(gate_up.data(), two_inter, h.data() + run.begin * inter, inter, n, inter);
    panel_matmul(kern, h.data() + run.begin * inter, inter, n, matrix(b, bs, f, dim, inter, run.expert), dim,
                 y.data() + run.begin * dim, dim);
  }

  at::Tensor out = at::empty({tokens, dim}, hidden.options());
  const float* pw = weights.data_ptr<float>();
  switch (hidden.scalar_type()) {
    case at::kBFloat16: combine(y.data(), row_of_pair, pw, tokens, top_k, dim, out.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: combine(y.data(), row_of_pair, pw, tokens, top_k, dim, out.data_ptr<c10::Half>()); break;
    default: combine(y.data(), row_of_pair, pw, tokens, top_k, dim, out.data_ptr<float>()); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("quant_supported_isas() -> int[]", &supported_isas);
  m.def("quant_linear(Tensor x, Tensor weight, Tensor scale, int kind, int bn, int bk, Tensor? bias, int isa, "
        "int skinny_max) -> Tensor");
  m.def("quant_grouped_gemm(Tensor x, Tensor weight, Tensor scale, int kind, int bn, int bk, Tensor group_sizes, "
        "int isa, int skinny_max) -> Tensor");
  m.def("quant_fused_moe(Tensor hidden, Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale, int kind, int bn, "
        "int bk, Tensor topk_weights, Tensor topk_ids, int isa, int skinny_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_grouped_gemm", &quant_grouped_gemm);
  m.impl("quant_fused_moe", &quant_fused_moe);
}
