// mok_quantize_weight on CUDA GPUs: argument checks here, the kernel in
// cuda/sm90/quantize_weight.cu (launch.h).
#include <cuda_runtime_api.h>

#include <string>

#include "../cuda/launch.h"
#include "moe_args.h"
#include "moe_cuda.h"

namespace mok {
namespace {

ffi::Error QuantizeWeightCuda(cudaStream_t stream, ffi::AnyBuffer w,
                              ffi::Result<ffi::AnyBuffer> data,
                              ffi::Result<ffi::AnyBuffer> k_major,
                              ffi::Result<ffi::AnyBuffer> scale) {
  auto dims = CheckQuantizeArgs("mok_quantize_weight", w, *data, *k_major, *scale);
  if (dims.has_error()) return dims.error();
  cuda::QuantizeWeightArgs a{};
  a.batch = dims->batch, a.K = dims->K, a.N = dims->N;
  a.w = w.untyped_data(), a.w_f32 = w.element_type() == ffi::DataType::F32;
  a.data = data->untyped_data(), a.k_major = k_major->untyped_data();
  a.scale = scale->reinterpret_data<float>();
  if (const char* err = cuda::LaunchQuantizeWeight(a, stream))
    return ffi::Error::Internal(std::string("mok_quantize_weight: ") + err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokQuantizeWeightCuda, mok::QuantizeWeightCuda,
    mok::BindQuantizeWeight(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
