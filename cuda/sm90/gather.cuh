// Moving token rows into and out of the expert-sorted (routed) order, one warp a row (a token's
// for the gather), 16-byte accesses; rows past offsets[E] (the rows in use) are left alone,
// padding rows get zeros: the GEMMs read whole 128-row tiles, and zero padding keeps every sum
// over a tile exact.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "grid_fill.cuh"

namespace mok::sm90 {

// CTAs of 256 threads of a GatherKernel launch: a warp a token, then a CTA an expert.
inline unsigned GatherCtas(int64_t T, int64_t E) {
  return static_cast<unsigned>((T + 7) / 8 + E);
}

// xs[pos[t, j]] = x[t] for every route with a row; xs[r] = 0 for the padding rows (rows[r] < 0)
// that end each expert's rows (offsets); and zero[0, zero_ints) = 0. One warp a token reads x[t]
// once and writes its k copies, so x streams from HBM once; the CTAs past the tokens' take an
// expert each, whose padding rows (fewer than block_m) their warps zero, a row a warp. (static:
// both the forward and the backward launch it.)
//
// NOTES: a warp a routed row, in the routed order, made a token's k copies at k distant times,
// by then evicted from L2 where x outgrows it (qwen3_30b's 67 MB, dsv3's 59 MB). tools/ab, one
// H200, 2026-12-01 02:05 UTC, same bits: the gather took qwen3_30b 0.242 -> 0.170 ms, gptoss_120b
// 0.094 -> 0.078, dsv3 0.239 -> 0.199; the forward back to back 2.646 -> 2.547, 3.293 -> 3.247,
// 6.752 -> 6.612 ms. The backward's scaled gather in token order too (wip/scatter2) was slower:
// 0.374 -> 0.395 ms on qwen3_30b, its k routes' dot products then in series in one warp.
constexpr int kGatherBatch = 4;  // 16-byte loads a lane in flight before their stores

static __global__ void __launch_bounds__(256)
    GatherKernel(const uint4* __restrict__ x, const int32_t* __restrict__ pos,
                 const int32_t* __restrict__ rows, const int32_t* __restrict__ offsets, int64_t T,
                 int k, int block_m, int chunks_per_row, uint4* __restrict__ xs, int32_t* zero,
                 int64_t zero_ints) {
  GridFill(zero, zero_ints, 0);
  const int lane = threadIdx.x % 32;
  const int64_t warp = int64_t{blockIdx.x} * 8 + threadIdx.x / 32;
  const int64_t token_ctas = (T + 7) / 8;
  if (blockIdx.x >= token_ctas) {
    const int64_t e = blockIdx.x - token_ctas;
    const int32_t end = offsets[e + 1];
    for (int32_t r = max(offsets[e], end - block_m) + threadIdx.x / 32; r < end; r += 8) {
      if (rows[r] >= 0) continue;
      uint4* dst = xs + int64_t{r} * chunks_per_row;
      for (int c = lane; c < chunks_per_row; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
    }
  } else if (warp < T) {
    const uint4* src = x + warp * chunks_per_row;
    const int32_t* route = pos + warp * k;
    for (int c0 = 0; c0 < chunks_per_row; c0 += 32 * kGatherBatch) {
      uint4 v[kGatherBatch];
#pragma unroll
      for (int b = 0; b < kGatherBatch; ++b) {
        const int c = c0 + b * 32 + lane;
        if (c < chunks_per_row) v[b] = __ldg(src + c);
      }
      for (int j = 0; j < k; ++j) {
        const int32_t r = __ldg(route + j);
        if (r < 0) continue;  // an invalid expert id: no row
        uint4* dst = xs + int64_t{r} * chunks_per_row;
#pragma unroll
        for (int b = 0; b < kGatherBatch; ++b) {
          const int c = c0 + b * 32 + lane;
          if (c < chunks_per_row) dst[c] = v[b];
        }
      }
    }
  }
}

__device__ __forceinline__ void Load8(const __nv_bfloat16* p, float f[8]) {
  uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x, f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ void Load8(const float* p, float f[8]) {
  float4 a = __ldg(reinterpret_cast<const float4*>(p));
  float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

// Backward, per routed row r holding route q = (t, j):
//   dy_r[r] = round(w[q] * dy[t]);   dweights[q] = <dy[t], y_routed[r]> (f32).
// The dot product sums each lane's columns in order, then a fixed butterfly across lanes: the
// same bits every run. Routes without a row (pos -1: an invalid expert id) get dweights 0.
template <class D>
__global__ void __launch_bounds__(256)
    ScaleGatherKernel(const D* dy, const __nv_bfloat16* y_routed, const int32_t* rows,
                      const int32_t* rows_in_use, const int32_t* pos, int64_t routes,
                      const float* weights, int k, int H, __nv_bfloat16* dy_r,
                      float* dweights) {
  const int64_t threads = int64_t{gridDim.x} * blockDim.x;
  for (int64_t q = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; q < routes; q += threads) {
    if (pos[q] < 0) dweights[q] = 0.0f;
  }
  const int64_t r = int64_t{blockIdx.x} * 8 + threadIdx.x / 32;
  if (r >= *rows_in_use) return;
  const int lane = threadIdx.x % 32, q = rows[r];
  uint4* dst = reinterpret_cast<uint4*>(dy_r + r * H);
  if (q < 0) {
    for (int c = lane; c < H / 8; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
    return;
  }
  const int64_t t = q / k;
  const float w = weights[q];
  float dot = 0.0f;
  for (int c = lane; c < H / 8; c += 32) {
    float g[8], y[8];
    Load8(dy + t * H + c * 8, g);
    Load8(y_routed + r * H + c * 8, y);
    uint4 v;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dot = fmaf(g[2 * i], y[2 * i], dot);
      dot = fmaf(g[2 * i + 1], y[2 * i + 1], dot);
      o[i] = __floats2bfloat162_rn(w * g[2 * i], w * g[2 * i + 1]);
    }
    dst[c] = v;
  }
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, mask);
  if (lane == 0) dweights[q] = dot;
}

}  // namespace mok::sm90
