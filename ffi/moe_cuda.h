// The CUDA targets (platform "CUDA"): the same contract as the CPU targets (moe_cpu.h).
#pragma once

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
