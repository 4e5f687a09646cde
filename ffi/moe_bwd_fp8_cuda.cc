// mok_moe_bwd_fp8 on CUDA GPUs: argument checks here, the work in cuda/sm90 (launch.h).
#include <cuda_runtime_api.h>

#include <string>

#include "../cuda/launch.h"
#include "moe_args.h"
#include "moe_cuda.h"

namespace mok {
namespace {

using Buf = ffi::AnyBuffer;
using Out = ffi::Result<ffi::AnyBuffer>;

ffi::Error MoeBwdFp8Cuda(
    cudaStream_t stream, Buf dy, Buf x, Buf experts, Buf weights, Buf w_gate, Buf w_gate_scale,
    Buf w_up, Buf w_up_scale, Buf w_down, Buf w_down_scale, Buf ws_gate, Buf ws_gate_scale,
    Buf ws_up, Buf ws_up_scale, Buf ws_down, Buf ws_down_scale, Buf pos, Buf offsets, Buf rows,
    Buf gu, Buf gu_shared, Out dx, Out dweights, Out dw_gate, Out dw_up, Out dw_down,
    Out dws_gate, Out dws_up, Out dws_down, Out xs_rows, Out dy_routed, Out dgu, Out dgu_shared,
    Out h, Out h_shared, Out dx_shared, Out dw_parts, Out queue, Out dyq, Out dyq_scale,
    Out dyq_shared, Out dyq_shared_scale, Out dguq, Out dguq_scale, Out dguq_shared,
    Out dguq_shared_scale, int64_t block_m, int64_t ranks) {
  MoeFp8Inputs in{x,      experts,      weights,     w_gate,  w_gate_scale,
                  w_up,   w_up_scale,   w_down,      w_down_scale, ws_gate,
                  ws_gate_scale, ws_up, ws_up_scale, ws_down, ws_down_scale};
  MoeFp8Residuals res{pos, offsets, rows, gu, gu_shared};
  MoeBwdResults out{*dx,       *dweights, *dw_gate, *dw_up,  *dw_down,   *dws_gate,
                    *dws_up,   *dws_down, *xs_rows, *dy_routed, *dgu, *dgu_shared,
                    *h,        *h_shared, *dx_shared, *dw_parts, *queue};
  MoeBwdFp8Scratch q{*dyq,  *dyq_scale,  *dyq_shared,  *dyq_shared_scale,
                     *dguq, *dguq_scale, *dguq_shared, *dguq_shared_scale};
  auto dims = CheckBwdFp8Call(Platform::kCuda, dy, in, res, out, q, block_m, ranks);
  if (dims.has_error()) return dims.error();
  auto f32 = [](ffi::AnyBuffer b) { return b.reinterpret_data<float>(); };
  cuda::MoeBwdFp8Args f{};
  cuda::MoeBwdArgs& a = f.bwd;
  SetLaunchDims(*dims, a);
  // x is gathered into xs_rows, which the weight gradients read and dx_r then takes; gu
  // stands in for the residual xs, which the FP8 forward does not keep.
  SetBwdBuffers(dy, x, weights, {w_gate, w_up, w_down, ws_gate, ws_up, ws_down},
                {pos, offsets, rows, gu, gu_shared, gu}, out, a);
  a.xs_in = a.xs;
  f.w_gate_scale = f32(w_gate_scale), f.w_up_scale = f32(w_up_scale);
  f.w_down_scale = f32(w_down_scale);
  f.ws_gate_scale = f32(ws_gate_scale), f.ws_up_scale = f32(ws_up_scale);
  f.ws_down_scale = f32(ws_down_scale);
  f.dyq = q.dyq.untyped_data(), f.dyq_scale = f32(q.dyq_scale);
  f.dyq_shared = q.dyq_shared.untyped_data(), f.dyq_shared_scale = f32(q.dyq_shared_scale);
  f.dguq = q.dguq.untyped_data(), f.dguq_scale = f32(q.dguq_scale);
  f.dguq_shared = q.dguq_shared.untyped_data(), f.dguq_shared_scale = f32(q.dguq_shared_scale);
  if (const char* err = cuda::LaunchMoeBwdFp8(f, stream))
    return ffi::Error::Internal(std::string("mok_moe_bwd_fp8: ") + err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeBwdFp8Cuda, mok::MoeBwdFp8Cuda,
    mok::BindMoeBwdFp8(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
