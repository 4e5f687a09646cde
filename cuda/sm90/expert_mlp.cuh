// The gate|up GEMM of the expert MLPs, launched by the forward and by the backward's recompute
// (Config.recompute). One definition for both: a recomputed gu has the bits of a saved one only
// if the same kernel runs with the same parameters on the same rows.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mok::sm90 {

// gu = [x_rows @ w_gate | x_rows @ w_up] (m, 2I) and h = silu(g) * u (m, I), bf16, over the row
// groups of `offsets` (null: one group of m rows); w_gate and w_up are (groups, H, I). gu null:
// only h is written (a forward that keeps no gu); h has the same bits either way.
//
// Defined in expert_mlp.cu alone: nvcc gives every translation unit that instantiates a kernel
// template its own copy, and the forward and the recomputing backward should run one and the
// same compiled gate|up kernel.
const char* LaunchGateUp(const void* x_rows, const void* w_gate, const void* w_up,
                         const int32_t* offsets, int block_m, int groups, int64_t m, int64_t H,
                         int64_t I, void* gu, void* h, cudaStream_t stream);

}  // namespace mok::sm90
