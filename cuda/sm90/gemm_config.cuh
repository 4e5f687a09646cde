// Tile shapes, pipeline depth and register split of the grouped expert GEMM (sm90).
#pragma once

#include <cstdint>

#include <cuda.h>
#include <cuda_bf16.h>

namespace mok::sm90 {

struct GemmConfig {
  // NOTES: a 128 x 256 tile over two consumer warpgroups (64 x 256 each, one
  // wgmma.m64n256k16 per k16 step) keeps 128 f32 accumulators per thread and reads 48 KB of
  // shared memory per 64-deep k-step; four stages (192 KB) cover TMA latency.
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kBlockK = 64;
  static constexpr int kStages = 4;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // setmaxnreg: the producer needs few registers; consumers hold the accumulators.
  static constexpr uint32_t kProducerRegs = 40;
  static constexpr uint32_t kConsumerRegs = 232;
  // TMA boxes: 64 bf16 = 128 bytes inner, the 128-byte swizzle span.
  static constexpr int kBoxInner = 64;
  static constexpr int kBoxesB = kBlockN / kBoxInner;
  static constexpr uint32_t kStageBytesA = kBlockM * kBlockK * 2;
  static constexpr uint32_t kStageBytesB = kBlockN * kBlockK * 2;
  static constexpr uint32_t kStageBytes = kStageBytesA + kStageBytesB;
};

// What a GEMM epilogue does with the 128 x 256 f32 accumulator tile.
enum class Epilogue {
  // out0 = y (rows, n): the tile's 256 columns of one B.
  kStore,
  // B = [w_gate tile (128 columns) | w_up tile (128 columns)]; out0 = gu (rows, 2n) gets
  // [g | u] rounded, out1 = h (rows, n) gets round(silu(g) * u) from the f32 values.
  kSwiGLU,
};

// Host-built arguments of one grouped GEMM launch: C[rows of group g] = A[rows] @ B_g, where
// B_g is rows [g * k, (g + 1) * k) of the (groups * k, n) matrix behind the B tensor maps.
struct GemmParams {
  CUtensorMap a;            // A (m_total, k) bf16, box (64, 128)
  CUtensorMap b0;           // B (groups * k, n) bf16, box (64, 64): w_down, or w_gate
  CUtensorMap b1;           // w_up (kSwiGLU only)
  const int32_t* offsets;   // (groups + 1) first row of each group, multiples of kBlockM;
                            // null: a single group of m_total rows
  int groups;
  int64_t m_total;          // rows of A and of the outputs
  int n, k;                 // columns of one B; the reduction
  int n_tiles;              // column tiles per row block
  __nv_bfloat16* out0;      // kStore: y (m_total, n); kSwiGLU: gu (m_total, 2n)
  __nv_bfloat16* out1;      // kSwiGLU: h (m_total, n)
};

}  // namespace mok::sm90
