// mok_moe_fwd on CUDA GPUs: argument checks here, the work in cuda/sm90 (launch.h).
#include <cuda_runtime_api.h>

#include <string>

#include "../cuda/launch.h"
#include "moe_args.h"
#include "moe_cuda.h"

namespace mok {
namespace {

ffi::Error MoeFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer experts,
                      ffi::AnyBuffer weights, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                      ffi::AnyBuffer w_down, ffi::AnyBuffer ws_gate, ffi::AnyBuffer ws_up,
                      ffi::AnyBuffer ws_down, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> pos, ffi::Result<ffi::AnyBuffer> offsets,
                      ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> gu,
                      ffi::Result<ffi::AnyBuffer> gu_shared, ffi::Result<ffi::AnyBuffer> xs,
                      ffi::Result<ffi::AnyBuffer> y_routed, ffi::Result<ffi::AnyBuffer> xs_scratch,
                      ffi::Result<ffi::AnyBuffer> h,
                      ffi::Result<ffi::AnyBuffer> h_shared, ffi::Result<ffi::AnyBuffer> y_shared,
                      ffi::Result<ffi::AnyBuffer> layout, int64_t block_m, bool recompute,
                      int64_t ranks) {
  MoeInputs in{x, experts, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down};
  MoeFwdResults out{*y,          {*pos, *offsets, *rows, *gu, *gu_shared, *xs},
                    *y_routed,   *xs_scratch, *h, *h_shared, *y_shared, *layout};
  auto dims = CheckFwdCall(Platform::kCuda, in, out, block_m, recompute, ranks);
  if (dims.has_error()) return dims.error();
  const MoeDims& d = *dims;
  cuda::MoeFwdArgs a{};
  SetLaunchDims(d, a);
  a.x = x.untyped_data();
  a.experts = experts.reinterpret_data<int32_t>();
  a.weights = weights.reinterpret_data<float>();
  a.w_gate = w_gate.untyped_data(), a.w_up = w_up.untyped_data();
  a.w_down = w_down.untyped_data();
  a.ws_gate = ws_gate.untyped_data(), a.ws_up = ws_up.untyped_data();
  a.ws_down = ws_down.untyped_data();
  a.y = out.y.untyped_data();
  a.y_f32 = out.y.element_type() == ffi::DataType::F32;
  a.pos = out.res.pos.reinterpret_data<int32_t>();
  a.offsets = out.res.offsets.reinterpret_data<int32_t>();
  a.rows = out.res.rows.reinterpret_data<int32_t>();
  // With recompute gu is not kept (the backward recomputes it into its own scratch): null
  // makes the gate|up epilogue skip storing it and write h alone.
  a.gu = d.recompute ? nullptr : out.res.gu.untyped_data();
  a.y_routed = out.y_routed.untyped_data();
  a.gu_shared = d.recompute ? nullptr : out.res.gu_shared.untyped_data();
  // Without recompute xs is a residual: the backward's weight gradients read it.
  a.xs = (d.recompute ? out.xs_scratch : out.res.xs).untyped_data(), a.h = out.h.untyped_data();
  a.h_shared = out.h_shared.untyped_data(), a.y_shared = out.y_shared.untyped_data();
  a.layout = out.layout.reinterpret_data<int32_t>();
  if (const char* err = cuda::LaunchMoeFwd(a, stream))
    return ffi::Error::Internal(std::string("mok_moe_fwd: ") + err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeFwdCuda, mok::MoeFwdCuda,
    mok::BindMoeFwd(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
