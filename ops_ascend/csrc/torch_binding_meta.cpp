/*
 * Meta (fake-tensor) implementations of the deepinfer_ascend ops: output shapes and dtypes only, for
 * torch.compile / graph tracing. sample: [B, V] logits -> [B] int64 tokens.
 */
#include <torch/library.h>

namespace deepinfer_ascend {
namespace {

at::Tensor SampleMeta(const at::Tensor &logits, const at::Tensor &temperature, const at::Tensor &topK,
                      const at::Tensor &topP, const at::Tensor &minP, const at::Tensor &seeds,
                      const at::Tensor &offsets)
{
    TORCH_CHECK(logits.dim() == 2, "deepinfer_ascend::sample: logits must be [B, V]");
    return at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
}

}  // namespace
}  // namespace deepinfer_ascend

TORCH_LIBRARY_IMPL(deepinfer_ascend, Meta, m)
{
    m.impl("sample", &deepinfer_ascend::SampleMeta);
}
