// deepinfer fast CPU ops: paged MLA decode with an online softmax split along the KV, fused small ops.
//
// Registered as torch ops in the `deepinfer_cpu` namespace (see deepinfer/backends/cpu/native.py, which
// builds this file with torch.utils.cpp_extension and documents each op's contract). Every kernel reads
// its inputs once, computes in float32 and writes each output element exactly once. Parallelism is
// at::parallel_for (torch's OpenMP pool, so DEEPINFER_NUM_THREADS / torch.set_num_threads apply).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "common.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using deepinfer_cpu::fast_exp;
using deepinfer_cpu::load_row;
using deepinfer_cpu::store_row;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// a . b in an order fixed by n alone: element i goes to lane i % 16 (each lane summed in index order),
// then the 16 lanes are added in order. Never reassociated by the compiler (no fast-math, no reduction
// clause), so the bits do not depend on the pointers' alignment or on which thread runs it.
inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t kLanes = 16;
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) lane[j] += a[i + j] * b[i + j];
  }
  for (int64_t j = 0; i + j < n; ++j) lane[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) s += lane[j];
  return s;
}

// ------------------------------------------------------------------------------------- MLA decode

constexpr int64_t kTile = 16;  // keys per tile (one reference-layout block)
constexpr int64_t kHeadGroup = 4;  // query rows scored together (independent accumulators)
constexpr int64_t kChunk = 64;  // output columns accumulated in registers

// tile [cnt, width] -> tile_t [width, kTile], zero-padding keys cnt..kTile. A full tile moves 8 x 8 blocks
// through AVX registers where the CPU has them (an exact copy either way).
inline void transpose_tile(const float* tile, float* tile_t, int64_t cnt, int64_t width) {
  int64_t c0 = 0;
#ifdef __AVX2__
  if (cnt == kTile) {
    for (; c0 + 8 <= width; c0 += 8)
      for (int64_t r0 = 0; r0 < kTile; r0 += 8) {
        __m256 v[8], t[8];
        for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(tile + (r0 + i) * width + c0);
        for (int i = 0; i < 8; i += 2) {
          t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
          t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
          v[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
          v[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
          v[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
          v[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
        }
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_ps(tile_t + (c0 + i) * kTile + r0, _mm256_permute2f128_ps(v[i], v[i + 4], 0x20));
          _mm256_storeu_ps(tile_t + (c0 + i + 4) * kTile + r0, _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
        }
      }
  }
#endif
  for (int64_t c = c0; c < width; ++c)
    for (int64_t r = 0; r < kTile; ++r) tile_t[c * kTile + r] = r < cnt ? tile[r * width + c] : 0.f;
}

// scores[row, r] = scale * q[row] . key[r] for all rows, vectorised over the kTile keys.
inline void score_tile(const float* q, const float* tile_t, float* scores, int64_t nrows, int64_t width,
                       float scale) {
  int64_t row = 0;
  for (; row + kHeadGroup <= nrows; row += kHeadGroup) {
    float s[kHeadGroup][kTile] = {};
    for (int64_t c = 0; c < width; ++c) {
      const float* kt = tile_t + c * kTile;
      for (int64_t g = 0; g < kHeadGroup; ++g) {
        const float qv = q[(row + g) * width + c];
#pragma omp simd
        for (int64_t r = 0; r < kTile; ++r) s[g][r] += qv * kt[r];
      }
    }
    for (int64_t g = 0; g < kHeadGroup; ++g)
      for (int64_t r = 0; r < kTile; ++r) scores[(row + g) * kTile + r] = s[g][r] * scale;
  }
  for (; row < nrows; ++row) {
    float s[kTile] = {};
    for (int64_t c = 0; c < width; ++c) {
      const float qv = q[row * width + c];
#pragma omp simd
      for (int64_t r = 0; r < kTile; ++r) s[r] += qv * tile_t[c * kTile + r];
    }
    for (int64_t r = 0; r < kTile; ++r) scores[row * kTile + r] = s[r] * scale;
  }
}

// acc[:latent] = alpha * acc + sum_r p[r] * tile[r, :latent], kChunk columns at a time in registers.
inline void accumulate_tile(const float* p, const float* tile, float* acc, float alpha, int64_t cnt,
                            int64_t width, int64_t latent) {
  int64_t c0 = 0;
  for (; c0 + kChunk <= latent; c0 += kChunk) {
    float t[kChunk];
#pragma omp simd
    for (int64_t c = 0; c < kChunk; ++c) t[c] = acc[c0 + c] * alpha;
    for (int64_t r = 0; r < cnt; ++r) {
      const float pr = p[r];
      const float* kr = tile + r * width + c0;
#pragma omp simd
      for (int64_t c = 0; c < kChunk; ++c) t[c] += pr * kr[c];
    }
#pragma omp simd
    for (int64_t c = 0; c < kChunk; ++c) acc[c0 + c] = t[c];
  }
  for (int64_t c = c0; c < latent; ++c) {
    float t = acc[c] * alpha;
    for (int64_t r = 0; r < cnt; ++r) t += p[r] * tile[r * width + c];
    acc[c] = t;
  }
}

struct Split {
  int64_t req, begin, end, row0;  // keys [begin, end) of request `req`; workspace rows from row0
};

template <typename cache_t, typename out_t>
void mla_decode_impl(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     int64_t window, int64_t latent, at::Tensor& out) {
  const int64_t num_reqs = seq_lens.size(0), heads = q.size(1), width = q.size(2);
  const int64_t block_size = cache.size(1), table_width = block_table.size(1);
  const float* qp = q.data_ptr<float>();
  const cache_t* cp = cache.data_ptr<cache_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t cache_blocks = cache.size(0);

  // Key range of each request: [lo, len), lo > 0 only with a sliding window.
  std::vector<int64_t> lo(num_reqs), hi(num_reqs);
  int64_t total_keys = 0;
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t n = qsl[b + 1] - qsl[b], len = lens[b];
    TORCH_CHECK(n >= 0 && n <= len, "mla_decode: request ", b, " has ", n, " query tokens but seq_len ", len);
    TORCH_CHECK((len + block_size - 1) / block_size <= table_width, "mla_decode: request ", b,
                " needs more blocks than block_table has columns");
    hi[b] = len;
    lo[b] = window > 0 ? std::max<int64_t>(0, len - n - window + 1) : 0;
    total_keys += n > 0 ? hi[b] - lo[b] : 0;
  }
  // Split along the KV so that every thread has work even for one long request: about four splits per
  // thread over the whole batch, never shorter than four blocks (the merge then costs little).
  const int64_t threads = at::get_num_threads();
  const int64_t split_len =
      std::max<int64_t>(4 * block_size, (total_keys + 4 * threads - 1) / (4 * threads));
  std::vector<Split> splits;
  int64_t rows = 0;
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t n = qsl[b + 1] - qsl[b];
    if (n == 0) continue;
    for (int64_t s = lo[b]; s < hi[b]; s += split_len) {
      splits.push_back({b, s, std::min(hi[b], s + split_len), rows});
      rows += n * heads;
    }
  }
  // Workspace: per split and (query, head) row, the running max, the sum of exponentials, and the
  // unnormalised output. Its size is bounded by the batch's queries times splits, not the context.
  std::vector<float> m_ws(rows), l_ws(rows), acc_ws(rows * latent);

  at::parallel_for(0, static_cast<int64_t>(splits.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<float> tile(kTile * width), tile_t(width * kTile), scores;
    for (int64_t si = first; si < last; ++si) {
      const Split& sp = splits[si];
      const int64_t b = sp.req, q0 = qsl[b], n = qsl[b + 1] - q0, len = lens[b], nrows = n * heads;
      float* m = m_ws.data() + sp.row0;
      float* l = l_ws.data() + sp.row0;
      float* acc = acc_ws.data() + sp.row0 * latent;
      std::fill(m, m + nrows, kNegInf);
      std::fill(l, l + nrows, 0.f);
      std::fill(acc, acc + nrows * latent, 0.f);
      scores.resize(nrows * kTile);
      const float* qrows = qp + q0 * heads * width;  // this request's (query, head) rows, contiguous
      for (int64_t j0 = sp.begin; j0 < sp.end;) {
        const int64_t blk = j0 / block_size, off0 = j0 % block_size;
        const int64_t cnt = std::min({sp.end - j0, block_size - off0, kTile});
        const int64_t phys = table[b * table_width + blk];
        TORCH_CHECK(phys >= 0 && phys < cache_blocks, "mla_decode: block id ", phys, " out of range");
        // Each cached row is read from memory once, in place, into a float tile (and its transpose).
        const cache_t* base = cp + (phys * block_size + off0) * width;
        for (int64_t r = 0; r < cnt; ++r) load_row(base + r * width, tile.data() + r * width, width);
        transpose_tile(tile.data(), tile_t.data(), cnt, width);
        score_tile(qrows, tile_t.data(), scores.data(), nrows, width, static_cast<float>(scale));
        for (int64_t row = 0; row < nrows; ++row) {
          const int64_t pos = len - n + row / heads;  // the query's position; it sees (pos - window, pos]
          float* sc = scores.data() + row * kTile;
          float block_max = kNegInf;
          for (int64_t r = 0; r < kTile; ++r) {
            const int64_t j = j0 + r;
            const bool visible = r < cnt && j <= pos && (window <= 0 || j > pos - window);
            if (!visible) sc[r] = kNegInf;
            block_max = std::max(block_max, sc[r]);
          }
          if (block_max == kNegInf) continue;
          const float m_new = std::max(m[row], block_max);
          const float alpha = std::exp(m[row] - m_new);  // 0 when m was -inf
          float lsum = l[row] * alpha;
#pragma omp simd reduction(+ : lsum)
          for (int64_t r = 0; r < kTile; ++r) {
            sc[r] = fast_exp(sc[r] - m_new);  // 0 for hidden keys (-inf) and for the padding past cnt
            lsum += sc[r];
          }
          l[row] = lsum;
          m[row] = m_new;
          accumulate_tile(sc, tile.data(), acc + row * latent, alpha, cnt, width, latent);
        }
        j0 += cnt;
      }
    }
  });

  // Merge the splits of each request with their log-sum-exp weights; one output row per (token, head).
  std::vector<int64_t> first_split(num_reqs + 1, static_cast<int64_t>(splits.size()));
  for (int64_t si = static_cast<int64_t>(splits.size()) - 1; si >= 0; --si) first_split[splits[si].req] = si;
  for (int64_t b = num_reqs - 1; b >= 0; --b)
    if (first_split[b] == static_cast<int64_t>(splits.size())) first_split[b] = first_split[b + 1];
  out_t* op = out.data_ptr<out_t>();
  at::parallel_for(0, num_reqs, 1, [&](int64_t first, int64_t last) {
    std::vector<float> merged(latent);
    for (int64_t b = first; b < last; ++b) {
      const int64_t q0 = qsl[b], nrows = (qsl[b + 1] - q0) * heads;
      const int64_t s0 = first_split[b], s1 = first_split[b + 1];
      for (int64_t row = 0; row < nrows; ++row) {
        float m_all = kNegInf;
        for (int64_t s = s0; s < s1; ++s) m_all = std::max(m_all, m_ws[splits[s].row0 + row]);
        std::fill(merged.begin(), merged.end(), 0.f);
        float denom = 0.f;
        if (m_all != kNegInf) {
          for (int64_t s = s0; s < s1; ++s) {
            const int64_t r = splits[s].row0 + row;
            if (m_ws[r] == kNegInf) continue;
            const float w = std::exp(m_ws[r] - m_all);
            denom += w * l_ws[r];
            const float* a = acc_ws.data() + r * latent;
#pragma omp simd
            for (int64_t c = 0; c < latent; ++c) merged[c] += w * a[c];
          }
        }
        const float inv = denom > 0.f ? 1.f / denom : 0.f;
#pragma omp simd
        for (int64_t c = 0; c < latent; ++c) merged[c] *= inv;
        store_row(merged.data(), op + (q0 * heads + row) * latent, latent);
      }
    }
  });
}

// ------------------------------------------------------------------------ batch-invariant MLA attention

// Deterministic mode's attention: a query row's bits depend only on its own query and the keys it sees
// (positions <= its own, inside its window), never on the other rows of the call. Each row runs one
// online softmax over key tiles at fixed positions (cut every kTile keys from position 0, and at cache
// block boundaries), in ascending order, from the first tile holding a key it sees to the one holding its
// own position. Rows are processed kHeadGroup at a time (a zero-padded group, so every row goes through
// the same code whatever its group and the call's size): scores of the group against a tile, then per
// row the tile's maximum over its visible keys and exp, then one update of the group's outputs over all
// kTile keys, a key the row does not see weighing exactly 0 (adding 0 x a finite key changes no bit; a
// row that sees no key of the tile keeps its state, scaled by exactly 1). Work items are blocks of
// kRowBlock consecutive (token, head) rows of one request, sharing each transposed tile; items share
// nothing, so how the batch is cut and the thread count never reach the arithmetic. No split along the
// KV: one request's rows are parallel only across blocks.
constexpr int64_t kRowBlock = 64;  // (token, head) rows per work item
constexpr int64_t kCols = 16;  // output columns per register block of the group update

// acc[g][:latent] = alpha[g] * acc[g] + sum_r p[g][r] * tile[r, :latent] for the kHeadGroup rows of a group,
// every (row, column) summed over r = 0..kTile-1 in order; tile rows past the tile's keys are zero.
inline void accumulate_group(const float* p, const float* tile, float* acc, const float* alpha, int64_t width,
                             int64_t latent) {
  int64_t c0 = 0;
  for (; c0 + kCols <= latent; c0 += kCols) {
    float t[kHeadGroup][kCols];
    for (int64_t g = 0; g < kHeadGroup; ++g) {
#pragma omp simd
      for (int64_t c = 0; c < kCols; ++c) t[g][c] = acc[g * latent + c0 + c] * alpha[g];
    }
    for (int64_t r = 0; r < kTile; ++r) {
      const float* kr = tile + r * width + c0;
      for (int64_t g = 0; g < kHeadGroup; ++g) {
        const float pr = p[g * kTile + r];
#pragma omp simd
        for (int64_t c = 0; c < kCols; ++c) t[g][c] += pr * kr[c];
      }
    }
    for (int64_t g = 0; g < kHeadGroup; ++g) {
#pragma omp simd
      for (int64_t c = 0; c < kCols; ++c) acc[g * latent + c0 + c] = t[g][c];
    }
  }
  for (int64_t g = 0; g < kHeadGroup; ++g)
    for (int64_t c = c0; c < latent; ++c) {
      float t = acc[g * latent + c] * alpha[g];
      for (int64_t r = 0; r < kTile; ++r) t += p[g * kTile + r] * tile[r * width + c];
      acc[g * latent + c] = t;
    }
}

template <typename cache_t, typename out_t>
void mla_attention_invariant_impl(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                  int64_t window, int64_t latent, at::Tensor& out) {
  const int64_t num_reqs = seq_lens.size(0), heads = q.size(1), width = q.size(2);
  const int64_t block_size = cache.size(1), table_width = block_table.size(1);
  const float* qp = q.data_ptr<float>();
  const cache_t* cp = cache.data_ptr<cache_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t cache_blocks = cache.size(0);
  struct Item {
    int64_t req, row0, rows;  // rows [row0, row0 + rows) of request `req`'s (token, head) rows
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t n = qsl[b + 1] - qsl[b], len = lens[b];
    TORCH_CHECK(n >= 0 && n <= len, "mla_decode: request ", b, " has ", n, " query tokens but seq_len ", len);
    TORCH_CHECK((len + block_size - 1) / block_size <= table_width, "mla_decode: request ", b,
                " needs more blocks than block_table has columns");
    for (int64_t r0 = 0; r0 < n * heads; r0 += kRowBlock)
      items.push_back({b, r0, std::min(kRowBlock, n * heads - r0)});
  }
  const float fscale = static_cast<float>(scale);
  out_t* op = out.data_ptr<out_t>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t first, int64_t last) {
    constexpr int64_t kMaxRows = (kRowBlock + kHeadGroup - 1) / kHeadGroup * kHeadGroup;
    std::vector<float> tile(kTile * width), tile_t(width * kTile), qblock(kMaxRows * width);
    std::vector<float> m(kMaxRows), l(kMaxRows), acc(kMaxRows * latent);
    std::vector<int64_t> pos(kMaxRows), from(kMaxRows);
    float sc[kHeadGroup * kTile], alpha[kHeadGroup];
    for (int64_t it = first; it < last; ++it) {
      const Item& item = items[it];
      const int64_t b = item.req, n = qsl[b + 1] - qsl[b], len = lens[b];
      const int64_t padded = (item.rows + kHeadGroup - 1) / kHeadGroup * kHeadGroup;
      const float* qrows = qp + (qsl[b] * heads + item.row0) * width;
      std::copy(qrows, qrows + item.rows * width, qblock.begin());
      std::fill(qblock.begin() + item.rows * width, qblock.begin() + padded * width, 0.f);
      int64_t lo = len, hi = 0;  // keys the block sees: [lo, hi)
      for (int64_t row = 0; row < padded; ++row) {
        // Padding rows take the block's last row's position: they see keys, and are never stored.
        pos[row] = len - n + (item.row0 + std::min(row, item.rows - 1)) / heads;
        from[row] = window > 0 ? std::max<int64_t>(0, pos[row] - window + 1) : 0;  // first visible key
        lo = std::min(lo, from[row]);
        hi = std::max(hi, pos[row] + 1);
      }
      std::fill(m.begin(), m.begin() + padded, kNegInf);
      std::fill(l.begin(), l.begin() + padded, 0.f);
      std::fill(acc.begin(), acc.begin() + padded * latent, 0.f);
      for (int64_t j0 = lo / kTile * kTile; j0 < hi;) {
        const int64_t blk = j0 / block_size, off0 = j0 % block_size;
        const int64_t cnt = std::min({hi - j0, block_size - off0, kTile - j0 % kTile});
        const int64_t phys = table[b * table_width + blk];
        TORCH_CHECK(phys >= 0 && phys < cache_blocks, "mla_decode: block id ", phys, " out of range");
        const cache_t* base = cp + (phys * block_size + off0) * width;
        for (int64_t r = 0; r < cnt; ++r) load_row(base + r * width, tile.data() + r * width, width);
        std::fill(tile.begin() + cnt * width, tile.end(), 0.f);
        if (j0 + cnt < hi) {  // the next tile's rows, while this one is computed
          const int64_t next = table[b * table_width + (j0 + cnt) / block_size];
          if (next >= 0 && next < cache_blocks) {
            const char* nb = reinterpret_cast<const char*>(cp + (next * block_size + (j0 + cnt) % block_size) * width);
            for (int64_t byte = 0; byte < kTile * width * static_cast<int64_t>(sizeof(cache_t)); byte += 64)
              __builtin_prefetch(nb + byte);
          }
        }
        transpose_tile(tile.data(), tile_t.data(), kTile, width);  // the zero rows too: one full tile
        for (int64_t g0 = 0; g0 < padded; g0 += kHeadGroup) {
          bool any = false;  // does a row of the group see a key of this tile?
          bool whole = cnt == kTile;  // ... does every row of the group see all its keys?
          for (int64_t g = 0; g < kHeadGroup; ++g) {
            any |= pos[g0 + g] >= j0 && from[g0 + g] < j0 + cnt;
            whole &= pos[g0 + g] >= j0 + kTile - 1 && from[g0 + g] <= j0;
          }
          if (!any) continue;
          score_tile(qblock.data() + g0 * width, tile_t.data(), sc, kHeadGroup, width, fscale);
          for (int64_t g = 0; g < kHeadGroup; ++g) {
            const int64_t row = g0 + g, p = pos[row], f = from[row];
            float* s = sc + g * kTile;
            float tile_max = kNegInf;  // a maximum: the same in any order, so both branches agree
            if (whole) {
#pragma omp simd reduction(max : tile_max)
              for (int64_t r = 0; r < kTile; ++r) tile_max = std::max(tile_max, s[r]);
            } else {
              for (int64_t r = 0; r < kTile; ++r) {
                const int64_t j = j0 + r;
                if (!(r < cnt && j <= p && j >= f)) s[r] = kNegInf;
                tile_max = std::max(tile_max, s[r]);
              }
            }
            if (tile_max == kNegInf) {  // nothing visible: the state stays, bit for bit
              alpha[g] = 1.f;
              std::fill(s, s + kTile, 0.f);
              continue;
            }
            const float m_new = std::max(m[row], tile_max);
            alpha[g] = std::exp(m[row] - m_new);  // 0 when m was -inf
            float lsum = l[row] * alpha[g];
#pragma omp simd reduction(+ : lsum)
            for (int64_t r = 0; r < kTile; ++r) {
              s[r] = fast_exp(s[r] - m_new);  // 0 for hidden keys (-inf) and the padding past cnt
              lsum += s[r];
            }
            l[row] = lsum;
            m[row] = m_new;
          }
          accumulate_group(sc, tile.data(), acc.data() + g0 * latent, alpha, width, latent);
        }
        j0 += cnt;
      }
      for (int64_t row = 0; row < item.rows; ++row) {
        float* a = acc.data() + row * latent;
        const float inv = l[row] > 0.f ? 1.f / l[row] : 0.f;
#pragma omp simd
        for (int64_t c = 0; c < latent; ++c) a[c] *= inv;
        store_row(a, op + (qsl[b] * heads + item.row0 + row) * latent, latent);
      }
    }
  });
}

// The checks and operand preparation both attention kernels share; `invariant` picks the schedule.
at::Tensor mla_attention(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, double scale, int64_t window, bool invariant) {
  TORCH_CHECK(q_nope.dim() == 3 && q_pe.dim() == 3, "mla_decode: q_nope and q_pe must be [T, H, *]");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous(), "mla_decode: cache must be a contiguous [N, bs, L+R]");
  const int64_t latent = q_nope.size(2);
  TORCH_CHECK(cache.size(2) == latent + q_pe.size(2), "mla_decode: cache width ", cache.size(2),
              " != L + R = ", latent + q_pe.size(2));
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "mla_decode: block_table, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1, "mla_decode: query_start_loc must be [B+1]");
  const at::Tensor q = at::cat({q_nope, q_pe}, -1).to(at::kFloat).contiguous();
  const at::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous();
  const at::Tensor qsl = query_start_loc.contiguous();
  TORCH_CHECK(qsl[-1].item<int64_t>() == q.size(0), "mla_decode: query_start_loc[-1] != number of tokens");
  at::Tensor out = at::empty({q.size(0), q.size(1), latent}, q_nope.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "mla_decode_cache", [&] {
    using cache_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "mla_decode_out", [&] {
      if (invariant)
        mla_attention_invariant_impl<cache_t, scalar_t>(q, cache, table, lens, qsl, scale, window, latent, out);
      else
        mla_decode_impl<cache_t, scalar_t>(q, cache, table, lens, qsl, scale, window, latent, out);
    });
  });
  return out;
}

at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& cache,
                      const at::Tensor& block_table, const at::Tensor& seq_lens,
                      const at::Tensor& query_start_loc, double scale, int64_t window) {
  return mla_attention(q_nope, q_pe, cache, block_table, seq_lens, query_start_loc, scale, window, false);
}

at::Tensor mla_decode_invariant(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, double scale, int64_t window) {
  return mla_attention(q_nope, q_pe, cache, block_table, seq_lens, query_start_loc, scale, window, true);
}

// ------------------------------------------------------------------------------------- KV cache write

void kv_cache_write(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_c.dim() == 2 && k_pe.dim() == 2 && kv_c.size(0) == k_pe.size(0),
              "kv_cache_write: kv_c [T, L] and k_pe [T, R] must have the same T");
  TORCH_CHECK(cache.is_contiguous() && cache.size(2) == kv_c.size(1) + k_pe.size(1),
              "kv_cache_write: cache must be contiguous [N, bs, L+R]");
  const int64_t tokens = kv_c.size(0), latent = kv_c.size(1), rope = k_pe.size(1), width = cache.size(2);
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const at::Tensor c = kv_c.to(at::kFloat).contiguous(), p = k_pe.to(at::kFloat).contiguous();
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.size(0) == tokens, "kv_cache_write: slot_mapping must be [T]");
  const float* cp = c.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] < num_slots, "kv_cache_write: slot ", sp[t], " out of range (", num_slots, " slots)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "kv_cache_write", [&] {
    scalar_t* dst = cache.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 256, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {
        if (sp[t] < 0) continue;  // padding token
        store_row(cp + t * latent, dst + sp[t] * width, latent);
        store_row(pp + t * rope, dst + sp[t] * width + latent, rope);
      }
    });
  });
}

// ------------------------------------------------------------------------------------- small fused ops

// Rows of the last dimension processed in parallel; grain chosen so small inputs stay on one thread.
inline int64_t grain_for(int64_t row_width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_width)); }

template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, grain_for(dim), [&](int64_t first, int64_t last) {
    std::vector<float> xf(dim), wf(dim);
    load_row(w, wf.data(), dim);
    for (int64_t r = first; r < last; ++r) {
      load_row(x + r * dim, xf.data(), dim);
      const float inv = 1.f / std::sqrt(dot(xf.data(), xf.data(), dim) / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) xf[i] = xf[i] * inv * wf[i];
      store_row(xf.data(), out + r * dim, dim);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim, "rms_norm: weight must be [", dim, "]");
  const at::Tensor xc = x.contiguous(), wc = weight.to(x.scalar_type()).contiguous();
  at::Tensor out = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), xc.numel() / dim,
             dim, static_cast<float>(eps));
  });
  return out;
}

template <typename T>
void add_rms_rows(const T* xp, const T* rp, const T* wp, T* sp, T* np, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, grain_for(dim), [&](int64_t first, int64_t last) {
    std::vector<float> sf(dim), wf(dim);
    load_row(wp, wf.data(), dim);
    for (int64_t r = first; r < last; ++r) {
      for (int64_t i = 0; i < dim; ++i) {
        // The sum is rounded to the input dtype, as an unfused `x + residual` would be.
        const T s = static_cast<T>(static_cast<float>(xp[r * dim + i]) + static_cast<float>(rp[r * dim + i]));
        sp[r * dim + i] = s;
        sf[i] = static_cast<float>(s);
      }
      const float inv = 1.f / std::sqrt(dot(sf.data(), sf.data(), dim) / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) sf[i] = sf[i] * inv * wf[i];
      store_row(sf.data(), np + r * dim, dim);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm: x and residual must have the same shape and dtype");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim, "add_rms_norm: weight must be [", dim, "]");
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = weight.to(x.scalar_type()).contiguous();
  at::Tensor summed = at::empty_like(xc), normed = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_rows(xc.data_ptr<scalar_t>(), rc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                 summed.data_ptr<scalar_t>(), normed.data_ptr<scalar_t>(), xc.numel() / dim, dim,
                 static_cast<float>(eps));
  });
  return {normed, summed};
}

// silu(gate) * up for x = [gate | up] rows [rows, 2I] -> [rows, I], in float32: each row in blocks of 16
// elements through a local buffer, so every element is computed by the same vector code (no scalar tail,
// no alignment peeling) whatever the row's place in the batch or the thread that runs it.
template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t inter) {
  constexpr int64_t kBlock = 16;
  at::parallel_for(0, rows, grain_for(2 * inter), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* gate = x + r * 2 * inter;
      const T* up = gate + inter;
      for (int64_t i0 = 0; i0 < inter; i0 += kBlock) {
        const int64_t n = std::min(kBlock, inter - i0);
        float g[kBlock] = {}, u[kBlock] = {}, o[kBlock];
        for (int64_t i = 0; i < n; ++i) {
          g[i] = static_cast<float>(gate[i0 + i]);
          u[i] = static_cast<float>(up[i0 + i]);
        }
#pragma omp simd
        for (int64_t i = 0; i < kBlock; ++i) o[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
        for (int64_t i = 0; i < n; ++i) out[r * inter + i0 + i] = static_cast<T>(o[i]);
      }
    }
  });
}

at::Tensor silu_and_mul_invariant(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: the last dimension must be even");
  const int64_t inter = x.size(-1) / 2;
  const at::Tensor xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_mul_rows(xc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), xc.numel() / std::max<int64_t>(1, 2 * inter),
                  inter);
  });
  return out;
}

template <typename T>
inline void rotate(const T* src, T* dst, const float* cs, int64_t rope, bool interleaved) {
  const int64_t half = rope / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const float x1 = static_cast<float>(src[a]), x2 = static_cast<float>(src[b]);
    const float c = cs[i], s = cs[half + i];
    dst[a] = static_cast<T>(x1 * c - x2 * s);
    dst[b] = static_cast<T>(x2 * c + x1 * s);
  }
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                        const at::Tensor& cos_sin_cache, bool interleaved) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 2 && q.size(0) == k.size(0) && q.size(2) == k.size(1),
              "rope: q must be [T, H, R] and k [T, R]");
  const int64_t tokens = q.size(0), heads = q.size(1), rope_dim = q.size(2);
  TORCH_CHECK(rope_dim % 2 == 0 && cos_sin_cache.size(1) == rope_dim, "rope: cos_sin_cache must be [P, R]");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), pos = positions.to(at::kLong).contiguous();
  const at::Tensor table = cos_sin_cache.to(at::kFloat).contiguous();
  const int64_t max_pos = table.size(0);
  at::Tensor q_out = at::empty_like(qc), k_out = at::empty_like(kc);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rope: position ", pp[t], " outside the cos/sin table");
  const float* cs = table.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope", [&] {
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    scalar_t* qo = q_out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain_for(heads * rope_dim), [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t)
        for (int64_t h = 0; h < heads; ++h)
          rotate(qp + (t * heads + h) * rope_dim, qo + (t * heads + h) * rope_dim, cs + pp[t] * rope_dim,
                 rope_dim, interleaved);
    });
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "rope_k", [&] {
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    scalar_t* ko = k_out.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t)
      rotate(kp + t * rope_dim, ko + t * rope_dim, cs + pp[t] * rope_dim, rope_dim, interleaved);
  });
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY(deepinfer_cpu, m) {
  m.def("mla_decode(Tensor q_nope, Tensor q_pe, Tensor cache, Tensor block_table, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int window) -> Tensor");
  m.def("mla_decode_invariant(Tensor q_nope, Tensor q_pe, Tensor cache, Tensor block_table, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int window) -> Tensor");
  m.def("kv_cache_write(Tensor kv_c, Tensor k_pe, Tensor(a!) cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul_invariant(Tensor x) -> Tensor");
  m.def("rope(Tensor q, Tensor k, Tensor positions, Tensor cos_sin_cache, bool interleaved) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("mla_decode", &mla_decode);
  m.impl("mla_decode_invariant", &mla_decode_invariant);
  m.impl("kv_cache_write", &kv_cache_write);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul_invariant", &silu_and_mul_invariant);
  m.impl("rope", &rope);
}
