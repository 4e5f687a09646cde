// The C++ CPU reference targets (platform "cpu"): the same contract as the CUDA kernels, in
// plain loops, so that CI without a GPU exercises the FFI plumbing, residuals and VJP wiring.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeCombineCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeFwdFp8Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeBwdFp8Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokQuantizeWeightCpu);
