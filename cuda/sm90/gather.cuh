// Moving token rows into the expert-sorted (routed) order, one warp a token, 16-byte accesses;
// rows past offsets[E] (the rows in use) are left alone, padding rows get zeros: the GEMMs read
// whole 128-row tiles, and zero padding keeps every sum over a tile exact.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "grid_fill.cuh"

namespace mok::sm90 {

// out[r] = 0 for expert e's padding rows (rows[r] < 0), which end its rows [offsets[e],
// offsets[e + 1]) and are fewer than block_m: a row a warp of a CTA of 256 threads.
__device__ __forceinline__ void ZeroExpertPadding(const int32_t* __restrict__ rows,
                                                  const int32_t* __restrict__ offsets, int64_t e,
                                                  int block_m, int chunks_per_row,
                                                  uint4* __restrict__ out) {
  const int32_t end = offsets[e + 1];
  for (int32_t r = max(offsets[e], end - block_m) + threadIdx.x / 32; r < end; r += 8) {
    if (rows[r] >= 0) continue;
    uint4* dst = out + int64_t{r} * chunks_per_row;
    for (int c = threadIdx.x % 32; c < chunks_per_row; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
  }
}

// A GatherKernel launch: CTAs of 256 threads, first TokenCtas(T) of a warp a token, then a CTA
// an expert (its padding rows).
__host__ __device__ __forceinline__ int64_t TokenCtas(int64_t T) { return (T + 7) / 8; }
inline unsigned GatherCtas(int64_t T, int64_t E) {
  return static_cast<unsigned>(TokenCtas(T) + E);
}

// Eight values of a row (16 bytes of bf16, 32 of f32) as f32.
__device__ __forceinline__ void Load8(const __nv_bfloat16* p, float f[8]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x, f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void Load8(const float* p, float f[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

// Eight values as 16 bytes of bf16: as they are, or f32 rounded.
__device__ __forceinline__ uint4 LoadBf16x8(const __nv_bfloat16* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint4 LoadBf16x8(const float* p) {
  float f[8];
  Load8(p, f);
  uint4 v;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// xs[pos[t, j]] = round(x[t]) for every route with a row; xs[r] = 0 for the padding rows
// (rows[r] < 0) that end each expert's rows (offsets); and zero[0, zero_ints) = 0. One warp a
// token reads x[t] once and writes its k copies, so x streams from HBM once; the CTAs past the
// tokens' take an expert each, whose padding rows (fewer than block_m) their warps zero, a row a
// warp. The forward gathers x, the backward dy (bf16 copies as they are; f32 rounds to bf16).
// The backward's dy is copied unscaled: the SwiGLU backward's epilogue applies each route's
// weight and takes dweights (epilogue.cuh).
//
// A warp a token, not a warp a routed row: in the routed order a token's k copies would be made
// at k distant times, by then evicted from L2 where x outgrows it (qwen3_30b's 67 MB, dsv3's
// 59 MB); on an H200 qwen3_30b's gather takes 0.170 ms this way against 0.242
// (docs/performance.md).
constexpr int kGatherBatch = 4;  // 16-byte chunks a lane in flight before their stores

template <class D>
__global__ void __launch_bounds__(256)
    GatherKernel(const D* __restrict__ x, const int32_t* __restrict__ pos,
                 const int32_t* __restrict__ rows, const int32_t* __restrict__ offsets, int64_t T,
                 int k, int block_m, int H, __nv_bfloat16* __restrict__ xs, int32_t* zero,
                 int64_t zero_ints) {
  GridFill(zero, zero_ints, 0);
  const int lane = threadIdx.x % 32;
  const int chunks = H / 8;
  const int64_t warp = int64_t{blockIdx.x} * 8 + threadIdx.x / 32;
  const int64_t token_ctas = TokenCtas(T);
  if (blockIdx.x >= token_ctas) {
    ZeroExpertPadding(rows, offsets, blockIdx.x - token_ctas, block_m, chunks,
                      reinterpret_cast<uint4*>(xs));
  } else if (warp < T) {
    const D* src = x + warp * H;
    const int32_t* route = pos + warp * k;
    for (int c0 = 0; c0 < chunks; c0 += 32 * kGatherBatch) {
      uint4 v[kGatherBatch];
#pragma unroll
      for (int b = 0; b < kGatherBatch; ++b) {
        const int c = c0 + b * 32 + lane;
        if (c < chunks) v[b] = LoadBf16x8(src + c * 8);
      }
      for (int j = 0; j < k; ++j) {
        const int32_t r = __ldg(route + j);
        if (r < 0) continue;  // an invalid expert id: no row
        uint4* dst = reinterpret_cast<uint4*>(xs + int64_t{r} * H);
#pragma unroll
        for (int b = 0; b < kGatherBatch; ++b) {
          const int c = c0 + b * 32 + lane;
          if (c < chunks) dst[c] = v[b];
        }
      }
    }
  }
}

}  // namespace mok::sm90
