// LaunchQuantizeWeight (launch.h): quantize_experts' pass over an expert weight, one CTA per
// 128 x 128 block. The block's values stay in registers between its amax and their
// conversion, so the weight is read once; the e4m3 values leave twice, as they are (the
// reference's blocks) and transposed through shared memory (the forward's K-major operand).
#include <cuda_bf16.h>

#include "../launch.h"
#include "gather.cuh"
#include "quantize.cuh"

namespace mok::cuda {
namespace {

using sm90::kFp8Block;

__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(float v) { return v; }

// Thread t holds columns 8 (t % 16) .. + 7 of rows t / 16 + 16 j (j < 8): a half-warp reads
// 128 consecutive values of a row. Values past the matrix's edge count as zeros in the amax
// and are not stored.
template <class T>
__global__ void __launch_bounds__(256)
    QuantizeWeightKernel(const T* __restrict__ w, int64_t K, int64_t N, int64_t k_blocks,
                         int64_t n_blocks, uint8_t* __restrict__ data,
                         uint8_t* __restrict__ k_major, float* __restrict__ scale) {
  // The block transposed, t[n][k]. A row of 129 bytes: the byte stores of a warp, 16 column
  // chunks 8 rows of t apart, fall in 16 different banks.
  __shared__ uint8_t t[kFp8Block][kFp8Block + 1];
  __shared__ float warp_amax[8];
  const int64_t blk = blockIdx.x;  // (batch, k block, n block), n block fastest: scale's order
  const int64_t bn = blk % n_blocks, bk = blk / n_blocks % k_blocks;
  const int64_t b = blk / (n_blocks * k_blocks);
  const int64_t k0 = bk * kFp8Block, n0 = bn * kFp8Block;
  const int rows = static_cast<int>(K - k0 < kFp8Block ? K - k0 : kFp8Block);
  const int cols = static_cast<int>(N - n0 < kFp8Block ? N - n0 : kFp8Block);
  const int tid = threadIdx.x, c = 8 * (tid % 16), r0 = tid / 16;
  const bool aligned = N % 8 == 0;  // 8 values a row start at a 16-byte boundary
  const bool full = aligned && c + 8 <= cols;
  const T* m = w + b * K * N;
  float v[8][8];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int r = r0 + 16 * j;
    const T* p = m + (k0 + r) * N + n0 + c;
    if (r < rows && full) {
      sm90::Load8(p, v[j]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[j][i] = r < rows && c + i < cols ? ToFloat(p[i]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = sm90::MaxNaN(amax, fabsf(v[j][i]));
  }
#pragma unroll
  for (int d = 16; d > 0; d /= 2) amax = sm90::MaxNaN(amax, __shfl_xor_sync(0xffffffffu, amax, d));
  if (tid % 32 == 0) warp_amax[tid / 32] = amax;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = sm90::MaxNaN(amax, warp_amax[i]);
  const float s = sm90::BlockScale(amax);
  if (tid == 0) scale[blk] = s;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int r = r0 + 16 * j;
    uint2 q;  // the 8 e4m3 bytes, column c first
    q.x = sm90::E4m3Pair(v[j][0], v[j][1], s) | uint32_t{sm90::E4m3Pair(v[j][2], v[j][3], s)} << 16;
    q.y = sm90::E4m3Pair(v[j][4], v[j][5], s) | uint32_t{sm90::E4m3Pair(v[j][6], v[j][7], s)} << 16;
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&q);
#pragma unroll
    for (int i = 0; i < 8; ++i) t[c + i][r] = bytes[i];
    if (r >= rows) continue;
    uint8_t* out = data + (b * K + k0 + r) * N + n0 + c;
    if (full) {
      *reinterpret_cast<uint2*>(out) = q;
    } else {
      for (int i = 0; i < 8 && c + i < cols; ++i) out[i] = bytes[i];
    }
  }
  __syncthreads();
  // k_major's rows n0 + n: 16 bytes of k a thread, eight threads a row of the block.
  for (int i = tid; i < kFp8Block * 8; i += 256) {
    const int n = i / 8, kk = 16 * (i % 8);
    if (n >= cols || kk >= rows) continue;
    uint8_t* out = k_major + (b * N + n0 + n) * K + k0 + kk;
    if (K % 16 == 0 && kk + 16 <= rows) {
      uint32_t word[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        word[e] = t[n][kk + 4 * e] | uint32_t{t[n][kk + 4 * e + 1]} << 8 |
                  uint32_t{t[n][kk + 4 * e + 2]} << 16 | uint32_t{t[n][kk + 4 * e + 3]} << 24;
      *reinterpret_cast<uint4*>(out) = make_uint4(word[0], word[1], word[2], word[3]);
    } else {
      for (int e = 0; e < 16 && kk + e < rows; ++e) out[e] = t[n][kk + e];
    }
  }
}

}  // namespace

const char* LaunchQuantizeWeight(const QuantizeWeightArgs& a, cudaStream_t stream) {
  if (a.batch == 0 || a.K == 0 || a.N == 0) return nullptr;
  const int64_t k_blocks = (a.K + kFp8Block - 1) / kFp8Block;
  const int64_t n_blocks = (a.N + kFp8Block - 1) / kFp8Block;
  const int64_t ctas = a.batch * k_blocks * n_blocks;
  if (ctas >= (int64_t{1} << 31)) return "more than 2^31 - 1 blocks of 128 x 128";
  auto* data = static_cast<uint8_t*>(a.data);
  auto* k_major = static_cast<uint8_t*>(a.k_major);
  if (a.w_f32) {
    QuantizeWeightKernel<float><<<static_cast<unsigned>(ctas), 256, 0, stream>>>(
        static_cast<const float*>(a.w), a.K, a.N, k_blocks, n_blocks, data, k_major, a.scale);
  } else {
    QuantizeWeightKernel<__nv_bfloat16><<<static_cast<unsigned>(ctas), 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(a.w), a.K, a.N, k_blocks, n_blocks, data, k_major,
        a.scale);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace mok::cuda
