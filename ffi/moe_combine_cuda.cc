// mok_moe_combine on CUDA: the forward's combine kernel on rows from elsewhere (launch.h).
#include <string>

#include <cuda_runtime_api.h>

#include "../cuda/launch.h"
#include "moe_args.h"
#include "moe_cuda.h"

namespace mok {
namespace {

ffi::Error MoeCombineCuda(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer pos,
                          ffi::AnyBuffer weights, ffi::AnyBuffer extra,
                          ffi::Result<ffi::AnyBuffer> out) {
  auto dims = CheckCombineArgs("mok_moe_combine", rows, pos, weights, extra, *out);
  if (dims.has_error()) return dims.error();
  const CombineDims& d = *dims;
  if (rows.element_type() != ffi::DataType::BF16 || d.H % 8 != 0)
    return ffi::Error::InvalidArgument(
        "mok_moe_combine: the CUDA kernel takes bf16 rows with H a multiple of 8, got " +
        DescribeBuffer(rows.element_type(), rows.dimensions()));
  // pos comes from the layer's own layout (mok_jax.expert_parallel), in [-1, N) by
  // construction; the kernel reads rows[pos] unchecked, as the forward's combine does.
  cuda::CombineArgs a{};
  a.T = d.T, a.k = static_cast<int>(d.k), a.H = static_cast<int>(d.H);
  a.rows = rows.untyped_data(), a.pos = pos.reinterpret_data<int32_t>();
  a.weights = d.weighted ? weights.reinterpret_data<float>() : nullptr;
  a.extra = d.extra ? extra.untyped_data() : nullptr;
  a.out = out->untyped_data(), a.out_f32 = out->element_type() == ffi::DataType::F32;
  if (const char* err = cuda::LaunchCombine(a, stream))
    return ffi::Error::Internal(std::string("mok_moe_combine: ") + err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeCombineCuda, mok::MoeCombineCuda,
    mok::BindMoeCombine(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
