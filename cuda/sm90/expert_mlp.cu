// The gate|up launch declared in expert_mlp.cuh, in this one translation unit (NOTES there).
#include "expert_mlp.cuh"

#include "gemm_launch.cuh"

namespace mok::sm90 {

const char* LaunchGateUp(const void* x_rows, const void* w_gate, const void* w_up,
                         const int32_t* offsets, int block_m, int groups, int64_t m, int64_t H,
                         int64_t I, void* gu, void* h, cudaStream_t stream) {
  GemmParams p{};
  p.offsets = offsets, p.block_m = block_m, p.groups = groups, p.m_total = m;
  p.n = static_cast<int>(I), p.k = static_cast<int>(H), p.k_split = p.k, p.n_split = p.n;
  p.out0 = gu, p.out1 = h;
  const Matrix w_gate_m{w_gate, I, groups * H}, w_up_m{w_up, I, groups * H};
  return LaunchGemm<FwdGateUp>(p, {x_rows, H, m}, w_gate_m, w_up_m, stream);
}

}  // namespace mok::sm90
