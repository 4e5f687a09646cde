// Launchers of the CUDA kernels, callable from the FFI handlers. Plain C++: neither XLA's nor
// CuTe's headers are visible here (docs/design.md: they never meet in one translation unit).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mok::cuda {

// One forward call over the experts of this GPU. Shapes as in mok_jax/ops.py; bf16 buffers are
// passed as void*. R = routed rows; all pointers are device memory owned by XLA.
struct MoeFwdArgs {
  int64_t T, H, I, E, k, Is, R;
  int block_m;            // 64 or 128: each expert's routed rows start at a multiple of it
  int64_t ranks;          // expert parallelism: about T k / ranks of the routes are this GPU's
                          // (ExpectedRoutedRows); the launch choices expect that many
  const void* x;          // (T, H) bf16
  const int32_t* experts; // (T, k) local ids; outside [0, E): no contribution
  const float* weights;   // (T, k)
  const void* w_gate;     // (E, H, I) bf16
  const void* w_up;       // (E, H, I)
  const void* w_down;     // (E, I, H)
  const void* ws_gate;    // (H, Is), Is = 0: no shared expert
  const void* ws_up;      // (H, Is)
  const void* ws_down;    // (Is, H)
  void* y;                // (T, H) bf16, or f32 when y_f32
  bool y_f32;
  int32_t* pos;           // (T, k)
  int32_t* offsets;       // (E + 1)
  int32_t* rows;          // (R)
  void* gu;               // (R, 2I) bf16 residual; null with Config.recompute (not written)
  void* y_routed;         // scratch (R, H) bf16: each route's unweighted output
  void* gu_shared;        // (T, 2Is) bf16, like gu (null with recompute)
  void* xs;               // (R, H) bf16: gathered token rows, zero padding rows (a residual
                          // without recompute, else scratch)
  void* h;                // scratch (R, I) bf16: silu(g) * u
  void* h_shared;         // scratch (T, Is) bf16
  void* y_shared;         // scratch (T, H) bf16 (empty when Is = 0)
  int32_t* layout;        // scratch (LayoutScratchInts(T, k, E)): per-chunk expert counts,
                          // then the tile queue of the expert MLPs
};

// One backward call: every gradient from dy and the forward's residuals.
struct MoeBwdArgs {
  int64_t T, H, I, E, k, Is, R;
  int block_m;            // the forward's
  int64_t ranks;          // as in MoeFwdArgs
  const void* dy;         // (T, H) bf16, or f32 when dy_f32 (then Is must be 0)
  bool dy_f32;
  const void* x;          // the forward's inputs, as in MoeFwdArgs
  const float* weights;
  const void* w_gate;
  const void* w_up;
  const void* w_down;
  const void* ws_gate;
  const void* ws_up;
  const void* ws_down;
  const int32_t* pos;     // the forward's residuals
  const int32_t* offsets;
  const int32_t* rows;
  const void* gu;         // empty with recompute
  const void* gu_shared;  // empty with recompute
  void* dx;               // (T, H) bf16
  float* dweights;        // (T, k)
  void* dw_gate;          // (E, H, I) bf16
  void* dw_up;            // (E, H, I)
  void* dw_down;          // (E, I, H)
  void* dws_gate;         // (H, Is)
  void* dws_up;           // (H, Is)
  void* dws_down;         // (Is, H)
  // xs_in and dy_routed are live until the weight gradients have read them; dx_routed, written
  // after, may lie over one of them (the FFI handler gives it xs's buffer).
  const void* xs_in;      // (R, H) bf16: the rows the weight gradients read, zero padding rows:
                          // the residual without recompute, else xs once gathered
  void* xs;               // (R, H) bf16 scratch that recompute gathers into
  void* dy_routed;        // scratch (R, H) bf16: dy of each routed row, unweighted
  void* dx_routed;        // scratch (R, H) bf16
  void* dgu;              // scratch (R, 2I) bf16; may be gu (each tile reads its g, u first)
  void* h;                // scratch (R, I) bf16
  void* dgu_shared;       // scratch (T, 2Is) bf16; may be gu_shared
  void* h_shared;         // scratch (T, Is) bf16
  void* dx_shared;        // scratch (T, H) bf16, empty when Is = 0
  float* dw_parts;        // scratch (R, ceil(I / 128)): each routed row's parts of dweights
  bool recompute;         // Config.recompute: gu and gu_shared from x, into dgu and dgu_shared
  int32_t* queue;         // scratch (TileQueueInts(T, k, E)): tile queues of the GEMM launches
};

// One FP8 forward call (Config(precision="fp8"), mok_moe_fwd_fp8): the forward of MoeFwdArgs
// with block-scaled e4m3 products (mok_jax/quantize.py). H, I and Is are multiples of 128;
// e4m3 buffers are passed as void*, their f32 scales as float*. Activations are quantized in
// 1 x 128 blocks along the reduction, their scales (blocks, Fp8ScalePitch(rows)) f32: block b
// of row r at b * pitch + r. The weights come transposed (K-major) with the 128 x 128 block
// scales of the weights as they are.
struct MoeFwdFp8Args {
  int64_t T, H, I, E, k, Is, R;
  int block_m;
  int64_t ranks;
  const void* x;             // (T, H) bf16
  const int32_t* experts;    // (T, k) local ids
  const float* weights;      // (T, k)
  const void* w_gate;        // (E, I, H) e4m3: w_gate^T
  const float* w_gate_scale; // (E, H / 128, I / 128)
  const void* w_up;          // (E, I, H)
  const float* w_up_scale;   // (E, H / 128, I / 128)
  const void* w_down;        // (E, H, I): w_down^T
  const float* w_down_scale; // (E, I / 128, H / 128)
  const void* ws_gate;       // (Is, H); Is = 0: no shared expert
  const float* ws_gate_scale;// (H / 128, Is / 128)
  const void* ws_up;         // (Is, H)
  const float* ws_up_scale;  // (H / 128, Is / 128)
  const void* ws_down;       // (H, Is)
  const float* ws_down_scale;// (Is / 128, H / 128)
  void* y;                   // (T, H) bf16, or f32 when y_f32
  bool y_f32;
  int32_t* pos;              // (T, k)
  int32_t* offsets;          // (E + 1)
  int32_t* rows;             // (R)
  void* xq;                  // (R, H) e4m3: each routed row's token row, zero padding rows
  float* xq_scale;           // (H / 128, Fp8ScalePitch(R))
  void* hq;                  // (R, I) e4m3: silu(g) * u
  float* hq_scale;           // (I / 128, Fp8ScalePitch(R))
  void* y_routed;            // (R, H) bf16: each route's unweighted output
  void* xq_shared;           // (T, H) e4m3 when Is > 0: every token's row
  float* xq_shared_scale;    // (H / 128, Fp8ScalePitch(T))
  void* hq_shared;           // (T, Is) e4m3
  float* hq_shared_scale;    // (Is / 128, Fp8ScalePitch(T))
  void* gu;                  // (R, 2I) bf16 [g | u] kept for the backward, or null
  void* gu_shared;           // (T, 2Is) bf16, or null
  void* y_shared;            // (T, H) bf16 when Is > 0
  int32_t* layout;           // (LayoutScratchInts(T, k, E))
};

// One FP8 backward call (mok_moe_bwd_fp8): MoeBwdArgs' gradients with the data gradients'
// GEMMs block-scaled e4m3 (dh = dy @ w_down^T with dy in 1 x 128 blocks along H, dx_r =
// [dg | du] @ [w_gate | w_up]^T with dgu in 1 x 128 blocks along 2I), the weight gradients
// bf16. bwd's weight pointers are the e4m3 weights as they are, (E, H, I), (E, H, I), (E, I, H)
// (and (H, Is), (H, Is), (Is, H)); bwd.recompute is false (gu is the forward's) and its dy
// bf16. Activation scales as in MoeFwdFp8Args.
struct MoeBwdFp8Args {
  MoeBwdArgs bwd;
  const float* w_gate_scale;      // (E, H / 128, I / 128)
  const float* w_up_scale;        // (E, H / 128, I / 128)
  const float* w_down_scale;      // (E, I / 128, H / 128)
  const float* ws_gate_scale;     // (H / 128, Is / 128)
  const float* ws_up_scale;       // (H / 128, Is / 128)
  const float* ws_down_scale;     // (Is / 128, H / 128)
  void* dyq;                      // scratch (R, H) e4m3: dy of each routed row
  float* dyq_scale;               // (H / 128, Fp8ScalePitch(R))
  void* dyq_shared;               // scratch (T, H) e4m3 when Is > 0
  float* dyq_shared_scale;        // (H / 128, Fp8ScalePitch(T))
  void* dguq;                     // scratch (R, 2I) e4m3: [dg | du] of each routed row
  float* dguq_scale;              // (2I / 128, Fp8ScalePitch(R))
  void* dguq_shared;              // scratch (T, 2Is) e4m3
  float* dguq_shared_scale;       // (2Is / 128, Fp8ScalePitch(T))
};

// Enqueues the whole forward on `stream`; nothing waits on the host. Returns nullptr, or a
// message saying what failed (an unsupported shape, a CUDA error).
const char* LaunchMoeFwd(const MoeFwdArgs& args, cudaStream_t stream);
const char* LaunchMoeBwd(const MoeBwdArgs& args, cudaStream_t stream);
const char* LaunchMoeFwdFp8(const MoeFwdFp8Args& args, cudaStream_t stream);
const char* LaunchMoeBwdFp8(const MoeBwdFp8Args& args, cudaStream_t stream);

// The forward's combine on its own (mok_moe_combine): out[t] = round(sum_j weights[t, j]
// rows[pos[t, j]] in j order + extra[t]), one warp a token (sm90/combine.cuh). rows and extra
// are bf16 (N, H) and (T, H); weights and extra may be null; H a multiple of 8.
struct CombineArgs {
  int64_t T;
  int k, H;
  const void* rows;
  const int32_t* pos;     // (T, k), -1: no row
  const float* weights;   // (T, k), or null: every weight 1
  const void* extra;      // (T, H), or null
  void* out;              // (T, H) bf16, or f32 when out_f32
  bool out_f32;
};
const char* LaunchCombine(const CombineArgs& args, cudaStream_t stream);

// mok_quantize_weight: `batch` matrices (K, N) of bf16 (or f32, w_f32) in 128 x 128 blocks of
// e4m3 (sm90/quantize.cuh): data (batch, K, N), the same values transposed in k_major (batch,
// N, K), and each block's scale in scale (batch, ceil(K / 128), ceil(N / 128)).
struct QuantizeWeightArgs {
  int64_t batch, K, N;
  const void* w;
  bool w_f32;
  void* data;
  void* k_major;
  float* scale;
};
const char* LaunchQuantizeWeight(const QuantizeWeightArgs& args, cudaStream_t stream);

}  // namespace mok::cuda
