// mok_moe_bwd on CUDA GPUs: argument checks here, the work in cuda/sm90 (launch.h).
#include <cuda_runtime_api.h>

#include <array>
#include <string>

#include "../cuda/launch.h"
#include "moe_args.h"
#include "moe_cuda.h"

namespace mok {

void SetBwdBuffers(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weights,
                   const std::array<ffi::AnyBuffer, 6>& w, const MoeResiduals& res,
                   const MoeBwdResults& out, cuda::MoeBwdArgs& a) {
  a.dy = dy.untyped_data(), a.dy_f32 = dy.element_type() == ffi::DataType::F32;
  a.x = x.untyped_data(), a.weights = weights.reinterpret_data<float>();
  a.w_gate = w[0].untyped_data(), a.w_up = w[1].untyped_data(), a.w_down = w[2].untyped_data();
  a.ws_gate = w[3].untyped_data(), a.ws_up = w[4].untyped_data();
  a.ws_down = w[5].untyped_data();
  a.pos = res.pos.reinterpret_data<int32_t>(), a.offsets = res.offsets.reinterpret_data<int32_t>();
  a.rows = res.rows.reinterpret_data<int32_t>();
  a.gu = res.gu.untyped_data(), a.gu_shared = res.gu_shared.untyped_data();
  a.dx = out.dx.untyped_data(), a.dweights = out.dweights.reinterpret_data<float>();
  a.dw_gate = out.dw_gate.untyped_data(), a.dw_up = out.dw_up.untyped_data();
  a.dw_down = out.dw_down.untyped_data();
  a.dws_gate = out.dws_gate.untyped_data(), a.dws_up = out.dws_up.untyped_data();
  a.dws_down = out.dws_down.untyped_data();
  a.xs = a.dx_routed = out.xs_rows.untyped_data();
  a.dy_routed = out.dy_routed.untyped_data();
  a.dgu = out.dgu.untyped_data(), a.h = out.h.untyped_data();
  a.dgu_shared = out.dgu_shared.untyped_data(), a.h_shared = out.h_shared.untyped_data();
  a.dx_shared = out.dx_shared.untyped_data();
  a.dw_parts = out.dw_parts.reinterpret_data<float>();
  a.queue = out.queue.reinterpret_data<int32_t>();
}

namespace {

ffi::Error MoeBwdCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                      ffi::AnyBuffer experts, ffi::AnyBuffer weights, ffi::AnyBuffer w_gate,
                      ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer ws_gate,
                      ffi::AnyBuffer ws_up, ffi::AnyBuffer ws_down, ffi::AnyBuffer pos,
                      ffi::AnyBuffer offsets, ffi::AnyBuffer rows, ffi::AnyBuffer gu,
                      ffi::AnyBuffer gu_shared, ffi::AnyBuffer xs,
                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweights,
                      ffi::Result<ffi::AnyBuffer> dw_gate, ffi::Result<ffi::AnyBuffer> dw_up,
                      ffi::Result<ffi::AnyBuffer> dw_down, ffi::Result<ffi::AnyBuffer> dws_gate,
                      ffi::Result<ffi::AnyBuffer> dws_up, ffi::Result<ffi::AnyBuffer> dws_down,
                      ffi::Result<ffi::AnyBuffer> xs_rows, ffi::Result<ffi::AnyBuffer> dy_routed,
                      ffi::Result<ffi::AnyBuffer> dgu, ffi::Result<ffi::AnyBuffer> dgu_shared,
                      ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> h_shared,
                      ffi::Result<ffi::AnyBuffer> dx_shared, ffi::Result<ffi::AnyBuffer> dw_parts,
                      ffi::Result<ffi::AnyBuffer> queue, int64_t block_m, bool recompute,
                      int64_t ranks) {
  MoeInputs in{x, experts, weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down};
  MoeResiduals res{pos, offsets, rows, gu, gu_shared, xs};
  MoeBwdResults out{*dx,       *dweights, *dw_gate, *dw_up,  *dw_down,   *dws_gate,
                    *dws_up,   *dws_down, *xs_rows, *dy_routed, *dgu, *dgu_shared,
                    *h,        *h_shared, *dx_shared, *dw_parts, *queue};
  auto dims = CheckBwdCall(Platform::kCuda, dy, in, res, out, block_m, recompute, ranks);
  if (dims.has_error()) return dims.error();
  const MoeDims& d = *dims;
  cuda::MoeBwdArgs a{};
  SetLaunchDims(d, a);
  SetBwdBuffers(dy, x, weights, {w_gate, w_up, w_down, ws_gate, ws_up, ws_down}, res, out, a);
  // xs: without recompute read from the residual operand, never through the result that
  // aliases it: the result is only where dx_routed goes, and whether XLA hands both the same
  // buffer (it does when the residual dies with the backward, ops.bwd_aliases) is XLA's choice.
  // With recompute the backward gathers xs into the result itself.
  a.xs_in = d.recompute ? out.xs_rows.untyped_data() : xs.untyped_data();
  a.recompute = d.recompute;
  if (const char* err = cuda::LaunchMoeBwd(a, stream))
    return ffi::Error::Internal(std::string("mok_moe_bwd: ") + err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeBwdCuda, mok::MoeBwdCuda,
    mok::BindMoeBwd(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
