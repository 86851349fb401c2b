/*
 * PyTorch binding of the Ascend C kernels: TORCH_LIBRARY(deepinfer_ascend) schemas and their NPU
 * (PrivateUse1) implementations. Kernels are launched through torch_npu's OpCommand custom handler, so
 * they are queued on the current NPU stream in order with torch_npu's own ops (and captured by ACL
 * graphs like them).
 */
#include <torch/library.h>

#include <cstdint>

#include "acl/acl.h"
#include "sample/op_host/sample_tiling.h"
#include "tiling/platform/platform_ascendc.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

namespace deepinfer_ascend {

void LaunchSampleKernel(void *stream, uint32_t blockDim, void *logits, void *temperature, void *topK, void *topP,
                        void *minP, void *seeds, void *offsets, void *out, uint32_t rows, uint32_t vocab,
                        uint32_t chunk, uint32_t chunks);

namespace {

uint32_t VectorCores()
{
    int32_t device = 0;
    TORCH_CHECK(aclrtGetDevice(&device) == ACL_SUCCESS, "deepinfer_ascend: aclrtGetDevice failed");
    int64_t cores = 0;
    TORCH_CHECK(aclGetDeviceCapability(device, ACL_DEVICE_INFO_VECTOR_CORE_NUM, &cores) == ACL_SUCCESS,
                "deepinfer_ascend: cannot read the vector core count");
    return static_cast<uint32_t>(cores);
}

uint64_t UnifiedBufferBytes()
{
    uint64_t bytes = 0;
    platform_ascendc::PlatformAscendCManager::GetInstance()->GetCoreMemSize(platform_ascendc::CoreMemType::UB,
                                                                             bytes);
    return bytes;
}

at::Tensor As(const at::Tensor &t, at::ScalarType dtype, int64_t rows, const char *name)
{
    TORCH_CHECK(t.dim() == 1 && t.size(0) == rows, "deepinfer_ascend::sample: ", name, " must be [", rows, "]");
    return t.to(dtype).contiguous();
}

}  // namespace

at::Tensor Sample(const at::Tensor &logits, const at::Tensor &temperature, const at::Tensor &topK,
                  const at::Tensor &topP, const at::Tensor &minP, const at::Tensor &seeds, const at::Tensor &offsets)
{
    TORCH_CHECK(logits.dim() == 2, "deepinfer_ascend::sample: logits must be [B, V]");
    const int64_t rows = logits.size(0);
    const int64_t vocab = logits.size(1);
    TORCH_CHECK(vocab < (int64_t{1} << 24), "deepinfer_ascend::sample: vocabularies up to 2^24 tokens");
    at::Tensor x = logits.to(at::kFloat).contiguous();
    at::Tensor t = As(temperature, at::kFloat, rows, "temperature");
    at::Tensor k = As(topK, at::kInt, rows, "top_k");
    at::Tensor p = As(topP, at::kFloat, rows, "top_p");
    at::Tensor m = As(minP, at::kFloat, rows, "min_p");
    at::Tensor s = As(seeds, at::kLong, rows, "seeds");
    at::Tensor o = As(offsets, at::kLong, rows, "offsets");
    at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
    if (rows == 0) {
        return out;
    }
    SampleTiling tiling = ComputeSampleTiling(static_cast<uint32_t>(rows), static_cast<uint32_t>(vocab),
                                              VectorCores(), UnifiedBufferBytes());
    void *stream = c10_npu::getCurrentNPUStream().stream();
    at_npu::native::OpCommand cmd;
    cmd.Name("deepinfer_sample");
    cmd.SetCustomHandler([=]() -> int {
        LaunchSampleKernel(stream, tiling.blockDim, x.data_ptr(), t.data_ptr(), k.data_ptr(), p.data_ptr(),
                           m.data_ptr(), s.data_ptr(), o.data_ptr(), out.data_ptr(), tiling.rows, tiling.vocab,
                           tiling.chunk, tiling.chunks);
        return 0;
    });
    cmd.Run();
    return out;
}

}  // namespace deepinfer_ascend

TORCH_LIBRARY(deepinfer_ascend, m)
{
    m.def("sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor seeds, "
          "Tensor offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_ascend, PrivateUse1, m)
{
    m.impl("sample", &deepinfer_ascend::Sample);
}
