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

// A GatherKernel or ScaleGatherKernel launch: CTAs of 256 threads, first TokenCtas(T) of a warp
// a token, then a CTA an expert (its padding rows).
__host__ __device__ __forceinline__ int64_t TokenCtas(int64_t T) { return (T + 7) / 8; }
inline unsigned GatherCtas(int64_t T, int64_t E) {
  return static_cast<unsigned>(TokenCtas(T) + E);
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
  const int64_t token_ctas = TokenCtas(T);
  if (blockIdx.x >= token_ctas) {
    ZeroExpertPadding(rows, offsets, blockIdx.x - token_ctas, block_m, chunks_per_row, xs);
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

// Eight values of a row as loaded (16 bytes of bf16, 32 of f32), unpacked to f32 only where they
// are used, so that a batch of loads in flight holds half the registers.
template <class D>
struct Chunk8;
template <>
struct Chunk8<__nv_bfloat16> {
  uint4 v;
  __device__ __forceinline__ void load(const __nv_bfloat16* p) {
    v = __ldg(reinterpret_cast<const uint4*>(p));
  }
  __device__ __forceinline__ void unpack(float f[8]) const {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x, f[2 * i + 1] = t.y;
    }
  }
};
template <>
struct Chunk8<float> {
  float4 a, b;
  __device__ __forceinline__ void load(const float* p) {
    a = __ldg(reinterpret_cast<const float4*>(p));
    b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  }
  __device__ __forceinline__ void unpack(float f[8]) const {
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  }
};

template <class D>
__device__ __forceinline__ void Load8(const D* p, float f[8]) {
  Chunk8<D> c;
  c.load(p);
  c.unpack(f);
}

// Backward, per route q = (t, j) with a row r = pos[q]:
//   dy_r[r] = round(w[q] * dy[t]);   dweights[q] = <dy[t], y_routed[r]> (f32).
// One warp a token (dy[t] read from HBM once, as the gather reads x[t]), its routes kScaleRoutes
// at a time, each lane kGatherBatch 16-byte chunks at a time of dy[t] and of each route's
// y_routed row, all loaded before they are used. Each lane sums its columns in order (chunks c =
// lane, lane + 32, ...), then a fixed butterfly across lanes: the same bits every run, and as a
// warp a routed row gave them. Routes without a row (pos -1: an invalid expert id) get dweights
// 0; the padding rows that end each expert's rows get zeros in dy_r, a CTA an expert (past the
// T / 8 CTAs of the tokens: GatherCtas). zero[0, zero_ints) = 0, as GatherKernel does it, for
// a backward that gathers no xs (the forward's is a residual).
//
// NOTES: a warp a routed row read dy[t] k times, from HBM where dy outgrows L2 (the gather's
// NOTES). The same in token order with the routes in series, each chunk loaded as it was used
// (wip/scatter2), was slower than that (qwen3_30b 0.374 -> 0.395 ms, H200, 2026-12-01); with
// the loads batched as here, faster (qwen3_30b 0.378 -> 0.310, gptoss_120b 0.150 -> 0.128, dsv3
// 0.356 -> 0.311 ms, H200, 2026-12-01).
constexpr int kScaleRoutes = 4;

template <class D>
__global__ void __launch_bounds__(256)
    ScaleGatherKernel(const D* __restrict__ dy, const __nv_bfloat16* __restrict__ y_routed,
                      const int32_t* __restrict__ rows, const int32_t* __restrict__ offsets,
                      const int32_t* __restrict__ pos, int64_t T, const float* __restrict__ weights,
                      int k, int block_m, int H, __nv_bfloat16* __restrict__ dy_r,
                      float* __restrict__ dweights, int32_t* zero, int64_t zero_ints) {
  GridFill(zero, zero_ints, 0);
  const int lane = threadIdx.x % 32;
  const int64_t token_ctas = TokenCtas(T);
  const int chunks = H / 8;
  if (blockIdx.x >= token_ctas) {
    ZeroExpertPadding(rows, offsets, blockIdx.x - token_ctas, block_m, chunks,
                      reinterpret_cast<uint4*>(dy_r));
    return;
  }
  const int64_t t = int64_t{blockIdx.x} * 8 + threadIdx.x / 32;
  if (t >= T) return;
  for (int j0 = 0; j0 < k; j0 += kScaleRoutes) {
    int32_t r[kScaleRoutes];
    float w[kScaleRoutes], dot[kScaleRoutes];
#pragma unroll
    for (int i = 0; i < kScaleRoutes; ++i) {
      r[i] = j0 + i < k ? pos[t * k + j0 + i] : -1;
      w[i] = r[i] >= 0 ? weights[t * k + j0 + i] : 0.0f;
      dot[i] = 0.0f;
    }
    for (int c0 = 0; c0 < chunks; c0 += 32 * kGatherBatch) {
      Chunk8<D> g[kGatherBatch];
#pragma unroll
      for (int b = 0; b < kGatherBatch; ++b) {
        const int c = c0 + b * 32 + lane;
        if (c < chunks) g[b].load(dy + t * H + c * 8);
      }
#pragma unroll
      for (int i = 0; i < kScaleRoutes; ++i) {
        if (r[i] < 0) continue;
        const __nv_bfloat16* src = y_routed + int64_t{r[i]} * H;
        uint4* dst = reinterpret_cast<uint4*>(dy_r + int64_t{r[i]} * H);
        Chunk8<__nv_bfloat16> y[kGatherBatch];
#pragma unroll
        for (int b = 0; b < kGatherBatch; ++b) {
          const int c = c0 + b * 32 + lane;
          if (c < chunks) y[b].load(src + c * 8);
        }
#pragma unroll
        for (int b = 0; b < kGatherBatch; ++b) {
          const int c = c0 + b * 32 + lane;
          if (c >= chunks) continue;
          float gf[8], yf[8];
          g[b].unpack(gf);
          y[b].unpack(yf);
          uint4 v;
          __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            dot[i] = fmaf(gf[2 * e], yf[2 * e], dot[i]);
            dot[i] = fmaf(gf[2 * e + 1], yf[2 * e + 1], dot[i]);
            o[e] = __floats2bfloat162_rn(w[i] * gf[2 * e], w[i] * gf[2 * e + 1]);
          }
          dst[c] = v;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kScaleRoutes; ++i) {
      if (j0 + i >= k) continue;
      float d = dot[i];
#pragma unroll
      for (int mask = 16; mask > 0; mask /= 2) d += __shfl_xor_sync(0xffffffffu, d, mask);
      if (lane == 0) dweights[t * k + j0 + i] = r[i] >= 0 ? d : 0.0f;
    }
  }
}

}  // namespace mok::sm90
