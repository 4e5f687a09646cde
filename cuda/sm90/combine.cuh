// out[t] = round(sum_j w[t, j] * in[pos[t, j]] (j ascending) + extra[t]), in f32. Each token is
// owned by one warp, so the order of the sum is fixed: no atomics. Forward: in = y_routed,
// extra = the shared expert's output. Backward: in = dx_routed, w = 1, extra = the shared
// expert's dx; and dweights[t, j] = sum_b dw_parts[pos[t, j], b] (b ascending; 0 without a row),
// the SwiGLU backward's partial sums of <dh, h> (epilogue.cuh).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "gather.cuh"

namespace mok::sm90 {

__device__ __forceinline__ void Store8(const float acc[8], __nv_bfloat16* dst) {
  uint4 v;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  *reinterpret_cast<uint4*>(dst) = v;
}

__device__ __forceinline__ void Store8(const float acc[8], float* dst) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

// One warp per token, 8 columns per lane and step. weights null: every route weighs 1;
// extra may be null; dweights null: no dweights (dw_parts has `parts` columns).
template <class In, class Out>
__global__ void __launch_bounds__(256)
    CombineKernel(const In* in, const In* extra, const int32_t* pos, const float* weights,
                  int64_t T, int k, int H, Out* out, const float* dw_parts = nullptr,
                  int parts = 0, float* dweights = nullptr) {
  const int64_t t = int64_t{blockIdx.x} * 8 + threadIdx.x / 32;
  if (t >= T) return;
  for (int j = threadIdx.x % 32; dweights && j < k; j += 32) {
    const int p = pos[t * k + j];
    float d = 0.0f;
    for (int b = 0; p >= 0 && b < parts; ++b) d += dw_parts[int64_t{p} * parts + b];
    dweights[t * k + j] = d;
  }
  for (int c = threadIdx.x % 32; c < H / 8; c += 32) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8];
    for (int j = 0; j < k; ++j) {
      const int p = pos[t * k + j];
      if (p < 0) continue;
      const float w = weights ? weights[t * k + j] : 1.0f;
      Load8(in + int64_t{p} * H + c * 8, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, v[i], acc[i]);
    }
    if (extra) {
      Load8(extra + t * H + c * 8, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += v[i];
    }
    Store8(acc, out + t * H + c * 8);
  }
}

}  // namespace mok::sm90
