/*
 * Host-side tiling of deepinfer_ascend::sample (see sample_tiling.h).
 */
#include "sample_tiling.h"

#include <algorithm>
#include <stdexcept>

namespace deepinfer_ascend {

SampleTiling ComputeSampleTiling(uint32_t rows, uint32_t vocab, uint32_t vectorCores, uint64_t ubBytes)
{
    if (rows == 0 || vocab == 0 || vectorCores == 0) {
        throw std::invalid_argument("sample tiling: rows, vocab and vector cores must be positive");
    }
    if (ubBytes <= kReservedUbBytes) {
        throw std::invalid_argument("sample tiling: unified buffer too small");
    }
    uint64_t fit = (ubBytes - kReservedUbBytes) / (kBuffersPerElement * sizeof(float));
    uint64_t wanted = (static_cast<uint64_t>(vocab) + kElementAlign - 1) / kElementAlign * kElementAlign;
    uint64_t chunk = std::min<uint64_t>({fit / kElementAlign * kElementAlign, wanted, kMaxChunk});
    if (chunk == 0) {
        throw std::invalid_argument("sample tiling: unified buffer cannot hold one 64-element tile");
    }
    SampleTiling tiling{};
    tiling.rows = rows;
    tiling.vocab = vocab;
    tiling.chunk = static_cast<uint32_t>(chunk);
    tiling.chunks = static_cast<uint32_t>((vocab + chunk - 1) / chunk);
    tiling.blockDim = std::min(rows, vectorCores);
    return tiling;
}

}  // namespace deepinfer_ascend
