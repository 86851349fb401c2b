// deepinfer fast CPU ops, MoE: DeepSeek routing, grouped GEMM and the fused routed-expert MLP.
//
// Registered into the `deepinfer_cpu` torch op namespace next to kernels.cpp (see
// deepinfer/backends/cpu/native.py and backends/cpu/moe.py, which state each op's contract).
//
// fused_moe / grouped_gemm read every expert's weights in place. An expert's rows are computed one of two
// ways, chosen per expert by its row count against `mm_rows`:
// - few rows (decode): the skinny products of skinny.h on the expert's gathered float32 rows. Work items
//   are (expert, block of output columns), so both threads share even one token's four experts; each
//   weight element is read once per four rows, widened to float32 in registers.
// - many rows (prefill, large batches): the expert's rows are gathered and multiplied by at::mm against
//   the expert's weight slice (no weight copy; MKL's own threads), one call per matrix.
// The per-pair expert outputs (float32) are combined per token in the order of its k slots.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "activation.h"
#include "common.h"
#include "expert_runs.h"
#include "skinny.h"

namespace {

using deepinfer_cpu::store_row;

constexpr float kInf = std::numeric_limits<float>::infinity();

// ----------------------------------------------------------------------------------------- routing

// torch.topk's CPU selection (ATen/native/TopKImpl.h, torch 2.13): (value, index) pairs, NaN ranked
// highest, std::partial_sort when k * 64 <= n, else std::nth_element and a sort of the first k - 1. The
// same standard algorithms with the same comparator leave the same k entries in the same order, so ties
// resolve exactly as the reference's `topk` resolves them.
using Scored = std::pair<float, int64_t>;

inline bool ranks_higher(const Scored& x, const Scored& y) {
  return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
}

inline void topk_like_torch(std::vector<Scored>& queue, int64_t k) {
  const auto begin = queue.begin();
  if (k * 64 <= static_cast<int64_t>(queue.size())) {
    std::partial_sort(begin, begin + k, queue.end(), ranks_higher);
  } else {
    std::nth_element(begin, begin + k - 1, queue.end(), ranks_higher);
    std::sort(begin, begin + k - 1, ranks_higher);
  }
}

enum class Method { kNoauxTc, kGroupLimitedGreedy, kGreedy };

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& router_logits,
                                             const std::optional<at::Tensor>& correction_bias, int64_t top_k,
                                             int64_t n_group, int64_t topk_group, std::string scoring_func,
                                             std::string topk_method, bool renormalize,
                                             double routed_scaling_factor) {
  TORCH_CHECK_VALUE(router_logits.dim() == 2, "moe_route: router_logits must be [T, E], got ",
                    router_logits.sizes());
  const int64_t tokens = router_logits.size(0), experts = router_logits.size(1);
  TORCH_CHECK_VALUE(scoring_func == "sigmoid" || scoring_func == "softmax",
                    "moe_route: scoring_func must be 'sigmoid' or 'softmax', got '", scoring_func, "'");
  Method method;
  if (topk_method == "noaux_tc")
    method = Method::kNoauxTc;
  else if (topk_method == "group_limited_greedy")
    method = Method::kGroupLimitedGreedy;
  else if (topk_method == "greedy")
    method = Method::kGreedy;
  else
    TORCH_CHECK_VALUE(false, "moe_route: topk_method must be 'noaux_tc', 'greedy' or 'group_limited_greedy', "
                      "got '", topk_method, "'");
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= experts, "moe_route: top_k must be in [1, ", experts, "], got ",
                    top_k);
  const bool grouped = method != Method::kGreedy;
  if (grouped) {
    TORCH_CHECK_VALUE(n_group >= 1 && experts % n_group == 0, "moe_route: n_group (", n_group,
                      ") must divide the ", experts, " experts");
    TORCH_CHECK_VALUE(topk_group >= 1 && topk_group <= n_group, "moe_route: topk_group must be in [1, ",
                      n_group, "], got ", topk_group);
  }
  const int64_t per_group = grouped ? experts / n_group : experts;
  at::Tensor bias;
  if (method == Method::kNoauxTc) {
    TORCH_CHECK_VALUE(correction_bias.has_value(),
                      "moe_route: topk_method 'noaux_tc' needs correction_bias (e_score_correction_bias)");
    TORCH_CHECK_VALUE(correction_bias->numel() == experts, "moe_route: correction_bias must be [", experts,
                      "], got ", correction_bias->sizes());
    TORCH_CHECK_VALUE(per_group >= 2, "moe_route: noaux_tc ranks groups by their two best experts; groups of ",
                      per_group, " are too small");
    bias = correction_bias->to(at::kFloat).contiguous();
  }
  const at::Tensor logits = router_logits.to(at::kFloat).contiguous();
  at::Tensor weights = at::empty({tokens, top_k}, logits.options());
  at::Tensor ids = at::empty({tokens, top_k}, logits.options().dtype(at::kInt));
  const float* lp = logits.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* wp = weights.data_ptr<float>();
  int32_t* ip = ids.data_ptr<int32_t>();
  const bool sigmoid = scoring_func == "sigmoid";
  const bool mask_groups = grouped && topk_group < n_group;
  const float scale = static_cast<float>(routed_scaling_factor);

  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / experts), [&](int64_t first, int64_t last) {
    std::vector<float> scores(experts), choice(experts), two(per_group);
    std::vector<Scored> queue(experts), groups(n_group);
    std::vector<char> kept(n_group);
    for (int64_t t = first; t < last; ++t) {
      const float* x = lp + t * experts;
      if (sigmoid) {
        for (int64_t e = 0; e < experts; ++e) scores[e] = 1.f / (1.f + std::exp(-x[e]));
      } else {
        float m = -kInf, sum = 0.f;
        for (int64_t e = 0; e < experts; ++e) m = std::max(m, x[e]);
        for (int64_t e = 0; e < experts; ++e) sum += scores[e] = std::exp(x[e] - m);
        for (int64_t e = 0; e < experts; ++e) scores[e] /= sum;
      }
      for (int64_t e = 0; e < experts; ++e) choice[e] = bp != nullptr ? scores[e] + bp[e] : scores[e];
      if (mask_groups) {
        for (int64_t g = 0; g < n_group; ++g) {
          const float* c = choice.data() + g * per_group;
          float score;
          if (method == Method::kNoauxTc) {  // the sum of the group's two best (biased) scores
            for (int64_t i = 0; i < per_group; ++i) two[i] = c[i];
            std::partial_sort(two.begin(), two.begin() + 2, two.end(), [](float a, float b) {
              return (std::isnan(a) && !std::isnan(b)) || a > b;
            });
            score = two[0] + two[1];
          } else {  // the group's best score (NaN if it holds one, as torch's max)
            score = c[0];
            for (int64_t i = 1; i < per_group && !std::isnan(score); ++i)
              if (std::isnan(c[i]) || c[i] > score) score = c[i];
          }
          groups[g] = {score, g};
        }
        topk_like_torch(groups, topk_group);
        std::fill(kept.begin(), kept.end(), 0);
        for (int64_t g = 0; g < topk_group; ++g) kept[groups[g].second] = 1;
        for (int64_t e = 0; e < experts; ++e)
          if (!kept[e / per_group]) choice[e] = -kInf;
      }
      for (int64_t e = 0; e < experts; ++e) queue[e] = {choice[e], e};
      topk_like_torch(queue, top_k);
      float* w = wp + t * top_k;
      float sum = 0.f;
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t e = queue[j].second;
        ip[t * top_k + j] = static_cast<int32_t>(e);
        w[j] = scores[e];
        sum += w[j];
      }
      const float denom = sum + 1e-20f;
      for (int64_t j = 0; j < top_k; ++j) w[j] = (renormalize ? w[j] / denom : w[j]) * scale;
    }
  });
  return {weights, ids};
}

// --------------------------------------------------------------------------- small-row expert GEMM

using deepinfer_cpu::skinny_product;

using deepinfer_cpu::column_items;
using deepinfer_cpu::Item;
using deepinfer_cpu::kColBlock;
using deepinfer_cpu::Run;
using deepinfer_cpu::split_runs;

// A [n, cols] float32 view of rows of a float buffer, for at::mm outputs and inputs (no copy).
inline at::Tensor float_rows(float* data, int64_t n, int64_t cols) {
  return at::from_blob(data, {n, cols}, at::TensorOptions().dtype(at::kFloat));
}

// ----------------------------------------------------------------------------------------- fused MoE

template <typename T>
void fused_moe_impl(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                    const float* pair_weight, const int64_t* pair_expert, int64_t top_k, int64_t mm_rows,
                    at::Tensor& out) {
  const int64_t tokens = hidden.size(0), dim = hidden.size(1), experts = w13.size(0);
  const int64_t inter = w2.size(2), pairs = tokens * top_k;
  // Counting sort of the local pairs by expert (tokens ascending within an expert): no argsort.
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = pair_expert[p];
    TORCH_CHECK_VALUE(e < experts, "fused_moe: topk_ids holds expert ", e, ", outside [0, ", experts,
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
  const int64_t most = split_runs(offsets, mm_rows, small, large);

  // float32 rows the skinny products read: each small run's tokens gathered (xs, in run order), the
  // activations h [local, I]; the expert outputs y [local, D] of every pair.
  const T* wg = w13.data_ptr<T>();
  const T* wd = w2.data_ptr<T>();
  at::Tensor xf = hidden.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  std::vector<float> h(local * inter), y(local * dim);

  if (!small.empty()) {
    std::vector<float> xs(local * dim);
    for (const Run& run : small)
      for (int64_t r = run.begin; r < run.end; ++r)
        std::memcpy(xs.data() + r * dim, xp + row_token[r] * dim, dim * sizeof(float));
    const std::vector<Item> up_items = column_items(small, inter);
    at::parallel_for(0, static_cast<int64_t>(up_items.size()), 1, [&](int64_t first, int64_t last) {
      std::vector<float> gate_up(most * 2 * kColBlock);
      for (int64_t it = first; it < last; ++it) {
        const Item& item = up_items[it];
        const Run& run = small[item.run];
        const int64_t n = run.end - run.begin, cols = item.col1 - item.col0;
        const T* we = wg + run.expert * 2 * inter * dim;
        const float* x = xs.data() + run.begin * dim;
        // rows [gate columns [col0, col1) | up columns I + [col0, col1)], then the shared SwiGLU
        skinny_product(x, dim, n, we + item.col0 * dim, dim, false, dim, 0, cols, gate_up.data(), 2 * cols);
        skinny_product(x, dim, n, we + (inter + item.col0) * dim, dim, false, dim, 0, cols, gate_up.data() + cols,
                       2 * cols);
        deepinfer_cpu::silu_mul_rows(gate_up.data(), 2 * cols, h.data() + run.begin * inter + item.col0, inter, n,
                                     cols);
      }
    });
    const std::vector<Item> down_items = column_items(small, dim);
    at::parallel_for(0, static_cast<int64_t>(down_items.size()), 1, [&](int64_t first, int64_t last) {
      for (int64_t it = first; it < last; ++it) {
        const Item& item = down_items[it];
        const Run& run = small[item.run];
        skinny_product(h.data() + run.begin * inter, inter, run.end - run.begin, wd + run.expert * dim * inter,
                       inter, false, inter, item.col0, item.col1, y.data() + run.begin * dim, dim);
      }
    });
  }

  for (const Run& run : large) {  // one at::mm per matrix on the expert's gathered rows
    const int64_t n = run.end - run.begin;
    const at::Tensor tok = at::from_blob(row_token.data() + run.begin, {n}, at::TensorOptions().dtype(at::kLong));
    const at::Tensor gate_up = at::mm(hidden.index_select(0, tok), w13[run.expert].t());
    const at::Tensor gu = gate_up.to(at::kFloat);
    float* hp = h.data() + run.begin * inter;
    deepinfer_cpu::silu_mul_rows(gu.data_ptr<float>(), 2 * inter, hp, inter, n, inter);
    const at::Tensor act = float_rows(hp, n, inter);
    at::Tensor dst = float_rows(y.data() + run.begin * dim, n, dim);
    if constexpr (std::is_same_v<T, float>)
      at::mm_out(dst, act, w2[run.expert].t());
    else
      dst.copy_(at::mm(act.to(hidden.scalar_type()), w2[run.expert].t()));
  }

  // out[t] = sum_j w[t, j] * y[pair (t, j)], in slot order, in float32.
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / (top_k * dim)), [&](int64_t first, int64_t last) {
    std::vector<float> acc(dim);
    for (int64_t t = first; t < last; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t row = row_of_pair[t * top_k + j];
        if (row < 0) continue;  // another rank's expert
        const float wj = pair_weight[t * top_k + j];
        const float* yr = y.data() + row * dim;
#pragma omp simd
        for (int64_t c = 0; c < dim; ++c) acc[c] += wj * yr[c];
      }
      store_row(acc.data(), op + t * dim, dim);
    }
  });
}

at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t mm_rows) {
  TORCH_CHECK_VALUE(hidden.dim() == 2 && w13.dim() == 3 && w2.dim() == 3,
                    "fused_moe: hidden must be [T, D], w13 [E, 2I, D] and w2 [E, D, I]");
  const int64_t tokens = hidden.size(0), dim = hidden.size(1), experts = w13.size(0), inter = w2.size(2);
  TORCH_CHECK_VALUE(w13.size(1) == 2 * inter && w13.size(2) == dim && w2.size(0) == experts && w2.size(1) == dim,
                    "fused_moe: w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not match hidden width ", dim);
  TORCH_CHECK_VALUE(w13.scalar_type() == hidden.scalar_type() && w2.scalar_type() == hidden.scalar_type(),
                    "fused_moe: w13 and w2 must have hidden's dtype ", hidden.scalar_type());
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_weights.sizes() == topk_ids.sizes(),
                    "fused_moe: topk_weights and topk_ids must both be [", tokens, ", k], got ",
                    topk_weights.sizes(), " and ", topk_ids.sizes());
  TORCH_CHECK_VALUE(mm_rows >= 1, "fused_moe: mm_rows must be >= 1, got ", mm_rows);
  const at::Tensor x = hidden.contiguous(), a = w13.contiguous(), b = w2.contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  at::Tensor out = at::empty({tokens, dim}, hidden.options());
  DEEPINFER_DISPATCH_WEIGHTS(hidden.scalar_type(), "fused_moe", [&] {
    fused_moe_impl<scalar_t>(x, a, b, weights.data_ptr<float>(), ids.data_ptr<int64_t>(), topk_ids.size(1),
                             mm_rows, out);
  });
  return out;
}

// -------------------------------------------------------------------------------------- grouped GEMM

template <typename T>
void grouped_gemm_impl(const at::Tensor& x, const at::Tensor& weight, const std::vector<int64_t>& offsets,
                       int64_t mm_rows, at::Tensor& out) {
  const int64_t k = x.size(1), cols = weight.size(1);
  std::vector<Run> small, large;
  const int64_t most = split_runs(offsets, mm_rows, small, large);
  for (const Run& run : large) {  // rows of one group are contiguous: multiplied in place
    at::Tensor dst = out.narrow(0, run.begin, run.end - run.begin);
    at::mm_out(dst, x.narrow(0, run.begin, run.end - run.begin), weight[run.expert].t());
  }
  if (small.empty()) return;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const std::vector<Item> items = column_items(small, cols);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<float> block(most * kColBlock);
    for (int64_t it = first; it < last; ++it) {
      const Item& item = items[it];
      const Run& run = small[item.run];
      const int64_t n = run.end - run.begin, width = item.col1 - item.col0;
      skinny_product(xp + run.begin * k, k, n, wp + (run.expert * cols + item.col0) * k, k, false, k, 0, width,
                     block.data(), width);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < width; ++c)
          op[(run.begin + r) * cols + item.col0 + c] = static_cast<T>(block[r * width + c]);
    }
  });
}

at::Tensor grouped_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_sizes,
                        int64_t mm_rows) {
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 3 && weight.size(2) == x.size(1),
                    "grouped_gemm: x must be [N, K] and weight [E, Nout, K], got ", x.sizes(), " and ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "grouped_gemm: weight must have x's dtype ",
                    x.scalar_type());
  TORCH_CHECK_VALUE(group_sizes.dim() == 1 && group_sizes.size(0) == weight.size(0),
                    "grouped_gemm: group_sizes must be [", weight.size(0), "], got ", group_sizes.sizes());
  TORCH_CHECK_VALUE(mm_rows >= 1, "grouped_gemm: mm_rows must be >= 1, got ", mm_rows);
  const at::Tensor sizes = group_sizes.to(at::kLong).contiguous();
  const int64_t* sp = sizes.data_ptr<int64_t>();
  std::vector<int64_t> offsets(weight.size(0) + 1, 0);
  for (int64_t e = 0; e < weight.size(0); ++e) {
    TORCH_CHECK_VALUE(sp[e] >= 0, "grouped_gemm: group_sizes[", e, "] is negative (", sp[e], ")");
    offsets[e + 1] = offsets[e] + sp[e];
  }
  TORCH_CHECK_VALUE(offsets.back() == x.size(0), "group_sizes sum to ", offsets.back(), ", but x has ", x.size(0),
                    " rows");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty({x.size(0), weight.size(1)}, x.options());
  DEEPINFER_DISPATCH_WEIGHTS(x.scalar_type(), "grouped_gemm", [&] {
    grouped_gemm_impl<scalar_t>(xc, wc, offsets, mm_rows, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("moe_route(Tensor router_logits, Tensor? correction_bias, int top_k, int n_group, int topk_group, "
        "str scoring_func, str topk_method, bool renormalize, float routed_scaling_factor) -> (Tensor, Tensor)");
  m.def("fused_moe(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, int mm_rows) "
        "-> Tensor");
  m.def("grouped_gemm(Tensor x, Tensor weight, Tensor group_sizes, int mm_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("moe_route", &moe_route);
  m.impl("fused_moe", &fused_moe);
  m.impl("grouped_gemm", &grouped_gemm);
}
