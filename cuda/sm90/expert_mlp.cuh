// The expert MLPs of the forward (gate|up with SwiGLU, then down, in one launch), also run with
// gate|up alone by the backward's recompute (Config.recompute): a recomputed gu has the bits of
// a saved one only if the same code runs with the same parameters on the same rows.
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
  const int32_t* rows;  // with offsets: each row's route, -1 for padding (tails); or null
  int block_m;
  int groups;
  int64_t m, H, I;
  void *gu, *h, *y;
  int ready_base;  // where this MLP's per-row-tile counts start after the queue header
  int64_t m_expected;  // the rows the launch choices expect used (GemmParams::m_expected)
};

// The MLPs (at most two: the routed experts, the shared expert, which has no offsets) in one
// persistent launch that hands out tiles from *counter (zeroed): every gate|up tile, then every
// down tile, each down tile once its rows' h is complete (counts per row tile in `ready`,
// zeroed, at each MLP's ready_base). down false: gate|up alone (the backward's
// recompute).
//
// Defined in expert_mlp.cu alone: nvcc gives every translation unit that instantiates a kernel
// template its own copy.
const char* LaunchExpertMlps(const ExpertMlp* mlps, int count, bool down,
                             int32_t* counter, int32_t* ready, cudaStream_t stream);

// One expert MLP in block-scaled e4m3 (Config(precision="fp8")): hq = quantize(silu(g) * u)
// with [g | u] = xq @ [w_gate | w_up] (m, I), then y = hq @ w_down (m, H) in bf16. Operands
// e4m3, each with f32 block scales: xq (m, H) and hq (m, I) in 1 x 128 blocks along their
// reduction, the scales of block b of row r at b * pitch + r (GatherQuantizeKernel writes xq's,
// the gate|up epilogue hq's); the weights transposed, K-major as e4m3 wgmma reads them: w_gate,
// w_up (groups, I, H) and w_down (groups, H, I), with the 128 x 128 block scales of the weights
// as they are, (groups, H / 128, I / 128) and (groups, I / 128, H / 128). No gu is kept: the
// FP8 layer's backward is the XLA reference's.
struct ExpertMlpFp8 {
  const void* xq;
  const float* xq_scale;
  int64_t xq_pitch;
  const void *w_gate, *w_up, *w_down;
  const float *gate_scale, *up_scale, *down_scale;
  const int32_t* offsets;
  int block_m;
  int groups;
  int64_t m, H, I;
  void* gu;  // (m, 2I) bf16 [g | u] for the backward, or null: not kept
  void* hq;
  float* hq_scale;
  int64_t hq_pitch;
  void* y;
  int ready_base;
  int64_t m_expected;
};

// LaunchExpertMlps for FP8 MLPs (the routed one, and at most a shared one without groups),
// gate|up then down in one launch.
const char* LaunchExpertMlpsFp8(const ExpertMlpFp8* mlps, int count, int32_t* counter,
                                int32_t* ready, cudaStream_t stream);

}  // namespace mok::sm90
