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
#include "activation.h"
#include "skinny.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using deepinfer_cpu::load_row;
using deepinfer_cpu::max_of;
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

// ------------------------------------------------------------------------------------- MLA attention
//
// Both attention kernels (the default decode kernel and deterministic mode's invariant one) run the same
// work item: a block of at most kRowBlock consecutive (token, head) rows of one request against a range
// of its keys, walked in tiles of kTile keys cut at fixed positions (every kTile keys from position 0, and
// at cache-block boundaries). Per tile: its rows (one contiguous run of a cache block) are read once, front
// to back, into a zero-padded float32 tile (widened from bf16/fp16), the rows kPrefetchTiles tiles ahead
// are requested (blocks lie anywhere in the cache, so the hardware prefetcher cannot guess them), the
// tile is transposed once in L1 for all the block's rows, and rows are scored and updated in zero-padded
// groups of kHeadGroup by one code path: an online softmax (running max, sum of exponentials, unnormalised
// float32 output), a key a row does not see weighing exactly 0. Items share nothing, so how the batch is
// cut and the thread count never reach a row's arithmetic within one item.
//
// The default kernel also splits a request's keys into ranges when the batch alone cannot keep every
// thread busy (one long request), and merges a row's ranges by their log-sum-exp; the invariant kernel
// never splits (one range per row, so a row's bits depend on its own query and keys only).

constexpr int64_t kTile = 16;      // keys per tile (one reference-layout block)
constexpr int64_t kHeadGroup = 4;  // query rows scored together (independent accumulators)
constexpr int64_t kRowBlock = 64;  // (token, head) rows per work item
constexpr int64_t kCols = 16;      // output columns per register block of the group update
constexpr int64_t kWideCols = 64;  // ... where the latent has that many left
constexpr int64_t kPrefetchTiles = 2;  // tiles requested ahead of the one being read
constexpr int64_t kMaxRows = (kRowBlock + kHeadGroup - 1) / kHeadGroup * kHeadGroup;

// tile [kTile, width] (zero-padded past its keys) -> tile_t [width, kTile], in 8 x 8 blocks through AVX
// registers where the CPU has them (an exact copy either way).
inline void transpose_tile(const float* tile, float* tile_t, int64_t width) {
  int64_t c0 = 0;
#ifdef __AVX2__
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
#endif
  for (int64_t c = c0; c < width; ++c)
    for (int64_t r = 0; r < kTile; ++r) tile_t[c * kTile + r] = tile[r * width + c];
}

// scores[row, r] = scale * q[row] . key[r] for all rows, vectorised over the kTile keys.
inline void score_tile(const float* q, const float* tile_t, float* scores, int64_t nrows, int64_t width,
                       float scale) {
  int64_t row = 0;
  for (; row + kHeadGroup <= nrows; row += kHeadGroup) {
    // Even and odd columns into separate accumulators (2 x kHeadGroup chains hide the FMA latency), added
    // at the end: a fixed order for every row.
    float s[2][kHeadGroup][kTile] = {};
    int64_t c = 0;
    for (; c + 2 <= width; c += 2)
      for (int64_t h = 0; h < 2; ++h) {
        const float* kt = tile_t + (c + h) * kTile;
        for (int64_t g = 0; g < kHeadGroup; ++g) {
          const float qv = q[(row + g) * width + c + h];
#pragma omp simd
          for (int64_t r = 0; r < kTile; ++r) s[h][g][r] += qv * kt[r];
        }
      }
    for (; c < width; ++c)
      for (int64_t g = 0; g < kHeadGroup; ++g) {
        const float qv = q[(row + g) * width + c];
#pragma omp simd
        for (int64_t r = 0; r < kTile; ++r) s[0][g][r] += qv * tile_t[c * kTile + r];
      }
    for (int64_t g = 0; g < kHeadGroup; ++g)
      for (int64_t r = 0; r < kTile; ++r) scores[(row + g) * kTile + r] = (s[0][g][r] + s[1][g][r]) * scale;
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

// acc[g][c0:c0+Cols] = alpha[g] * acc[g] + sum_r p[g][r] * tile[r, c0:c0+Cols]: kHeadGroup x Cols
// accumulators held in registers across the kTile keys.
template <int64_t Cols>
inline void accumulate_cols(const float* p, const float* tile, float* acc, const float* alpha, int64_t width,
                            int64_t latent, int64_t c0) {
  float t[kHeadGroup][Cols];
  for (int64_t g = 0; g < kHeadGroup; ++g) {
#pragma omp simd
    for (int64_t c = 0; c < Cols; ++c) t[g][c] = acc[g * latent + c0 + c] * alpha[g];
  }
  for (int64_t r = 0; r < kTile; ++r) {
    const float* kr = tile + r * width + c0;
    for (int64_t g = 0; g < kHeadGroup; ++g) {
      const float pr = p[g * kTile + r];
#pragma omp simd
      for (int64_t c = 0; c < Cols; ++c) t[g][c] += pr * kr[c];
    }
  }
  for (int64_t g = 0; g < kHeadGroup; ++g) {
#pragma omp simd
    for (int64_t c = 0; c < Cols; ++c) acc[g * latent + c0 + c] = t[g][c];
  }
}

// acc[g][:latent] = alpha[g] * acc[g] + sum_r p[g][r] * tile[r, :latent] for the kHeadGroup rows of a group,
// every (row, column) summed over r = 0..kTile-1 in order; tile rows past the tile's keys are zero. Columns
// go in register blocks of kWideCols (16 independent accumulators: enough to hide the FMA latency), then
// kCols, then one at a time: the same sums in the same order whatever the block.
inline void accumulate_group(const float* p, const float* tile, float* acc, const float* alpha, int64_t width,
                             int64_t latent) {
  int64_t c0 = 0;
  for (; c0 + kWideCols <= latent; c0 += kWideCols)
    accumulate_cols<kWideCols>(p, tile, acc, alpha, width, latent, c0);
  for (; c0 + kCols <= latent; c0 += kCols) accumulate_cols<kCols>(p, tile, acc, alpha, width, latent, c0);
  for (int64_t g = 0; g < kHeadGroup; ++g)
    for (int64_t c = c0; c < latent; ++c) {
      float t = acc[g * latent + c] * alpha[g];
      for (int64_t r = 0; r < kTile; ++r) t += p[g * kTile + r] * tile[r * width + c];
      acc[g * latent + c] = t;
    }
}

// Rows [row0, row0 + rows) of request `req`'s (token, head) rows against its keys [key_lo, key_hi).
struct Work {
  int64_t req, row0, rows, key_lo, key_hi;
};

// What one work item leaves: per padded row, the running max m, the sum of exponentials l and the
// unnormalised output acc [latent]; padding rows (past `rows`) are computed and never read.
struct RowState {
  std::vector<float> m, l, acc;
  explicit RowState(int64_t latent) : m(kMaxRows), l(kMaxRows), acc(kMaxRows * latent) {}
};

// The operands every work item of a call reads.
template <typename cache_t>
struct Operands {
  const float* q;  // [T, H, width] float32, contiguous
  const cache_t* cache;
  const int32_t* table;
  const int32_t* lens;
  const int32_t* qsl;
  int64_t heads, width, latent, block_size, table_width, cache_blocks, window;
  float scale;
};

// Per-thread buffers of attend().
struct Scratch {
  std::vector<float> tile, tile_t, qblock;
  std::vector<int64_t> pos, from;
  explicit Scratch(int64_t width)
      : tile(kTile * width), tile_t(width * kTile), qblock(kMaxRows * width), pos(kMaxRows), from(kMaxRows) {}
};

template <typename cache_t>
void attend(const Operands<cache_t>& o, const Work& w, Scratch& s, RowState& st) {
  const int64_t b = w.req, n = o.qsl[b + 1] - o.qsl[b], len = o.lens[b], width = o.width, latent = o.latent;
  const int64_t padded = (w.rows + kHeadGroup - 1) / kHeadGroup * kHeadGroup;
  const float* qrows = o.q + (o.qsl[b] * o.heads + w.row0) * width;
  std::copy(qrows, qrows + w.rows * width, s.qblock.begin());
  std::fill(s.qblock.begin() + w.rows * width, s.qblock.begin() + padded * width, 0.f);
  int64_t lo = w.key_hi, hi = w.key_lo;  // keys some row of the block sees: [lo, hi)
  for (int64_t row = 0; row < padded; ++row) {
    // Padding rows take the block's last row's position: they see keys, and are never stored.
    const int64_t p = len - n + (w.row0 + std::min(row, w.rows - 1)) / o.heads;  // sees (p - window, p]
    s.pos[row] = std::min(p, w.key_hi - 1);
    s.from[row] = std::max(o.window > 0 ? std::max<int64_t>(0, p - o.window + 1) : 0, w.key_lo);
    if (s.from[row] <= s.pos[row]) {
      lo = std::min(lo, s.from[row]);
      hi = std::max(hi, s.pos[row] + 1);
    }
  }
  std::fill(st.m.begin(), st.m.begin() + padded, kNegInf);
  std::fill(st.l.begin(), st.l.begin() + padded, 0.f);
  std::fill(st.acc.begin(), st.acc.begin() + padded * latent, 0.f);
  float sc[kHeadGroup * kTile], alpha[kHeadGroup];
  // Blocks lie anywhere in the cache, so the hardware prefetcher cannot guess the next one: the tile
  // starting at key j (a multiple of kTile) is requested kPrefetchTiles tiles before it is read.
  auto prefetch_tile = [&](int64_t j) {
    if (j >= hi) return;
    const int64_t phys = o.table[b * o.table_width + j / o.block_size];
    if (phys < 0 || phys >= o.cache_blocks) return;
    const char* first =
        reinterpret_cast<const char*>(o.cache + (phys * o.block_size + j % o.block_size) * width);
    const int64_t bytes = std::min(kTile, o.block_size - j % o.block_size) * width * sizeof(cache_t);
    for (int64_t byte = 0; byte < bytes; byte += 64) deepinfer_cpu::prefetch_line(first + byte);
  };
  for (int64_t t = 0; t < kPrefetchTiles; ++t) prefetch_tile(lo / kTile * kTile + t * kTile);
  for (int64_t j0 = lo / kTile * kTile; j0 < hi;) {
    const int64_t blk = j0 / o.block_size, off0 = j0 % o.block_size;
    const int64_t cnt = std::min({hi - j0, o.block_size - off0, kTile - j0 % kTile});
    const int64_t phys = o.table[b * o.table_width + blk];
    TORCH_CHECK(phys >= 0 && phys < o.cache_blocks, "mla_decode: block id ", phys, " out of range");
    const cache_t* rows = o.cache + (phys * o.block_size + off0) * width;
    // The tile's rows are one contiguous run of the block: read front to back into a float tile (a
    // sequential read the hardware streams; transposing straight from the cache, 8 rows at a stride,
    // ran 1.4x slower once the cache outgrew L2), then transposed from L1.
    load_row(rows, s.tile.data(), cnt * width);
    std::fill(s.tile.begin() + cnt * width, s.tile.end(), 0.f);
    prefetch_tile(j0 / kTile * kTile + kPrefetchTiles * kTile);
    transpose_tile(s.tile.data(), s.tile_t.data(), width);  // the zero rows too: one full tile
    for (int64_t g0 = 0; g0 < padded; g0 += kHeadGroup) {
      bool any = false;           // does a row of the group see a key of this tile?
      bool whole = cnt == kTile;  // ... does every row of the group see all its keys?
      for (int64_t g = 0; g < kHeadGroup; ++g) {
        any |= s.pos[g0 + g] >= j0 && s.from[g0 + g] < j0 + cnt && s.from[g0 + g] <= s.pos[g0 + g];
        whole &= s.pos[g0 + g] >= j0 + kTile - 1 && s.from[g0 + g] <= j0;
      }
      if (!any) continue;
      score_tile(s.qblock.data() + g0 * width, s.tile_t.data(), sc, kHeadGroup, width, o.scale);
      for (int64_t g = 0; g < kHeadGroup; ++g) {
        const int64_t row = g0 + g, p = s.pos[row], f = s.from[row];
        float* x = sc + g * kTile;
        if (!whole)  // hidden keys first: a maximum is the same in any order, so both branches agree
          for (int64_t r = 0; r < kTile; ++r) {
            const int64_t j = j0 + r;
            if (!(r < cnt && j <= p && j >= f)) x[r] = kNegInf;
          }
        const float tile_max = max_of(x, kTile);
        if (tile_max == kNegInf) {  // nothing visible: the state stays, bit for bit
          alpha[g] = 1.f;
          std::fill(x, x + kTile, 0.f);
          continue;
        }
        const float m_new = std::max(st.m[row], tile_max);
        alpha[g] = std::exp(st.m[row] - m_new);  // 0 when m was -inf
        // 0 for hidden keys (-inf) and the padding past cnt
        st.l[row] = st.l[row] * alpha[g] + deepinfer_cpu::exp_shift_sum(x, kTile, m_new);
        st.m[row] = m_new;
      }
      accumulate_group(sc, s.tile.data(), st.acc.data() + g0 * latent, alpha, width, latent);
    }
    j0 += cnt;
  }
}

// Work items of a call: every request's rows in blocks of kRowBlock, each against its visible keys cut
// into `splits` ranges (1 for the invariant kernel) whose boundaries are multiples of kTile.
template <typename cache_t>
std::vector<Work> work_items(const Operands<cache_t>& o, int64_t num_reqs, bool invariant) {
  std::vector<Work> items;
  int64_t total_keys = 0, blocks = 0;
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t n = o.qsl[b + 1] - o.qsl[b], len = o.lens[b];
    TORCH_CHECK(n >= 0 && n <= len, "mla_decode: request ", b, " has ", n, " query tokens but seq_len ", len);
    TORCH_CHECK((len + o.block_size - 1) / o.block_size <= o.table_width, "mla_decode: request ", b,
                " needs more blocks than block_table has columns");
    if (n == 0) continue;
    total_keys += len;
    blocks += (n * o.heads + kRowBlock - 1) / kRowBlock;
  }
  // Keys per range: enough ranges that every thread has about four items even for one long request, none
  // shorter than four tiles (the merge then costs little).
  const int64_t want = 4 * at::get_num_threads();
  int64_t split_len = std::numeric_limits<int64_t>::max();
  if (!invariant && blocks > 0 && blocks < want) {
    const int64_t per = (total_keys * blocks + want - 1) / want;  // keys per item if spread evenly
    split_len = std::max<int64_t>(4 * kTile, (per + kTile - 1) / kTile * kTile);
  }
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t n = o.qsl[b + 1] - o.qsl[b], len = o.lens[b];
    if (n == 0) continue;
    const int64_t first = o.window > 0 ? std::max<int64_t>(0, len - n - o.window + 1) : 0;
    for (int64_t r0 = 0; r0 < n * o.heads; r0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, n * o.heads - r0);
      if (split_len >= len - first) {
        items.push_back({b, r0, rows, first, len});
        continue;
      }
      for (int64_t k0 = first; k0 < len;) {
        const int64_t k1 = std::min(len, (k0 + split_len + kTile - 1) / kTile * kTile);
        items.push_back({b, r0, rows, k0, k1});
        k0 = k1;
      }
    }
  }
  return items;
}

template <typename out_t>
void store_normalised(const RowState& st, int64_t rows, int64_t latent, out_t* dst) {
  std::vector<float> row(latent);
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = st.l[r] > 0.f ? 1.f / st.l[r] : 0.f;
    const float* a = st.acc.data() + r * latent;
#pragma omp simd
    for (int64_t c = 0; c < latent; ++c) row[c] = a[c] * inv;
    store_row(row.data(), dst + r * latent, latent);
  }
}

template <typename cache_t, typename out_t>
void mla_attention_impl(const Operands<cache_t>& o, int64_t num_reqs, bool invariant, out_t* out) {
  const std::vector<Work> items = work_items(o, num_reqs, invariant);
  const int64_t count = static_cast<int64_t>(items.size()), latent = o.latent;
  // Items that share a row block (a split request) keep their states for the merge; others store at once.
  std::vector<char> split(count, 0);
  for (int64_t i = 0; i < count; ++i)
    split[i] = (i > 0 && items[i - 1].req == items[i].req && items[i - 1].row0 == items[i].row0) ||
               (i + 1 < count && items[i + 1].req == items[i].req && items[i + 1].row0 == items[i].row0);
  std::vector<RowState> kept;
  std::vector<int64_t> kept_of(count, -1);
  for (int64_t i = 0; i < count; ++i)
    if (split[i]) {
      kept_of[i] = static_cast<int64_t>(kept.size());
      kept.emplace_back(latent);
    }
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    Scratch scratch(o.width);
    RowState own(latent);
    for (int64_t i = first; i < last; ++i) {
      const Work& w = items[i];
      RowState& st = split[i] ? kept[kept_of[i]] : own;
      attend(o, w, scratch, st);
      if (!split[i]) store_normalised(st, w.rows, latent, out + (o.qsl[w.req] * o.heads + w.row0) * latent);
    }
  });
  if (kept.empty()) return;
  // Merge each split row block's ranges with their log-sum-exp weights, in range order.
  std::vector<float> merged(latent);
  for (int64_t i = 0; i < count;) {
    if (!split[i]) {
      ++i;
      continue;
    }
    int64_t j = i;
    while (j < count && items[j].req == items[i].req && items[j].row0 == items[i].row0) ++j;
    const Work& w = items[i];
    RowState total(latent);
    for (int64_t row = 0; row < w.rows; ++row) {
      float m_all = kNegInf;
      for (int64_t k = i; k < j; ++k) m_all = std::max(m_all, kept[kept_of[k]].m[row]);
      std::fill(merged.begin(), merged.end(), 0.f);
      float denom = 0.f;
      if (m_all != kNegInf)
        for (int64_t k = i; k < j; ++k) {
          const RowState& st = kept[kept_of[k]];
          if (st.m[row] == kNegInf) continue;
          const float weight = std::exp(st.m[row] - m_all);
          denom += weight * st.l[row];
          const float* a = st.acc.data() + row * latent;
#pragma omp simd
          for (int64_t c = 0; c < latent; ++c) merged[c] += weight * a[c];
        }
      total.l[row] = denom;
      std::copy(merged.begin(), merged.end(), total.acc.begin() + row * latent);
    }
    store_normalised(total, w.rows, latent, out + (o.qsl[w.req] * o.heads + w.row0) * latent);
    i = j;
  }
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
  TORCH_CHECK(q_pe.size(0) == q_nope.size(0) && q_pe.size(1) == q_nope.size(1),
              "mla_decode: q_nope and q_pe must have the same tokens and heads");
  const at::Tensor q = at::cat({q_nope, q_pe}, -1).to(at::kFloat).contiguous();
  const at::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous();
  const at::Tensor qsl = query_start_loc.contiguous();
  const int32_t* qsl_p = qsl.data_ptr<int32_t>();
  TORCH_CHECK(qsl_p[seq_lens.size(0)] == q.size(0), "mla_decode: query_start_loc[-1] != number of tokens");
  at::Tensor out = at::empty({q.size(0), q.size(1), latent}, q_nope.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "mla_decode_cache", [&] {
    using cache_t = scalar_t;
    const Operands<cache_t> operands{q.data_ptr<float>(), cache.data_ptr<cache_t>(), table.data_ptr<int32_t>(),
                                     lens.data_ptr<int32_t>(), qsl_p, q.size(1), q.size(2), latent, cache.size(1),
                                     table.size(1), cache.size(0), window, static_cast<float>(scale)};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "mla_decode_out", [&] {
      mla_attention_impl(operands, seq_lens.size(0), invariant, out.data_ptr<scalar_t>());
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
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: the last dimension must be even");
  const int64_t inter = x.size(-1) / 2;
  const at::Tensor xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, x.options());
  DEEPINFER_DISPATCH_WEIGHTS(x.scalar_type(), "silu_and_mul", [&] {
    deepinfer_cpu::silu_mul_rows(xc.data_ptr<scalar_t>(), 2 * inter, out.data_ptr<scalar_t>(), inter,
                                 xc.numel() / std::max<int64_t>(1, 2 * inter), inter);
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
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope(Tensor q, Tensor k, Tensor positions, Tensor cos_sin_cache, bool interleaved) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("mla_decode", &mla_decode);
  m.impl("mla_decode_invariant", &mla_decode_invariant);
  m.impl("kv_cache_write", &kv_cache_write);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope", &rope);
}
