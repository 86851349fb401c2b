/*
 * Host-side tiling of the seeded top-k / top-p / min-p sampling kernel (deepinfer_ascend::sample).
 *
 * Rows are independent: core b of `blockDim` vector cores samples rows b, b + blockDim, ... Each row is
 * streamed from global memory in chunks of `chunk` float32 logits (a multiple of 64 elements, i.e. of the
 * 256-byte vector repeat, so every vector instruction covers whole repeats; the last chunk is padded with
 * -inf), sized so that the kernel's unified-buffer working set fits the core's UB.
 */
#ifndef DEEPINFER_ASCEND_SAMPLE_TILING_H
#define DEEPINFER_ASCEND_SAMPLE_TILING_H

#include <cstdint>

namespace deepinfer_ascend {

struct SampleTiling {
    uint32_t rows;      // B
    uint32_t vocab;     // V
    uint32_t chunk;     // logits per UB tile (multiple of 64)
    uint32_t chunks;    // ceil(V / chunk)
    uint32_t blockDim;  // vector cores launched (<= rows)
};

// Float32-sized UB buffers the kernel keeps per chunk element (see op_kernel/sample_kernel.cpp):
// logits (double-buffered input queue: 2), lp, exp/noise, score, index, hash + scratch (2 x uint32),
// plus the two bit masks and the reduction work space, rounded up to 10.
constexpr uint32_t kBuffersPerElement = 10;
constexpr uint32_t kElementAlign = 64;
constexpr uint32_t kMaxChunk = 8192;
constexpr uint64_t kReservedUbBytes = 16 * 1024;

SampleTiling ComputeSampleTiling(uint32_t rows, uint32_t vocab, uint32_t vectorCores, uint64_t ubBytes);

}  // namespace deepinfer_ascend

#endif  // DEEPINFER_ASCEND_SAMPLE_TILING_H
