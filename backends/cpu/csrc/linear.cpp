// deepinfer fast CPU ops, dense projections: `linear` for [T, K] and per-head [T, H, K] inputs.
//
// Up to kSkinnyMax rows go through the skinny products of skinny.h, weights read in place in either
// layout (nn.Linear's rows, or a transposed view such as the D-major LM head or MLA's absorbed W_UK),
// split over threads by output columns only when the product is large enough to pay for waking them.
// More rows go to MKL (at::linear; one at::bmm on strided views for the per-head form), which packs the
// weight and wins from a few tens of rows on. See deepinfer/backends/cpu/linear.py for the contract.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#include "skinny.h"

namespace {

using deepinfer_cpu::kColsC;
using deepinfer_cpu::skinny_product;

constexpr int64_t kSkinnyMax = 8;          // most rows computed by the skinny products
constexpr int64_t kMacsPerThread = 1 << 13;  // below this many multiply-adds a call stays on one thread

// H products [R, K] x [N, K]^T, one per head h: rows x + h * hx (row stride ldx) against the weight at
// w + h * hw (element (c, k) at c * sc + k * sk, one of sc, sk == 1), into float rows out + h * ho (row
// stride ldo); parallel over (head, block of output columns) when large.
template <typename W>
void skinny_linear(const float* x, int64_t ldx, int64_t hx, int64_t R, const W* w, int64_t hw, int64_t sc,
                   int64_t sk, int64_t H, int64_t N, int64_t K, float* out, int64_t ldo, int64_t ho) {
  const bool columns = sk != 1;
  const int64_t ldw = columns ? sk : sc;
  const int64_t block = columns ? kColsC : 16, blocks = (N + block - 1) / block;
  const int64_t grain = std::max<int64_t>(1, kMacsPerThread / std::max<int64_t>(1, R * K * block));
  at::parallel_for(0, H * blocks, grain, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t h = item / blocks, c0 = (item % blocks) * block;
      skinny_product(x + h * hx, ldx, R, w + h * hw, ldw, columns, K, c0, std::min(N, c0 + block), out + h * ho,
                     ldo);
    }
  });
}

bool skinny_layout(int64_t sc, int64_t sk) { return sk == 1 || sc == 1; }

at::Tensor linear_2d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t R = x.size(0), K = x.size(1), N = weight.size(0);
  if (R > kSkinnyMax || R == 0 || !skinny_layout(weight.stride(0), weight.stride(1)) ||
      x.scalar_type() == at::kDouble)
    return at::linear(x, weight, bias);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({R, N}, x.options().dtype(at::kFloat));
  DEEPINFER_DISPATCH_WEIGHTS(weight.scalar_type(), "linear", [&] {
    skinny_linear(xf.data_ptr<float>(), K, 0, R, weight.data_ptr<scalar_t>(), 0, weight.stride(0), weight.stride(1),
                  1, N, K, out.data_ptr<float>(), N, 0);
  });
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// x [T, H, K] with weight [H, N, K] -> [T, H, N]: per head, the head's rows of x against its matrix.
at::Tensor linear_heads(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t R = x.size(0), H = x.size(1), K = x.size(2), N = weight.size(1);
  if (R > kSkinnyMax || R == 0 || !skinny_layout(weight.stride(1), weight.stride(2)) || x.scalar_type() == at::kDouble)
    return at::bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({R, H, N}, x.options().dtype(at::kFloat));
  DEEPINFER_DISPATCH_WEIGHTS(weight.scalar_type(), "linear_heads", [&] {
    skinny_linear(xf.data_ptr<float>(), H * K, K, R, weight.data_ptr<scalar_t>(), weight.stride(0), weight.stride(1),
                  weight.stride(2), H, N, K, out.data_ptr<float>(), H * N, N);
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type(), "linear: x is ", x.scalar_type(), " but weight is ",
                    weight.scalar_type(), "; they must share a dtype");
  if (x.dim() == 3) {
    TORCH_CHECK_VALUE(weight.dim() == 3 && weight.size(0) == x.size(1) && weight.size(2) == x.size(2),
                      "linear: per-head x [T, H, K] ", x.sizes(), " needs weight [H, N, K], got ", weight.sizes());
    TORCH_CHECK_VALUE(!bias.has_value() || !bias->defined(), "linear: a per-head weight [H, N, K] takes no bias");
    return linear_heads(x, weight);
  }
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1), "linear: x [T, K] ",
                    x.sizes(), " needs weight [N, K], got ", weight.sizes());
  return linear_2d(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("linear", &linear); }
