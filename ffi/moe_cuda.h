// The CUDA targets (platform "CUDA"): the same contract as the CPU targets (moe_cpu.h).
#pragma once

#include <array>

#include "../cuda/launch.h"
#include "moe_args.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeCombineCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeFwdFp8Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeBwdFp8Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokQuantizeWeightCuda);
// The NVLink transport of expert parallelism (ep_transport_cuda.cc): CUDA only.
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokEpDispatchCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokEpCombineCuda);

namespace mok {

// The buffers that mok_moe_bwd and mok_moe_bwd_fp8 share, into the launcher's arguments: dy, x,
// weights, the six weights w (of the target's kind), the layout and gu of the residuals (their
// xs aside), and every result, xs_rows as both xs and dx_routed (moe_bwd_cuda.cc).
void SetBwdBuffers(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weights,
                   const std::array<ffi::AnyBuffer, 6>& w, const MoeResiduals& res,
                   const MoeBwdResults& out, cuda::MoeBwdArgs& a);

}  // namespace mok
