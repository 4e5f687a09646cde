// The layout of the routed rows, computed on the device in three small deterministic kernels:
//
//   1. rank:      per chunk of kLayoutChunk routes, the rank of each route among the routes of
//                 its expert in that chunk (into pos, temporarily) and the chunk's count per
//                 expert (into the layout scratch, chunk-major: counts[c * E + e]).
//   2. offsets:   per expert, an exclusive scan of its counts over chunks (in place); then the
//                 exclusive scan over experts of the counts rounded up to block_m: offsets;
//                 rows of each expert's padding = -1.
//   3. positions: pos[q] = offsets[e] + chunk base + rank; rows[pos[q]] = q; rows past
//                 offsets[E] = -1.
//
// They also clear what the launches after them count in (`zero`, the forward's tile queue), so
// that a forward calls no cudaMemsetAsync: each costs the handler 6-30 us of host time while the
// GPU waits for its next launch (gptoss_120b on an H200; docs/performance.md).
//
// Ranks come from warp match + popc and fixed-order scans: no atomics, so every run gives the
// same layout, with each expert's routes in ascending (t, j) order as the CPU target has them.
#pragma once

#include <cstdint>

#include "../layout_contract.h"
#include "grid_fill.cuh"

namespace mok::sm90 {

constexpr int kLayoutChunk = static_cast<int>(mok::kLayoutChunk);  // routes per CTA
constexpr int kLayoutWarps = kLayoutChunk / 32;
constexpr int kMaxExperts = 512;

// Dynamic shared memory: kLayoutWarps * E ints.
__global__ void __launch_bounds__(kLayoutChunk)
    LayoutRankKernel(const int32_t* experts, int64_t routes, int E, int32_t* pos,
                     int32_t* counts, int32_t* zero, int64_t zero_ints) {
  extern __shared__ int32_t warp_counts[];  // (kLayoutWarps, E)
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  GridFill(zero, zero_ints, 0);
  for (int i = tid; i < kLayoutWarps * E; i += kLayoutChunk) warp_counts[i] = 0;
  __syncthreads();
  const int64_t q = int64_t{blockIdx.x} * kLayoutChunk + tid;
  int e = q < routes ? experts[q] : -1;
  if (e < 0 || e >= E) e = -1;  // an invalid id is never used as an address
  const unsigned same = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(same & ((1u << lane) - 1u));
  if (e >= 0 && rank == 0) warp_counts[warp * E + e] = __popc(same);
  __syncthreads();
  for (int x = tid; x < E; x += kLayoutChunk) {
    int run = 0;
    for (int w = 0; w < kLayoutWarps; ++w) {
      int c = warp_counts[w * E + x];
      warp_counts[w * E + x] = run;
      run += c;
    }
    counts[int64_t{blockIdx.x} * E + x] = run;
  }
  __syncthreads();
  if (q < routes) pos[q] = e >= 0 ? warp_counts[warp * E + e] + rank : -1;
}

// One CTA of 1024 threads; thread e owns expert e (E <= kMaxExperts).
__global__ void __launch_bounds__(1024)
    LayoutOffsetsKernel(int32_t* counts, int chunks, int E, int block_m, int32_t* offsets,
                        int32_t* rows) {
  __shared__ int32_t scan[1024];
  const int e = threadIdx.x;
  // Eight chunks' counts are loaded before they are rewritten: loaded one at a time, each load
  // waits for the store before it (the same array); on an H200 qwen3_30b's 128 chunks take this
  // kernel 0.011 ms this way, 0.018 one at a time.
  constexpr int kBatch = 8;
  int total = 0;
  if (e < E) {
    for (int c0 = 0; c0 < chunks; c0 += kBatch) {
      int v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) v[i] = c0 + i < chunks ? counts[int64_t{c0 + i} * E + e] : 0;
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (c0 + i < chunks) counts[int64_t{c0 + i} * E + e] = total;
        total += v[i];
      }
    }
  }
  const int padded = (total + block_m - 1) / block_m * block_m;
  scan[e] = padded;
  __syncthreads();
  for (int step = 1; step < 1024; step *= 2) {  // inclusive Hillis-Steele scan
    int v = e >= step ? scan[e - step] : 0;
    __syncthreads();
    scan[e] += v;
    __syncthreads();
  }
  if (e < E) {
    const int begin = scan[e] - padded;
    offsets[e] = begin;
    for (int r = begin + total; r < begin + padded; ++r) rows[r] = -1;
  }
  if (e == E - 1) offsets[E] = scan[e];
}

__global__ void __launch_bounds__(kLayoutChunk)
    LayoutPositionsKernel(const int32_t* experts, int64_t routes, int E, const int32_t* counts,
                          const int32_t* offsets, int32_t* pos, int32_t* rows, int64_t R) {
  const int64_t q = int64_t{blockIdx.x} * kLayoutChunk + threadIdx.x;
  // Rows past those in use (fewer than R when routes are invalid or experts' padding is short).
  GridFill(rows + offsets[E], R - offsets[E], -1);
  if (q >= routes) return;
  const int e = experts[q];
  if (e < 0 || e >= E) return;  // pos[q] is already -1
  const int p = offsets[e] + counts[int64_t{blockIdx.x} * E + e] + pos[q];
  pos[q] = p;
  rows[p] = static_cast<int32_t>(q);
}

}  // namespace mok::sm90
