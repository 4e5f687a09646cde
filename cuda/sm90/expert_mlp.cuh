// The expert MLPs of the forward (gate|up with SwiGLU, then down, in one launch), and the
// gate|up GEMM alone for the backward's recompute (Config.recompute). Both run one and the same
// compiled kernel: a recomputed gu has the bits of a saved one only if the same code runs with
// the same parameters on the same rows.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mok::sm90 {

// One expert MLP over the row groups of `offsets` (null: one group of m rows): gu = [x_rows @
// w_gate | x_rows @ w_up] (m, 2I), h = silu(g) * u (m, I), y = h @ w_down (m, H), all bf16;
// w_gate and w_up are (groups, H, I), w_down (groups, I, H). gu null: only h is written (a
// forward that keeps no gu); h has the same bits either way.
struct ExpertMlp {
  const void* x_rows;
  const void *w_gate, *w_up, *w_down;
  const int32_t* offsets;
  int block_m;
  int groups;
  int64_t m, H, I;
  void *gu, *h, *y;
  int ready_base;  // where this MLP's per-row-tile counts start after the queue header
};

// The forward's MLPs (at most two: the routed experts, the shared expert; at most one with
// offsets) in one persistent launch that hands out tiles from `queue` (TileQueueInts, zeroed):
// every gate|up tile, then every down tile, each down tile once its rows' h is complete.
// gate_up / down false leave that GEMM out (MOK_FWD_SKIP); the results are then wrong.
const char* LaunchExpertMlps(const ExpertMlp* mlps, int count, bool gate_up, bool down,
                             int32_t* queue, cudaStream_t stream);

// gu and h of one MLP (its w_down and y unused), for the backward's recompute.
//
// Defined in expert_mlp.cu alone, as is LaunchExpertMlps: nvcc gives every translation unit
// that instantiates a kernel template its own copy.
const char* LaunchGateUp(const ExpertMlp& mlp, cudaStream_t stream);

}  // namespace mok::sm90
