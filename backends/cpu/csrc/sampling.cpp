// deepinfer fast CPU ops, sampling: `greedy`, each row's argmax (see deepinfer/backends/cpu/sampling.py).
//
// torch.argmax walks a row with scalar compares (about 2 elements a nanosecond here: 16 us for a
// 8192-token vocabulary, 0.5 ms for 64 such rows). Here a row is scanned twice with vector code: its
// maximum, with a check for NaN, then the first index holding that maximum (or the first NaN).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace {

int64_t row_argmax(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
#pragma omp simd reduction(max : best) reduction(|| : nan)
  for (int64_t i = 0; i < n; ++i) {
    best = std::max(best, x[i]);
    nan = nan || x[i] != x[i];
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == best) return i;
  return 0;  // an empty row
}

at::Tensor greedy(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
                    "greedy: logits must be a [B, V] float32 tensor, got ", logits.scalar_type(), " ", logits.sizes());
  TORCH_CHECK_VALUE(logits.size(1) > 0, "greedy: the vocabulary is empty");
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / vocab), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) op[r] = row_argmax(xp + r * ld, vocab);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) { m.def("greedy(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("greedy", &greedy); }
