// The quantised-weight kernels' body, written once over an instruction set's vector traits and compiled
// once per instruction set by quant_gemm.cpp. Deliberately without an include guard: quant_gemm.cpp
// includes it inside each instruction set's namespace, under that set's `#pragma GCC target`, after
// defining the traits class `Isa` there:
//
//   using V = <vector of kLanes float32>;  static constexpr int kLanes;
//   static constexpr int kCols[5];          // weight rows per pass for 1..4 activation rows
//   static constexpr bool kPairs;           // whether fp8_pair exists (steps of 2 * kLanes columns)
//   void fp8_pair(const uint8_t* p, int64_t n, V& lo, V& hi);  // min(n, 2 kLanes) bytes -> two vectors
//   V zero(); V set1(float); V mul(V a, V b); V fma(V a, V b, V c);  // a * b (+ c)
//   float sum(V);                           // the lanes added in a fixed order
//   V load_x(const float* p, int64_t n);    // min(n, kLanes) floats (none when n <= 0), others 0
//   void store(float* p, V v, int64_t n);   // the first n lanes
//   V fp8(const uint8_t* p, int64_t n);     // n <= kLanes e4m3 bytes -> value / 256 (exact), others 0
//   V fp4(const uint8_t* p);                // kLanes / 2 bytes -> kLanes e2m1 values, low nibble first
//
// (QMat, kFp8ScaleFold and e8m0_value come from quant_gemm.cpp, outside the namespaces.) The functions
// defined here: `skinny` (few activation rows against the weight, read in place) and `dequant_rows`
// (a panel of the weight to float32).

// Weight rows ahead of the block being computed whose lines are requested while it runs (the hardware
// prefetcher does not ramp up on rows of a few hundred bytes; see skinny.h's kPrefetchRows).
constexpr int64_t kAheadRows = 16;

// Where output row c's block scales start (one per K block): fp8 shares a scale row among bn rows.
inline const void* scale_row(const QMat& w, int64_t c) {
  if (w.fp4) return w.se + c * w.lds;
  return w.sf + (c / w.bn) * w.lds;
}

// K block kb's multiplier from a scale row: the stored scale times 256 for fp8 (whose decoded values
// are value / 256), or the e8m0 power of two for mxfp4.
template <bool FP4>
inline float block_scale(const void* row, int64_t kb) {
  if constexpr (FP4) {
    return e8m0_value(static_cast<const uint8_t*>(row)[kb]);
  } else {
    return static_cast<const float*>(row)[kb] * kFp8ScaleFold;
  }
}

// The decoded weights of row `row` at columns [k, k + n) (n <= kLanes; for mxfp4 n == kLanes always).
template <bool FP4>
inline typename Isa::V decode(const QMat& w, const uint8_t* row, int64_t k, int64_t n) {
  if constexpr (FP4) {
    return Isa::fp4(row + k / 2);
  } else {
    return Isa::fp8(row + k, n);
  }
}

// The decoded weights of row `row` at columns [k, k + 2 * kLanes) (fewer when n < 2 * kLanes: the rest 0)
// into lo and hi (traits with kPairs only).
template <bool FP4, class I = Isa>  // (I: dependent, so traits without fp8_pair still compile)
inline void decode_pair(const QMat& w, const uint8_t* row, int64_t k, int64_t n, typename I::V& lo,
                        typename I::V& hi) {
  if constexpr (FP4) {
    lo = I::fp4(row + k / 2);
    hi = I::fp4(row + k / 2 + I::kLanes / 2);
  } else {
    I::fp8_pair(row + k, n, lo, hi);
  }
}

// NR activation rows (x, row stride ldx, float32) x NC weight rows c.. c + NC - 1: for every K block, the
// block's products are summed into `part` (kLanes lanes per output), then added to `total` times the
// block's scale; each output is its total's lanes added at the end. out[r * ldo + j] for j < NC.
template <bool FP4, int NR, int NC>
inline void rows_block(const float* x, int64_t ldx, const QMat& w, int64_t c, float* out, int64_t ldo) {
  using V = typename Isa::V;
  constexpr int64_t L = Isa::kLanes;
  const int64_t K = w.K, bk = w.bk, blocks = (K + bk - 1) / bk;
  const int64_t bytes_per_k2 = FP4 ? 1 : 2;  // stored bytes per 2 columns
  const uint8_t* rows[NC];
  const void* scales[NC];
  for (int j = 0; j < NC; ++j) {
    rows[j] = w.v + (c + j) * w.ldv;
    scales[j] = scale_row(w, c + j);
  }
  V total[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NC; ++j) total[r][j] = Isa::zero();
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t k0 = kb * bk, k1 = std::min(K, k0 + bk);
    for (int j = 0; j < NC; ++j)
      for (int64_t b = k0 * bytes_per_k2 / 2; b < k1 * bytes_per_k2 / 2; b += 64)
        deepinfer_cpu::prefetch_line(rows[j] + kAheadRows * w.ldv + b);
    V part[NR][NC];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < NC; ++j) part[r][j] = Isa::zero();
    if constexpr (Isa::kPairs) {  // two vectors of columns per step, decoded together
      for (int64_t k = k0; k < k1; k += 2 * L) {
        const int64_t n = k1 - k;
        V lo[NC], hi[NC];
        for (int j = 0; j < NC; ++j) decode_pair<FP4>(w, rows[j], k, n, lo[j], hi[j]);
        for (int r = 0; r < NR; ++r) {
          const V xl = Isa::load_x(x + r * ldx + k, n), xh = Isa::load_x(x + r * ldx + k + L, n - L);
          for (int j = 0; j < NC; ++j) part[r][j] = Isa::fma(hi[j], xh, Isa::fma(lo[j], xl, part[r][j]));
        }
      }
    } else {
      for (int64_t k = k0; k < k1; k += L) {
        const int64_t n = std::min(L, k1 - k);
        V wv[NC];
        for (int j = 0; j < NC; ++j) wv[j] = decode<FP4>(w, rows[j], k, n);
        for (int r = 0; r < NR; ++r) {
          const V xv = Isa::load_x(x + r * ldx + k, n);
          for (int j = 0; j < NC; ++j) part[r][j] = Isa::fma(wv[j], xv, part[r][j]);
        }
      }
    }
    for (int j = 0; j < NC; ++j) {
      const V s = Isa::set1(block_scale<FP4>(scales[j], kb));
      for (int r = 0; r < NR; ++r) total[r][j] = Isa::fma(part[r][j], s, total[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NC; ++j) out[r * ldo + j] = Isa::sum(total[r][j]);
}

template <bool FP4, int NR>
inline void rows_range(const float* x, int64_t ldx, const QMat& w, int64_t c0, int64_t c1, float* out,
                       int64_t ldo) {
  constexpr int NC = Isa::kCols[NR];
  int64_t c = c0;
  for (; c + NC <= c1; c += NC) rows_block<FP4, NR, NC>(x, ldx, w, c, out + (c - c0), ldo);
  for (; c < c1; ++c) rows_block<FP4, NR, 1>(x, ldx, w, c, out + (c - c0), ldo);
}

// out[r * ldo + (c - c0)] = sum_k x[r * ldx + k] * W[c, k] for r < R and c in [c0, c1), float32, W the
// dequantised weight: four activation rows per pass over the weight. A row's result is computed by the
// same operations in the same order whatever R, the row's position and the column range.
void skinny(const float* x, int64_t ldx, int64_t R, const QMat& w, int64_t c0, int64_t c1, float* out,
            int64_t ldo) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t nr = std::min<int64_t>(4, R - r0);
    const float* xr = x + r0 * ldx;
    float* o = out + r0 * ldo;
    if (w.fp4) {
      switch (nr) {
        case 4: rows_range<true, 4>(xr, ldx, w, c0, c1, o, ldo); break;
        case 3: rows_range<true, 3>(xr, ldx, w, c0, c1, o, ldo); break;
        case 2: rows_range<true, 2>(xr, ldx, w, c0, c1, o, ldo); break;
        default: rows_range<true, 1>(xr, ldx, w, c0, c1, o, ldo); break;
      }
    } else {
      switch (nr) {
        case 4: rows_range<false, 4>(xr, ldx, w, c0, c1, o, ldo); break;
        case 3: rows_range<false, 3>(xr, ldx, w, c0, c1, o, ldo); break;
        case 2: rows_range<false, 2>(xr, ldx, w, c0, c1, o, ldo); break;
        default: rows_range<false, 1>(xr, ldx, w, c0, c1, o, ldo); break;
      }
    }
  }
}

template <bool FP4>
inline void dequant_rows_impl(const QMat& w, int64_t c0, int64_t c1, int64_t k0, int64_t k1, float* dst,
                              int64_t ldd) {
  constexpr int64_t L = Isa::kLanes;
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* row = w.v + c * w.ldv;
    const void* scales = scale_row(w, c);
    float* d = dst + (c - c0) * ldd;
    for (int64_t b0 = k0; b0 < k1; b0 += w.bk) {
      const int64_t b1 = std::min(k1, b0 + w.bk);
      const typename Isa::V s = Isa::set1(block_scale<FP4>(scales, b0 / w.bk));
      for (int64_t k = b0; k < b1; k += L) {
        const int64_t n = std::min(L, b1 - k);
        Isa::store(d + (k - k0), Isa::mul(decode<FP4>(w, row, k, n), s), n);
      }
    }
  }
}

// dst[(c - c0) * ldd + (k - k0)] = W[c, k] (float32, exactly value x scale rounded once) for c in
// [c0, c1) and k in [k0, k1); k0 is a multiple of the K block.
void dequant_rows(const QMat& w, int64_t c0, int64_t c1, int64_t k0, int64_t k1, float* dst, int64_t ldd) {
  if (w.fp4)
    dequant_rows_impl<true>(w, c0, c1, k0, k1, dst, ldd);
  else
    dequant_rows_impl<false>(w, c0, c1, k0, k1, dst, ldd);
}
