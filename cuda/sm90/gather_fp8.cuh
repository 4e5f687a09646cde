// The FP8 layers' quantizing gathers (Config(precision="fp8")): the forward's token rows, the
// backward's dy and dgu. The kernels are static: each translation unit that launches one has
// its own copy, where a kernel of external linkage in a header would be defined twice.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "gather.cuh"
#include "quantize.cuh"

namespace mok::sm90 {

// xq[pos[t, j]] = x[t] in e4m3, quantized
// once per token in 1 x 128 blocks along H (quantize.cuh), so that no pass over HBM precedes
// it; each block's scale at xq_scale[block * pitch + row] (blocks outer, rows inner: the
// GEMM's producer loads a tile's 128 row scales of a k-block as one TMA box). xq_shared, when
// not null, gets every token's quantized row at row t (the shared expert's A, its scales with
// pitch shared_pitch). Padding rows get zeros and scale 1, as a block of zeros has.
//
// A token's warp holds 8 of its values a lane, 16 lanes a block: the block's amax is a
// butterfly over its half-warp.
static __global__ void __launch_bounds__(256)
    GatherQuantizeKernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ pos,
                         const int32_t* __restrict__ rows, const int32_t* __restrict__ offsets,
                         int64_t T, int k, int block_m, int H, uint8_t* __restrict__ xq,
                         float* __restrict__ xq_scale, int64_t pitch,
                         uint8_t* __restrict__ xq_shared, float* __restrict__ shared_scale,
                         int64_t shared_pitch) {
  const int lane = threadIdx.x % 32;
  const int chunks = H / 8;  // 8 values a chunk: 16 bytes of x, 8 of xq
  const int blocks = H / kFp8Block;
  const int64_t warp = int64_t{blockIdx.x} * 8 + threadIdx.x / 32;
  const int64_t token_ctas = TokenCtas(T);
  if (blockIdx.x >= token_ctas) {
    const int64_t e = blockIdx.x - token_ctas;
    ZeroExpertPadding(rows, offsets, e, block_m, H / 16, reinterpret_cast<uint4*>(xq));
    const int32_t end = offsets[e + 1];
    for (int32_t r = max(offsets[e], end - block_m) + threadIdx.x / 32; r < end; r += 8) {
      if (rows[r] >= 0) continue;
      for (int b = lane; b < blocks; b += 32) xq_scale[b * pitch + r] = 1.0f;
    }
    return;
  }
  if (warp >= T) return;
  const __nv_bfloat16* src = x + warp * H;
  const int32_t* route = pos + warp * k;
  for (int c0 = 0; c0 < chunks; c0 += 32 * kGatherBatch) {
    uint2 q[kGatherBatch];
    float scale[kGatherBatch];
#pragma unroll
    for (int b = 0; b < kGatherBatch; ++b) {
      // H is a multiple of 128: a half-warp's 16 chunks are one block, all in range or none.
      const int c = c0 + b * 32 + lane;
      float f[8];
      float amax = 0.0f;
      if (c < chunks) {
        Load8(src + c * 8, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = MaxNaN(amax, fabsf(f[i]));
      }
#pragma unroll
      for (int d = 1; d < 16; d *= 2) amax = MaxNaN(amax, __shfl_xor_sync(0xffffffffu, amax, d));
      scale[b] = BlockScale(amax);
      if (c < chunks) {
        q[b].x = E4m3Pair(f[0], f[1], scale[b]) | uint32_t{E4m3Pair(f[2], f[3], scale[b])} << 16;
        q[b].y = E4m3Pair(f[4], f[5], scale[b]) | uint32_t{E4m3Pair(f[6], f[7], scale[b])} << 16;
      }
    }
    auto store = [&](int64_t row, uint8_t* out, float* out_scale, int64_t out_pitch) {
#pragma unroll
      for (int b = 0; b < kGatherBatch; ++b) {
        const int c = c0 + b * 32 + lane;
        if (c >= chunks) continue;
        reinterpret_cast<uint2*>(out + row * H)[c] = q[b];
        if (lane % 16 == 0) out_scale[(c / 16) * out_pitch + row] = scale[b];
      }
    };
    for (int j = 0; j < k; ++j) {
      const int32_t r = __ldg(route + j);
      if (r >= 0) store(r, xq, xq_scale, pitch);  // r < 0: an invalid expert id, no row
    }
    if (xq_shared) store(warp, xq_shared, shared_scale, shared_pitch);
  }
}

// out[r] = in[r] in e4m3, quantized in 1 x 128 blocks along its `cols` with the scales laid out
// as GatherQuantizeKernel's (scale[block * pitch + r]), for the rows below *rows_end (null:
// all `rows`): the backward's dgu (whose rows past offsets[E] nothing wrote) into the dx GEMM's
// A. A warp a row, 8 values a lane: a block's amax is a butterfly over its half-warp.
static __global__ void __launch_bounds__(256)
    QuantizeRowsKernel(const __nv_bfloat16* __restrict__ in, int64_t rows,
                       const int32_t* __restrict__ rows_end, int cols, uint8_t* __restrict__ out,
                       float* __restrict__ scale, int64_t pitch) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t{blockIdx.x} * 8 + threadIdx.x / 32;
  const int64_t end = rows_end ? min(rows, int64_t{*rows_end}) : rows;
  if (row >= end) return;  // uniform over the warp
  const int chunks = cols / 8;
  for (int c0 = 0; c0 < chunks; c0 += 32) {
    // cols is a multiple of 128: a half-warp's 16 chunks are one block, all in range or none.
    const int c = c0 + lane;
    float f[8];
    float amax = 0.0f;
    if (c < chunks) {
      Load8(in + row * cols + c * 8, f);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = MaxNaN(amax, fabsf(f[i]));
    }
#pragma unroll
    for (int d = 1; d < 16; d *= 2) amax = MaxNaN(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    const float s = BlockScale(amax);
    if (c < chunks) {
      uint2 q;
      q.x = E4m3Pair(f[0], f[1], s) | uint32_t{E4m3Pair(f[2], f[3], s)} << 16;
      q.y = E4m3Pair(f[4], f[5], s) | uint32_t{E4m3Pair(f[6], f[7], s)} << 16;
      reinterpret_cast<uint2*>(out + row * cols)[c] = q;
      if (lane % 16 == 0) scale[(c / 16) * pitch + row] = s;
    }
  }
}

inline unsigned QuantizeRowsCtas(int64_t rows) { return static_cast<unsigned>((rows + 7) / 8); }

}  // namespace mok::sm90
