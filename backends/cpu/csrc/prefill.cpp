// deepinfer fast CPU ops, MLA prefill attention: `mla_prefill` and `mla_prefill_partial` (expanded form:
// per-head keys and values), see deepinfer/backends/cpu/attention.py for the contract.
//
// A flash-attention kernel: work items are (request, head, block of kQueryBlock queries), parallel over
// the call, so batch mates never share arithmetic and a long prompt keeps every thread busy. An item keeps
// its queries (scaled, float32) and, per query, a running max, a sum of exponentials and an unnormalised
// float32 output; it walks its keys in blocks of kKeyBlock, each transposed once into a [D, kKeyBlock]
// tile, scores four queries against the whole block at a time (16 independent accumulators), and adds the
// block's values weighted by exp(score - max). Keys a query does not see (past its causal position, or
// before its sliding window) weigh exactly 0; blocks no query of the item sees are skipped, and only the
// blocks the mask cuts are masked element by element. Inputs are read in place ([T, H, D] rows, any
// dtype); nothing the size of the scores is ever materialised, and values need no padding to the key width.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using deepinfer_cpu::exp_shift_sum;
using deepinfer_cpu::load_row;
using deepinfer_cpu::max_of;
using deepinfer_cpu::store_row;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kQueryBlock = 64;  // queries per work item
constexpr int64_t kKeyBlock = 64;    // keys per block
constexpr int64_t kRows = 4;         // queries scored together
constexpr int64_t kValueCols = 64;   // output columns accumulated in registers at once

// s[r][0:kKeyBlock] = q[r] . kt[:, 0:kKeyBlock] for kRows query rows (q rows of width d; kt holds the keys as
// columns: key j's element c at kt[c * ldk + j]).
inline void score_rows(const float* q, int64_t d, const float* kt, int64_t ldk, float* s) {
#ifdef __AVX512F__
  static_assert(kRows == 4 && kKeyBlock == 64, "the register tile is 4 rows x 4 vectors");
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    const float* kc = kt + c * ldk;
    const __m512 k0 = _mm512_loadu_ps(kc), k1 = _mm512_loadu_ps(kc + 16), k2 = _mm512_loadu_ps(kc + 32),
                 k3 = _mm512_loadu_ps(kc + 48);
    for (int r = 0; r < kRows; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * d + c]);
      acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qv, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qv, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(s + r * kKeyBlock + 16 * v, acc[r][v]);
#else
  float acc[kRows][kKeyBlock] = {};
  for (int64_t c = 0; c < d; ++c) {
    const float* kc = kt + c * ldk;
    for (int64_t r = 0; r < kRows; ++r) {
      const float qv = q[r * d + c];
#pragma omp simd
      for (int64_t j = 0; j < kKeyBlock; ++j) acc[r][j] += qv * kc[j];
    }
  }
  for (int64_t r = 0; r < kRows; ++r) std::copy(acc[r], acc[r] + kKeyBlock, s + r * kKeyBlock);
#endif
}

#ifdef __AVX512F__
// The AVX-512 body of accumulate_rows for one chunk of at most 16 * V output columns (mask per vector).
template <int V>
inline void accumulate_chunk(const float* p, const float* const* vrows, int64_t n, int64_t dv, int64_t c0,
                             const __mmask16* m, const float* alpha, float* out) {
  __m512 acc[kRows][V];
  for (int r = 0; r < kRows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < V; ++v)
      acc[r][v] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m[v], out + r * dv + c0 + 16 * v), a);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[V];
    for (int v = 0; v < V; ++v) vv[v] = _mm512_maskz_loadu_ps(m[v], vrows[j] + c0 + 16 * v);
    for (int r = 0; r < kRows; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * kKeyBlock + j]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(pr, vv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(out + r * dv + c0 + 16 * v, m[v], acc[r][v]);
}
#endif

// out[r][0:dv] = alpha[r] * out[r][0:dv] + sum_j p[r][j] * v_j[0:dv] for kRows rows over n keys (value
// rows vrows[j], float32), kValueCols columns at a time in registers.
inline void accumulate_rows(const float* p, const float* const* vrows, int64_t n, int64_t dv, const float* alpha,
                            float* out) {
  for (int64_t c0 = 0; c0 < dv; c0 += kValueCols) {
    const int64_t w = std::min(kValueCols, dv - c0);
#ifdef __AVX512F__
    __mmask16 m[4];
    for (int v = 0; v < 4; ++v)
      m[v] = w > 16 * v ? (w - 16 * v >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (w - 16 * v)) - 1)) : 0;
    if (w <= 32)
      accumulate_chunk<2>(p, vrows, n, dv, c0, m, alpha, out);
    else
      accumulate_chunk<4>(p, vrows, n, dv, c0, m, alpha, out);
#else
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t c = 0; c < w; ++c) out[r * dv + c0 + c] *= alpha[r];
    for (int64_t j = 0; j < n; ++j)
      for (int64_t r = 0; r < kRows; ++r) {
        const float pr = p[r * kKeyBlock + j];
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) out[r * dv + c0 + c] += pr * vrows[j][c0 + c];
      }
#endif
  }
}

struct Item {
  int64_t req, head, q0;  // queries [q0, q0 + kQueryBlock) of request `req` (indices within it), one head
};

// The visible keys of query i (index within its request): [first(i), last(i)], both in key indices.
struct Visibility {
  int64_t offset;  // len_k - len_q when causal (query i is at key position offset + i); unused otherwise
  int64_t window;  // 0: none
  bool causal;
  int64_t len_k;
  int64_t last(int64_t i) const { return causal ? offset + i : len_k - 1; }
  int64_t first(int64_t i) const { return window > 0 ? std::max<int64_t>(0, last(i) - window + 1) : 0; }
};

template <typename T, typename out_t>
void prefill_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int32_t* cq,
                  const int32_t* ck, int64_t num_reqs, float scale, int64_t window, bool causal, out_t* out,
                  float* lse) {
  const int64_t heads = q.size(1), d = q.size(2), dv = v.size(2);
  const int64_t ldq = q.stride(0), ldk = k.stride(0), ldv = v.stride(0);
  const int64_t hq = q.stride(1), hk = k.stride(1), hv = v.stride(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  std::vector<Item> items;
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t len_q = cq[b + 1] - cq[b];
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i0 = 0; i0 < len_q; i0 += kQueryBlock) items.push_back({b, h, i0});
  }
  // Every (request, head)'s keys transposed once, as float32 columns: kt[seg(b, h) + c * pad_k(b) + j] for key
  // j of request b, zero from len_k up to pad_k(b) (a multiple of kKeyBlock), shared by its query blocks.
  std::vector<int64_t> seg(num_reqs + 1, 0);
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t pad_k = (ck[b + 1] - ck[b] + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    seg[b + 1] = seg[b] + heads * d * pad_k;
  }
  std::vector<float> kt(seg[num_reqs]);
  at::parallel_for(0, num_reqs * heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> row(d);
    for (int64_t bh = first; bh < last; ++bh) {
      const int64_t b = bh / heads, h = bh % heads, len_k = ck[b + 1] - ck[b];
      const int64_t pad_k = (len_k + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
      float* dst = kt.data() + seg[b] + h * d * pad_k;
      for (int64_t j = 0; j < len_k; ++j) {
        load_row(kp + (ck[b] + j) * ldk + h * hk, row.data(), d);
        for (int64_t c = 0; c < d; ++c) dst[c * pad_k + j] = row[c];
      }
      for (int64_t c = 0; c < d; ++c) std::fill(dst + c * pad_k + len_k, dst + (c + 1) * pad_k, 0.f);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t first_item, int64_t last_item) {
    std::vector<float> qbuf(kQueryBlock * d), s(kQueryBlock * kKeyBlock);
    std::vector<float> m(kQueryBlock), l(kQueryBlock), acc(kQueryBlock * dv);
    std::vector<float> vblock(std::is_same_v<T, float> ? 0 : kKeyBlock * dv);  // widened values
    std::vector<const float*> vrows(kKeyBlock);
    for (int64_t it = first_item; it < last_item; ++it) {
      const Item& item = items[it];
      const int64_t b = item.req, h = item.head;
      const int64_t len_q = cq[b + 1] - cq[b], len_k = ck[b + 1] - ck[b];
      const Visibility vis{len_k - len_q, window, causal, len_k};
      const int64_t nq = std::min(kQueryBlock, len_q - item.q0);
      const int64_t padded = (nq + kRows - 1) / kRows * kRows;
      for (int64_t r = 0; r < padded; ++r) {
        float* dst = qbuf.data() + r * d;
        if (r < nq) {
          load_row(qp + (cq[b] + item.q0 + r) * ldq + h * hq, dst, d);
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) dst[c] *= scale;
        } else {
          std::fill(dst, dst + d, 0.f);
        }
      }
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      // Keys some query of the block sees: [lo, hi).
      const int64_t lo = vis.first(item.q0), hi = std::min(len_k, vis.last(item.q0 + nq - 1) + 1);
      for (int64_t j0 = lo / kKeyBlock * kKeyBlock; j0 < hi; j0 += kKeyBlock) {  // blocks aligned to the transposed keys
        const int64_t nk = std::min(kKeyBlock, hi - j0);
        for (int64_t j = 0; j < nk; ++j) {  // the block's value rows, as float32
          const T* src = vp + (ck[b] + j0 + j) * ldv + h * hv;
          if constexpr (std::is_same_v<T, float>) {
            vrows[j] = src;
          } else {
            load_row(src, vblock.data() + j * dv, dv);
            vrows[j] = vblock.data() + j * dv;
          }
        }
        const int64_t pad_k = (len_k + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
        const float* kblock = kt.data() + seg[b] + h * d * pad_k + j0;  // columns j0.. of this head's keys
        for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
          // Does any of these rows see a key of the block, and do all of them see all of it?
          bool any = false, whole = nk == kKeyBlock;
          for (int64_t r = r0; r < r0 + kRows; ++r) {
            const int64_t i = item.q0 + std::min(r, nq - 1);
            any |= vis.last(i) >= j0 && vis.first(i) < j0 + nk;
            whole &= vis.last(i) >= j0 + kKeyBlock - 1 && vis.first(i) <= j0;
          }
          if (!any) continue;
          float* sr = s.data() + r0 * kKeyBlock;
          score_rows(qbuf.data() + r0 * d, d, kblock, pad_k, sr);
          float alpha[kRows];
          for (int64_t g = 0; g < kRows; ++g) {
            const int64_t r = r0 + g, i = item.q0 + std::min(r, nq - 1);
            float* x = sr + g * kKeyBlock;
            if (!whole) {
              const int64_t from = vis.first(i) - j0, to = vis.last(i) - j0;  // visible: [from, to]
              for (int64_t j = 0; j < kKeyBlock; ++j)
                if (j < from || j > to || j >= nk) x[j] = kNegInf;
            }
            const float block_max = max_of(x, kKeyBlock);
            if (block_max == kNegInf) {  // nothing visible: the state stays
              alpha[g] = 1.f;
              std::fill(x, x + kKeyBlock, 0.f);
              continue;
            }
            const float m_new = std::max(m[r], block_max);
            alpha[g] = std::exp(m[r] - m_new);  // 0 when m was -inf
            l[r] = l[r] * alpha[g] + exp_shift_sum(x, kKeyBlock, m_new);  // hidden keys weigh 0
            m[r] = m_new;
          }
          accumulate_rows(sr, vrows.data(), nk, dv, alpha, acc.data() + r0 * dv);
        }
      }
      for (int64_t r = 0; r < nq; ++r) {
        const int64_t t = cq[b] + item.q0 + r;
        float* o = acc.data() + r * dv;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) o[c] *= inv;
        store_row(o, out + (t * heads + h) * dv, dv);
        if (lse != nullptr) lse[t * heads + h] = l[r] > 0.f ? m[r] + std::log(l[r]) : kNegInf;
      }
    }
  });
}

void check_operands(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cu_q, const at::Tensor& cu_k) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op, ": q, k and v must be [T, H, D]");
  TORCH_CHECK_VALUE(k.size(1) == q.size(1) && v.size(1) == q.size(1) && k.size(2) == q.size(2), op,
                    ": q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(), " disagree on heads or key width");
  TORCH_CHECK_VALUE(v.size(0) == k.size(0), op, ": k and v must have the same number of keys");
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
                    ": q, k and v must share a dtype");
  TORCH_CHECK_VALUE(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, op,
                    ": the last dimension of q, k and v must be contiguous");
  TORCH_CHECK_VALUE(cu_q.scalar_type() == at::kInt && cu_k.scalar_type() == at::kInt && cu_q.dim() == 1 &&
                        cu_k.sizes() == cu_q.sizes() && cu_q.size(0) >= 1,
                    op, ": cu_seqlens_q and cu_seqlens_k must be int32 [B + 1]");
}

// Checked request boundaries: ascending, ending at the tensors' lengths, and (causal) len_k >= len_q.
void check_lengths(const char* op, const int32_t* cq, const int32_t* ck, int64_t num_reqs, int64_t tq, int64_t tk,
                   bool causal) {
  TORCH_CHECK_VALUE(cq[0] == 0 && ck[0] == 0, op, ": cu_seqlens must start at 0");
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t len_q = cq[b + 1] - cq[b], len_k = ck[b + 1] - ck[b];
    TORCH_CHECK_VALUE(len_q >= 0 && len_k >= 0, op, ": cu_seqlens must not decrease (request ", b, ")");
    TORCH_CHECK_VALUE(!causal || len_k >= len_q, op, ": causal request ", b, " has ", len_k, " keys < ", len_q,
                      " queries");
  }
  TORCH_CHECK_VALUE(cq[num_reqs] == tq && ck[num_reqs] == tk, op, ": cu_seqlens end at ", cq[num_reqs], " and ",
                    ck[num_reqs], ", but q has ", tq, " tokens and k ", tk);
}

std::tuple<at::Tensor, at::Tensor> run(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, int64_t window,
                                       bool causal, bool partial) {
  check_operands(op, q, k, v, cu_q, cu_k);
  const at::Tensor cq = cu_q.contiguous(), ck = cu_k.contiguous();
  const int64_t num_reqs = cq.size(0) - 1;
  check_lengths(op, cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), num_reqs, q.size(0), k.size(0), causal);
  at::Tensor out = at::empty({q.size(0), q.size(1), v.size(2)}, q.options().dtype(partial ? at::kFloat : q.scalar_type()));
  at::Tensor lse;
  if (partial) lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mla_prefill", [&] {
    using T = scalar_t;
    if (partial)
      prefill_impl<T, float>(q, k, v, cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), num_reqs,
                             static_cast<float>(scale), 0, causal, out.data_ptr<float>(), lse.data_ptr<float>());
    else
      prefill_impl<T, T>(q, k, v, cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), num_reqs, static_cast<float>(scale),
                         window, true, out.data_ptr<T>(), nullptr);
  });
  return {out, lse};
}

at::Tensor mla_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                       const at::Tensor& cu_k, double scale, int64_t window) {
  TORCH_CHECK_VALUE(window >= 0, "mla_prefill: window must be >= 0 (0: none), got ", window);
  return std::get<0>(run("mla_prefill", q, k, v, cu_q, cu_k, scale, window, true, false));
}

std::tuple<at::Tensor, at::Tensor> mla_prefill_partial(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& cu_q, const at::Tensor& cu_k, double scale,
                                                       bool causal) {
  return run("mla_prefill_partial", q, k, v, cu_q, cu_k, scale, 0, causal, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("mla_prefill(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, "
        "int window) -> Tensor");
  m.def("mla_prefill_partial(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, "
        "bool causal) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("mla_prefill", &mla_prefill);
  m.impl("mla_prefill_partial", &mla_prefill_partial);
}
