// Expert runs: how the MoE kernels (moe.cpp, quant_gemm.cpp) cut expert-sorted rows into work.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace deepinfer_cpu {

constexpr int64_t kColBlock = 16;  // output columns per work item

// One expert's share of a call: rows [begin, end) of the expert-sorted row order.
struct Run {
  int64_t expert, begin, end;
};

// Work items (run, block of `cols` output columns) over the runs, for one parallel_for.
struct Item {
  int64_t run, col0, col1;
};

inline std::vector<Item> column_items(const std::vector<Run>& runs, int64_t cols) {
  std::vector<Item> items;
  for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r)
    for (int64_t c = 0; c < cols; c += kColBlock) items.push_back({r, c, std::min(cols, c + kColBlock)});
  return items;
}

// Runs in expert order (`offsets`: E + 1 row offsets), split by row count: runs of at least `large_rows`
// rows go to `large`, the others to `small`. Returns the most rows of a small run.
inline int64_t split_runs(const std::vector<int64_t>& offsets, int64_t large_rows, std::vector<Run>& small,
                          std::vector<Run>& large) {
  int64_t most = 0;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    (n >= large_rows ? large : small).push_back({e, offsets[e], offsets[e + 1]});
    if (n < large_rows) most = std::max(most, n);
  }
  return most;
}

}  // namespace deepinfer_cpu
