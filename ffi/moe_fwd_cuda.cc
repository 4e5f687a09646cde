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
                      ffi::Result<ffi::AnyBuffer> y_routed, ffi::Result<ffi::AnyBuffer> gu_shared,
                      ffi::Result<ffi::AnyBuffer> xs, ffi::Result<ffi::AnyBuffer> h,
                      ffi::Result<ffi::AnyBuffer> h_shared, ffi::Result<ffi::AnyBuffer> y_shared,
                      ffi::Result<ffi::AnyBuffer> layout, int64_t block_m) {
  MoeInputs in{x, experts, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down};
  MoeFwdResults out{*y,  {*pos, *offsets, *rows, *gu, *y_routed, *gu_shared},
                    *xs, *h, *h_shared, *y_shared, *layout};
  auto dims = CheckInputs("mok_moe_fwd", in, block_m);
  if (dims.has_error()) return dims.error();
  const MoeDims& d = *dims;
  if (x.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("mok_moe_fwd: the CUDA kernel takes bf16 tokens, got " +
                                       DescribeBuffer(x.element_type(), x.dimensions()));
  if (block_m != 128)
    return ffi::Error::InvalidArgument("mok_moe_fwd: the CUDA kernel needs block_m = 128, got " +
                                       std::to_string(block_m));
  if (auto err = CheckFwdResults(d, ffi::DataType::BF16, out); err.failure()) return err;
  cuda::MoeFwdArgs a{};
  a.T = d.T, a.H = d.H, a.I = d.I, a.E = d.E, a.k = d.k, a.Is = d.Is, a.R = d.R;
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
  a.gu = out.res.gu.untyped_data(), a.y_routed = out.res.y_routed.untyped_data();
  a.gu_shared = out.res.gu_shared.untyped_data();
  a.xs = out.xs.untyped_data(), a.h = out.h.untyped_data();
  a.h_shared = out.h_shared.untyped_data(), a.y_shared = out.y_shared.untyped_data();
  a.layout = out.layout.reinterpret_data<int32_t>();
  if (const char* err = cuda::LaunchMoeFwd(a, stream))
    return ffi::Error::Internal(std::string("mok_moe_fwd: ") + err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokMoeFwdCuda, mok::MoeFwdCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x (T, H) bf16
                                  .Arg<xla::ffi::AnyBuffer>()  // experts (T, k) s32
                                  .Arg<xla::ffi::AnyBuffer>()  // weights (T, k) f32
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate (E, H, I)
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up (E, H, I)
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down (E, I, H)
                                  .Arg<xla::ffi::AnyBuffer>()  // ws_gate (H, Is)
                                  .Arg<xla::ffi::AnyBuffer>()  // ws_up (H, Is)
                                  .Arg<xla::ffi::AnyBuffer>()  // ws_down (Is, H)
                                  .Ret<xla::ffi::AnyBuffer>()  // y (T, H) bf16 or f32
                                  .Ret<xla::ffi::AnyBuffer>()  // pos (T, k) s32
                                  .Ret<xla::ffi::AnyBuffer>()  // offsets (E + 1) s32
                                  .Ret<xla::ffi::AnyBuffer>()  // rows (R) s32
                                  .Ret<xla::ffi::AnyBuffer>()  // gu (R, 2I)
                                  .Ret<xla::ffi::AnyBuffer>()  // y_routed (R, H)
                                  .Ret<xla::ffi::AnyBuffer>()  // gu_shared (T, 2Is)
                                  .Ret<xla::ffi::AnyBuffer>()  // scratch xs (R, H)
                                  .Ret<xla::ffi::AnyBuffer>()  // scratch h (R, I)
                                  .Ret<xla::ffi::AnyBuffer>()  // scratch h_shared (T, Is)
                                  .Ret<xla::ffi::AnyBuffer>()  // scratch y_shared (T, H)
                                  .Ret<xla::ffi::AnyBuffer>()  // scratch layout s32
                                  .Attr<int64_t>("block_m"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
