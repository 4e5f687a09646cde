// LaunchCombine (launch.h): CombineKernel, the forward's combine, on rows that another call
// computed (the home rank's sum under expert parallelism).
#include "../launch.h"
#include "combine.cuh"

namespace mok::cuda {

const char* LaunchCombine(const CombineArgs& a, cudaStream_t stream) {
  using bf16 = __nv_bfloat16;
  if (a.T == 0) return nullptr;
  const auto ctas = static_cast<unsigned>((a.T + 7) / 8);  // a warp a token
  const auto* rows = static_cast<const bf16*>(a.rows);
  const auto* extra = static_cast<const bf16*>(a.extra);
  if (a.out_f32) {
    sm90::CombineKernel<bf16, float><<<ctas, 256, 0, stream>>>(
        rows, extra, a.pos, a.weights, a.T, a.k, a.H, static_cast<float*>(a.out));
  } else {
    sm90::CombineKernel<bf16, bf16><<<ctas, 256, 0, stream>>>(
        rows, extra, a.pos, a.weights, a.T, a.k, a.H, static_cast<bf16*>(a.out));
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace mok::cuda
