// mok_moe_fwd_fp8 on CUDA GPUs: argument checks here, the work in cuda/sm90 (launch.h).
#include <cuda_runtime_api.h>

#include <string>

#include "../cuda/launch.h"
#include "moe_args.h"
#include "moe_cuda.h"

namespace mok {
namespace {

ffi::Error MoeFwdFp8Cuda(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer experts, ffi::AnyBuffer weights,
    ffi::AnyBuffer w_gate, ffi::AnyBuffer w_gate_scale, ffi::AnyBuffer w_up,
    ffi::AnyBuffer w_up_scale, ffi::AnyBuffer w_down, ffi::AnyBuffer w_down_scale,
    ffi::AnyBuffer ws_gate, ffi::AnyBuffer ws_gate_scale, ffi::AnyBuffer ws_up,
    ffi::AnyBuffer ws_up_scale, ffi::AnyBuffer ws_down, ffi::AnyBuffer ws_down_scale,
    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> pos,
    ffi::Result<ffi::AnyBuffer> offsets, ffi::Result<ffi::AnyBuffer> rows,
    ffi::Result<ffi::AnyBuffer> gu, ffi::Result<ffi::AnyBuffer> gu_shared,
    ffi::Result<ffi::AnyBuffer> xq, ffi::Result<ffi::AnyBuffer> xq_scale,
    ffi::Result<ffi::AnyBuffer> hq, ffi::Result<ffi::AnyBuffer> hq_scale,
    ffi::Result<ffi::AnyBuffer> y_routed, ffi::Result<ffi::AnyBuffer> xq_shared,
    ffi::Result<ffi::AnyBuffer> xq_shared_scale, ffi::Result<ffi::AnyBuffer> hq_shared,
    ffi::Result<ffi::AnyBuffer> hq_shared_scale, ffi::Result<ffi::AnyBuffer> y_shared,
    ffi::Result<ffi::AnyBuffer> layout, int64_t block_m, int64_t ranks) {
  MoeFp8Inputs in{x,      experts,      weights,     w_gate,  w_gate_scale,
                  w_up,   w_up_scale,   w_down,      w_down_scale, ws_gate,
                  ws_gate_scale, ws_up, ws_up_scale, ws_down, ws_down_scale};
  MoeFwdFp8Results out{*y,         *pos,       *offsets,         *rows,      *gu, *gu_shared, *xq,
                       *xq_scale,  *hq,        *hq_scale,        *y_routed,  *xq_shared,
                       *xq_shared_scale, *hq_shared, *hq_shared_scale, *y_shared, *layout};
  auto dims = CheckFp8Call(Platform::kCuda, in, out, block_m, ranks);
  if (dims.has_error()) return dims.error();
  auto f32 = [](ffi::AnyBuffer b) { return b.reinterpret_data<float>(); };
  cuda::MoeFwdFp8Args a{};
  SetLaunchDims(*dims, a);
  a.x = x.untyped_data();
  a.experts = experts.reinterpret_data<int32_t>();
  a.weights = weights.reinterpret_data<float>();
  a.w_gate = w_gate.untyped_data(), a.w_gate_scale = f32(w_gate_scale);
  a.w_up = w_up.untyped_data(), a.w_up_scale = f32(w_up_scale);
  a.w_down = w_down.untyped_data(), a.w_down_scale = f32(w_down_scale);
  a.ws_gate = ws_gate.untyped_data(), a.ws_gate_scale = f32(ws_gate_scale);
  a.ws_up = ws_up.untyped_data(), a.ws_up_scale = f32(ws_up_scale);
  a.ws_down = ws_down.untyped_data(), a.ws_down_scale = f32(ws_down_scale);
  a.y = out.y.untyped_data();
  a.y_f32 = out.y.element_type() == ffi::DataType::F32;
  a.pos = out.pos.reinterpret_data<int32_t>();
  a.offsets = out.offsets.reinterpret_data<int32_t>();
  a.rows = out.rows.reinterpret_data<int32_t>();
  a.xq = out.xq.untyped_data(), a.xq_scale = f32(out.xq_scale);
  a.hq = out.hq.untyped_data(), a.hq_scale = f32(out.hq_scale);
  a.y_routed = out.y_routed.untyped_data();
  a.xq_shared = out.xq_shared.untyped_data(), a.xq_shared_scale = f32(out.xq_shared_scale);
  a.hq_shared = out.hq_shared.untyped_data(), a.hq_shared_scale = f32(out.hq_shared_scale);
  a.y_shared = out.y_shared.untyped_data();
  a.gu = dims->recompute ? nullptr : out.gu.untyped_data();
  a.gu_shared = dims->recompute || dims->Is == 0 ? nullptr : out.gu_shared.untyped_data();
  a.layout = out.layout.reinterpret_data<int32_t>();
  if (const char* err = cuda::LaunchMoeFwdFp8(a, stream))
    return ffi::Error::Internal(std::string("mok_moe_fwd_fp8: ") + err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeFwdFp8Cuda, mok::MoeFwdFp8Cuda,
    mok::BindMoeFwdFp8(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
