// y[t] = round(sum_j w[t, j] * y_routed[pos[t, j]] (j ascending) + y_shared[t]), in f32.
// Each token is owned by one warp, so the order of the sum is fixed: no atomics.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace mok::sm90 {

__device__ __forceinline__ void AddBf16x8(float acc[8], uint4 v, float w) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(p[i]);
    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
  }
}

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

// One warp per token, 8 columns (16 bytes of bf16) per lane and step. y_shared may be null.
template <class Y>
__global__ void __launch_bounds__(256)
    CombineKernel(const uint4* y_routed, const uint4* y_shared, const int32_t* pos,
                  const float* weights, int64_t T, int k, int H, Y* y) {
  const int64_t t = int64_t{blockIdx.x} * 8 + threadIdx.x / 32;
  if (t >= T) return;
  const int chunks = H / 8;
  for (int c = threadIdx.x % 32; c < chunks; c += 32) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < k; ++j) {
      const int p = pos[t * k + j];
      if (p < 0) continue;
      AddBf16x8(acc, __ldg(y_routed + int64_t{p} * chunks + c), weights[t * k + j]);
    }
    if (y_shared) AddBf16x8(acc, __ldg(y_shared + t * chunks + c), 1.0f);
    Store8(acc, y + t * H + c * 8);
  }
}

}  // namespace mok::sm90
