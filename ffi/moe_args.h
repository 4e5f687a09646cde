// Decoding and checking of the arguments that the mok_moe_fwd / mok_moe_bwd handlers of every
// platform share. The Python side (mok_jax/ops.py) checks the same things at trace time; these
// checks are what a direct caller of the target meets, as ffi::Error, never a crash.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace mok {

namespace ffi = xla::ffi;

// Sizes of one call. R = routed rows (mok_jax.ops.routed_rows). recompute (Config.recompute):
// the forward keeps (and writes) no gu and gu_shared; the backward recomputes them into its
// own scratch. ranks: the expert-parallel ranks among which the tokens' routes are spread (1:
// none), about T k / ranks of them to this call's experts; a hint for the CUDA launch choices,
// which leave the results as they are.
struct MoeDims {
  int64_t T, H, I, E, k, Is, R, block_m;
  bool recompute;
  int64_t ranks;
};

// The forward's inputs, in target argument order.
struct MoeInputs {
  ffi::AnyBuffer x;        // (T, H) bf16|f32
  ffi::AnyBuffer experts;  // (T, k) s32, local ids; outside [0, E): no contribution
  ffi::AnyBuffer weights;  // (T, k) f32
  ffi::AnyBuffer w_gate;   // (E, H, I) like x
  ffi::AnyBuffer w_up;     // (E, H, I) like x
  ffi::AnyBuffer w_down;   // (E, I, H) like x
  ffi::AnyBuffer ws_gate;  // (H, Is) like x; Is = 0: no shared expert
  ffi::AnyBuffer ws_up;    // (H, Is)
  ffi::AnyBuffer ws_down;  // (Is, H)
};

// What the forward saves for the backward (mok_jax.ops.Residuals). With recompute, gu,
// gu_shared and xs have zero rows.
struct MoeResiduals {
  ffi::AnyBuffer pos;        // (T, k) s32: routed row of route (t, j), -1 if invalid
  ffi::AnyBuffer offsets;    // (E + 1) s32: first routed row of expert e, multiple of block_m
  ffi::AnyBuffer rows;       // (R) s32: route t*k + j of each routed row, -1 for padding
  ffi::AnyBuffer gu;         // (R, 2I) like x: [x @ w_gate | x @ w_up] before the activation
  ffi::AnyBuffer gu_shared;  // (T, 2Is) like x
  ffi::AnyBuffer xs;         // (R, H) like x: token row of each routed row, 0 padding
};

struct MoeFwdResults {
  ffi::AnyBuffer y;  // (T, H) like x, or f32 (a partial sum reduced further)
  MoeResiduals res;
  ffi::AnyBuffer y_routed;  // scratch (R, H) like x: each route's unweighted expert output
  // scratch (R, H) like x with recompute, whose residual xs has no rows; (0, H) else.
  ffi::AnyBuffer xs_scratch;
  ffi::AnyBuffer h;         // scratch (R, I) like x: silu(g) * u
  ffi::AnyBuffer h_shared;  // scratch (T, Is) like x
  ffi::AnyBuffer y_shared;  // scratch (T, H) like x, (0, H) when Is = 0: shared output
  ffi::AnyBuffer layout;    // scratch (LayoutScratchInts(T, k, E)) s32
  // No gu scratch: with recompute the forward does not keep gu, so it writes none.
};

struct MoeBwdResults {
  ffi::AnyBuffer dx;          // (T, H) like x
  ffi::AnyBuffer dweights;    // (T, k) f32
  ffi::AnyBuffer dw_gate;     // (E, H, I)
  ffi::AnyBuffer dw_up;       // (E, H, I)
  ffi::AnyBuffer dw_down;     // (E, I, H)
  ffi::AnyBuffer dws_gate;    // (H, Is)
  ffi::AnyBuffer dws_up;      // (H, Is)
  ffi::AnyBuffer dws_down;    // (Is, H)
  // scratch (R, H) like x: xs, the token row of each routed row (without recompute over the
  // residual xs, mok_jax.ops.bwd_aliases), then dx_routed once the weight gradients have read
  // xs; and dy_routed, dy[t] of each route's row.
  ffi::AnyBuffer xs_rows;
  ffi::AnyBuffer dy_routed;
  // [dg | du] over [g | u]: without recompute these alias the residuals gu and gu_shared
  // (mok_jax.ops.bwd_aliases); with recompute gu and gu_shared are recomputed into them first.
  ffi::AnyBuffer dgu;         // scratch (R, 2I) like x
  ffi::AnyBuffer dgu_shared;  // scratch (T, 2Is) like x
  ffi::AnyBuffer h;           // scratch (R, I) like x: silu(g) * u from gu
  ffi::AnyBuffer h_shared;    // scratch (T, Is) like x
  ffi::AnyBuffer dx_shared;   // scratch (T, H) like x, (0, H) when Is = 0
  // scratch (R, ceil(I / 128)) f32: each routed row's <dy @ w_down^T, h> by 128 columns of h,
  // summed into dweights in column order.
  ffi::AnyBuffer dw_parts;
  ffi::AnyBuffer queue;       // scratch (TileQueueInts(T, k, E)) s32: tile queues of the
                              // backward's GEMM launches
};

// mok_jax.ops.routed_rows: every route plus the block_m alignment padding of each expert.
int64_t RoutedRows(int64_t routes, int64_t experts, int64_t block_m);

// The platform whose handler a call reached. Both take the same buffers; the CUDA kernels add
// bf16 tokens and block_m = 64 or 128 to what the CPU reference takes.
enum class Platform { kCpu, kCuda };

// Checks every buffer and attribute of a mok_moe_fwd call, in the order the handlers of both
// platforms share, and returns the sizes of the call: the inputs, the platform's kernel
// contract, then the results (gu, gu_shared and xs with the rows that recompute implies, zero
// with recompute).
ffi::ErrorOr<MoeDims> CheckFwdCall(Platform platform, const MoeInputs& in,
                                   const MoeFwdResults& out, int64_t block_m, bool recompute,
                                   int64_t ranks);
// The same for mok_moe_bwd: dy is (T, H) of x's dtype or f32, the residuals as the forward
// writes them.
ffi::ErrorOr<MoeDims> CheckBwdCall(Platform platform, ffi::AnyBuffer dy, const MoeInputs& in,
                                   const MoeResiduals& res, const MoeBwdResults& out,
                                   int64_t block_m, bool recompute, int64_t ranks);

// The sizes of a call into a launcher's arguments (cuda/launch.h): MoeFwdArgs, MoeBwdArgs and
// MoeFwdFp8Args start with the same fields.
template <class LaunchArgs>
void SetLaunchDims(const MoeDims& d, LaunchArgs& a) {
  a.T = d.T, a.H = d.H, a.I = d.I, a.E = d.E, a.k = d.k, a.Is = d.Is, a.R = d.R;
  a.block_m = static_cast<int>(d.block_m), a.ranks = d.ranks;
}

// A buffer of the given dtype and shape, or an error naming it: "<target>: pos must be
// s32[4, 2], got s32[4, 3]".
ffi::Error CheckBuffer(const char* target, const char* name, ffi::AnyBuffer b,
                       ffi::DataType dtype, std::initializer_list<int64_t> shape);

std::string DescribeBuffer(ffi::DataType dtype, ffi::AnyBuffer::Dimensions dims);

// The forward's inputs (MoeInputs) in order: the operands of mok_moe_fwd, which mok_moe_bwd
// takes again after dy. The parts of a binding take it by reference: xla::ffi::Binding moves
// only into the binding that its own Arg, Ret and Attr return.
template <class Binding>
auto BindMoeInputs(Binding&& binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x (T, H) bf16|f32
      .template Arg<ffi::AnyBuffer>()            // experts (T, k) s32
      .template Arg<ffi::AnyBuffer>()            // weights (T, k) f32
      .template Arg<ffi::AnyBuffer>()            // w_gate (E, H, I)
      .template Arg<ffi::AnyBuffer>()            // w_up (E, H, I)
      .template Arg<ffi::AnyBuffer>()            // w_down (E, I, H)
      .template Arg<ffi::AnyBuffer>()            // ws_gate (H, Is)
      .template Arg<ffi::AnyBuffer>()            // ws_up (H, Is)
      .template Arg<ffi::AnyBuffer>();           // ws_down (Is, H)
}

// The attributes of mok_moe_fwd and mok_moe_bwd (MoeDims), after their buffers.
template <class Binding>
auto BindMoeAttrs(Binding&& binding) {
  return std::move(binding).template Attr<int64_t>("block_m")
      .template Attr<bool>("recompute")
      .template Attr<int64_t>("ranks");
}

// The argument list of mok_moe_fwd, shared by every platform's handler: the CPU handler binds
// BindMoeFwd(Ffi::Bind()), the CUDA one puts its stream first.
template <class Binding>
auto BindMoeFwd(Binding binding) {
  auto buffers = BindMoeInputs(std::move(binding))
      .template Ret<ffi::AnyBuffer>()            // y (T, H) like x or f32
      .template Ret<ffi::AnyBuffer>()            // pos (T, k) s32
      .template Ret<ffi::AnyBuffer>()            // offsets (E + 1) s32
      .template Ret<ffi::AnyBuffer>()            // rows (R) s32
      .template Ret<ffi::AnyBuffer>()            // gu (R, 2I); (0, 2I) with recompute
      .template Ret<ffi::AnyBuffer>()            // gu_shared (T, 2Is); (0, 2Is) with recompute
      .template Ret<ffi::AnyBuffer>()            // xs (R, H); (0, H) with recompute
      .template Ret<ffi::AnyBuffer>()            // scratch y_routed (R, H)
      .template Ret<ffi::AnyBuffer>()            // scratch xs_scratch (R or 0, H)
      .template Ret<ffi::AnyBuffer>()            // scratch h (R, I)
      .template Ret<ffi::AnyBuffer>()            // scratch h_shared (T, Is)
      .template Ret<ffi::AnyBuffer>()            // scratch y_shared (T or 0, H)
      .template Ret<ffi::AnyBuffer>();           // scratch layout s32
  return BindMoeAttrs(std::move(buffers));
}

// The argument list of mok_moe_bwd, shared like BindMoeFwd.
template <class Binding>
auto BindMoeBwd(Binding binding) {
  auto dy = std::move(binding).template Arg<ffi::AnyBuffer>();  // dy (T, H) like x or f32
  auto buffers = BindMoeInputs(std::move(dy))
      .template Arg<ffi::AnyBuffer>()            // pos (T, k) s32
      .template Arg<ffi::AnyBuffer>()            // offsets (E + 1) s32
      .template Arg<ffi::AnyBuffer>()            // rows (R) s32
      .template Arg<ffi::AnyBuffer>()            // gu (R, 2I); (0, 2I) with recompute
      .template Arg<ffi::AnyBuffer>()            // gu_shared (T, 2Is); (0, 2Is) with recompute
      .template Arg<ffi::AnyBuffer>()            // xs (R, H); (0, H) with recompute
      .template Ret<ffi::AnyBuffer>()            // dx (T, H)
      .template Ret<ffi::AnyBuffer>()            // dweights (T, k) f32
      .template Ret<ffi::AnyBuffer>()            // dw_gate (E, H, I)
      .template Ret<ffi::AnyBuffer>()            // dw_up (E, H, I)
      .template Ret<ffi::AnyBuffer>()            // dw_down (E, I, H)
      .template Ret<ffi::AnyBuffer>()            // dws_gate (H, Is)
      .template Ret<ffi::AnyBuffer>()            // dws_up (H, Is)
      .template Ret<ffi::AnyBuffer>()            // dws_down (Is, H)
      .template Ret<ffi::AnyBuffer>()            // scratch xs_rows (R, H) over xs, then dx_routed
      .template Ret<ffi::AnyBuffer>()            // scratch dy_routed (R, H)
      .template Ret<ffi::AnyBuffer>()            // scratch dgu (R, 2I), over gu
      .template Ret<ffi::AnyBuffer>()            // scratch dgu_shared (T, 2Is), over gu_shared
      .template Ret<ffi::AnyBuffer>()            // scratch h (R, I)
      .template Ret<ffi::AnyBuffer>()            // scratch h_shared (T, Is)
      .template Ret<ffi::AnyBuffer>()            // scratch dx_shared (T or 0, H) like x
      .template Ret<ffi::AnyBuffer>()            // scratch dw_parts f32 (R, ceil(I / 128))
      .template Ret<ffi::AnyBuffer>();           // scratch queue s32 (TileQueueInts(T, k, E))
  return BindMoeAttrs(std::move(buffers));
}

// mok_moe_combine: out[t] = round(sum_j weights[t, j] rows[pos[t, j]] in j order + extra[t]),
// the combine of mok_moe_fwd (y) and of mok_moe_bwd (dx, without weights) on its own, for the
// home rank under expert parallelism. rows (N, H) bf16|f32; pos (T, k) s32 in [-1, N);
// weights (T, k) f32, or (0, k): every weight 1; extra (T, H) like rows, or (0, H): none; out
// (T, H) like rows or f32.
struct CombineDims {
  int64_t N, T, k, H;
  bool weighted, extra;
};
ffi::ErrorOr<CombineDims> CheckCombineArgs(const char* target, ffi::AnyBuffer rows,
                                           ffi::AnyBuffer pos, ffi::AnyBuffer weights,
                                           ffi::AnyBuffer extra, ffi::AnyBuffer out);

template <class Binding>
auto BindMoeCombine(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // rows (N, H) bf16|f32
      .template Arg<ffi::AnyBuffer>()            // pos (T, k) s32
      .template Arg<ffi::AnyBuffer>()            // weights (T, k) f32, or (0, k)
      .template Arg<ffi::AnyBuffer>()            // extra (T, H), or (0, H)
      .template Ret<ffi::AnyBuffer>();           // out (T, H) like rows or f32
}

// mok_moe_fwd_fp8: the forward with block-scaled e4m3 products (Config(precision="fp8"),
// mok_jax/quantize.py), bf16 tokens, H, I and Is multiples of 128. The expert weights come as
// their e4m3 blocks transposed (K-major, as the FP8 GEMMs read them) beside the 128 x 128 block
// scales of the weights as they are; activation scales are (blocks, Fp8ScalePitch(rows)) f32,
// block b of row r at [b, r].
struct MoeFp8Inputs {
  ffi::AnyBuffer x;              // (T, H) bf16
  ffi::AnyBuffer experts;        // (T, k) s32, local ids
  ffi::AnyBuffer weights;        // (T, k) f32
  ffi::AnyBuffer w_gate;         // (E, I, H) f8e4m3fn: w_gate's values transposed
  ffi::AnyBuffer w_gate_scale;   // (E, H / 128, I / 128) f32
  ffi::AnyBuffer w_up;           // (E, I, H)
  ffi::AnyBuffer w_up_scale;     // (E, H / 128, I / 128)
  ffi::AnyBuffer w_down;         // (E, H, I)
  ffi::AnyBuffer w_down_scale;   // (E, I / 128, H / 128)
  ffi::AnyBuffer ws_gate;        // (Is, H); Is = 0: no shared expert
  ffi::AnyBuffer ws_gate_scale;  // (H / 128, Is / 128)
  ffi::AnyBuffer ws_up;          // (Is, H)
  ffi::AnyBuffer ws_up_scale;    // (H / 128, Is / 128)
  ffi::AnyBuffer ws_down;        // (H, Is)
  ffi::AnyBuffer ws_down_scale;  // (Is / 128, H / 128)
};

struct MoeFwdFp8Results {
  ffi::AnyBuffer y;                // (T, H) bf16 or f32
  ffi::AnyBuffer pos;              // (T, k) s32, as mok_moe_fwd's
  ffi::AnyBuffer offsets;          // (E + 1) s32
  ffi::AnyBuffer rows;             // (R) s32
  // [g | u] bf16 for mok_moe_bwd_fp8: (R, 2I) and (T, 2Is) when kept, (0, 2I) and (0, 2Is)
  // when not (the forward's other buffers are scratch that the layer does not keep).
  ffi::AnyBuffer gu;
  ffi::AnyBuffer gu_shared;
  ffi::AnyBuffer xq;               // (R, H) f8e4m3fn: each routed row's token row, 0 padding
  ffi::AnyBuffer xq_scale;         // (H / 128, Fp8ScalePitch(R)) f32, 1 for padding rows
  ffi::AnyBuffer hq;               // (R, I) f8e4m3fn: silu(g) * u
  ffi::AnyBuffer hq_scale;         // (I / 128, Fp8ScalePitch(R)) f32
  ffi::AnyBuffer y_routed;         // (R, H) bf16: each route's unweighted expert output
  ffi::AnyBuffer xq_shared;        // (T or 0, H) f8e4m3fn: every token's row (Is > 0)
  ffi::AnyBuffer xq_shared_scale;  // (H / 128, Fp8ScalePitch(T or 0)) f32
  ffi::AnyBuffer hq_shared;        // (T, Is) f8e4m3fn
  ffi::AnyBuffer hq_shared_scale;  // (Is / 128, Fp8ScalePitch(T)) f32
  ffi::AnyBuffer y_shared;         // (T or 0, H) bf16: the shared expert's output
  ffi::AnyBuffer layout;           // (LayoutScratchInts(T, k, E)) s32
};

// Checks the inputs and results of mok_moe_fwd_fp8, then the platform's kernel contract, and
// returns the sizes of the call (recompute true where gu has no rows: not kept).
ffi::ErrorOr<MoeDims> CheckFp8Call(Platform platform, const MoeFp8Inputs& in,
                                   const MoeFwdFp8Results& out, int64_t block_m, int64_t ranks);

template <class Binding>
auto BindMoeFwdFp8(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x (T, H) bf16
      .template Arg<ffi::AnyBuffer>()            // experts (T, k) s32
      .template Arg<ffi::AnyBuffer>()            // weights (T, k) f32
      .template Arg<ffi::AnyBuffer>()            // w_gate (E, I, H) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // w_gate_scale (E, H / 128, I / 128) f32
      .template Arg<ffi::AnyBuffer>()            // w_up (E, I, H) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // w_up_scale (E, H / 128, I / 128) f32
      .template Arg<ffi::AnyBuffer>()            // w_down (E, H, I) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // w_down_scale (E, I / 128, H / 128) f32
      .template Arg<ffi::AnyBuffer>()            // ws_gate (Is, H) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // ws_gate_scale (H / 128, Is / 128) f32
      .template Arg<ffi::AnyBuffer>()            // ws_up (Is, H) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // ws_up_scale (H / 128, Is / 128) f32
      .template Arg<ffi::AnyBuffer>()            // ws_down (H, Is) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // ws_down_scale (Is / 128, H / 128) f32
      .template Ret<ffi::AnyBuffer>()            // y (T, H) bf16 or f32
      .template Ret<ffi::AnyBuffer>()            // pos (T, k) s32
      .template Ret<ffi::AnyBuffer>()            // offsets (E + 1) s32
      .template Ret<ffi::AnyBuffer>()            // rows (R) s32
      .template Ret<ffi::AnyBuffer>()            // gu (R or 0, 2I) bf16
      .template Ret<ffi::AnyBuffer>()            // gu_shared (T or 0, 2Is) bf16
      .template Ret<ffi::AnyBuffer>()            // xq (R, H) f8e4m3fn
      .template Ret<ffi::AnyBuffer>()            // xq_scale (H / 128, pitch) f32
      .template Ret<ffi::AnyBuffer>()            // hq (R, I) f8e4m3fn
      .template Ret<ffi::AnyBuffer>()            // hq_scale (I / 128, pitch) f32
      .template Ret<ffi::AnyBuffer>()            // y_routed (R, H) bf16
      .template Ret<ffi::AnyBuffer>()            // xq_shared (T or 0, H) f8e4m3fn
      .template Ret<ffi::AnyBuffer>()            // xq_shared_scale (H / 128, pitch) f32
      .template Ret<ffi::AnyBuffer>()            // hq_shared (T, Is) f8e4m3fn
      .template Ret<ffi::AnyBuffer>()            // hq_shared_scale (Is / 128, pitch) f32
      .template Ret<ffi::AnyBuffer>()            // y_shared (T or 0, H) bf16
      .template Ret<ffi::AnyBuffer>()            // layout s32
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("ranks");
}

// mok_moe_bwd_fp8: mok_moe_bwd's gradients of mok_moe_fwd_fp8, the data gradients' GEMMs in
// block-scaled e4m3 (dy and [dg | du] in 1 x 128 blocks along H and 2I), the weight gradients
// bf16 GEMMs. Its weights are MoeFp8Inputs' buffers with the e4m3 blocks as they are, (E, H, I),
// (E, H, I), (E, I, H) and (H, Is), (H, Is), (Is, H): the data gradients multiply by W^T, whose
// K-major form W is. The residuals are the forward's layout and gu (kept); its results are
// mok_moe_bwd's (xs_rows: x gathered, then dx_r) and the e4m3 rows of dy and dgu.
struct MoeFp8Residuals {
  ffi::AnyBuffer pos;        // (T, k) s32
  ffi::AnyBuffer offsets;    // (E + 1) s32
  ffi::AnyBuffer rows;       // (R) s32
  ffi::AnyBuffer gu;         // (R, 2I) bf16
  ffi::AnyBuffer gu_shared;  // (T, 2Is) bf16
};

struct MoeBwdFp8Scratch {
  ffi::AnyBuffer dyq;                // (R, H) f8e4m3fn
  ffi::AnyBuffer dyq_scale;          // (H / 128, Fp8ScalePitch(R)) f32
  ffi::AnyBuffer dyq_shared;         // (T or 0, H) f8e4m3fn
  ffi::AnyBuffer dyq_shared_scale;   // (H / 128, Fp8ScalePitch(T or 0)) f32
  ffi::AnyBuffer dguq;               // (R, 2I) f8e4m3fn
  ffi::AnyBuffer dguq_scale;         // (2I / 128, Fp8ScalePitch(R)) f32
  ffi::AnyBuffer dguq_shared;        // (T, 2Is) f8e4m3fn
  ffi::AnyBuffer dguq_shared_scale;  // (2Is / 128, Fp8ScalePitch(T)) f32
};

ffi::ErrorOr<MoeDims> CheckBwdFp8Call(Platform platform, ffi::AnyBuffer dy,
                                      const MoeFp8Inputs& in, const MoeFp8Residuals& res,
                                      const MoeBwdResults& out, const MoeBwdFp8Scratch& q,
                                      int64_t block_m, int64_t ranks);

template <class Binding>
auto BindMoeBwdFp8(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // dy (T, H) bf16
      .template Arg<ffi::AnyBuffer>()            // x (T, H) bf16
      .template Arg<ffi::AnyBuffer>()            // experts (T, k) s32
      .template Arg<ffi::AnyBuffer>()            // weights (T, k) f32
      .template Arg<ffi::AnyBuffer>()            // w_gate (E, H, I) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // w_gate_scale (E, H / 128, I / 128) f32
      .template Arg<ffi::AnyBuffer>()            // w_up (E, H, I) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // w_up_scale (E, H / 128, I / 128) f32
      .template Arg<ffi::AnyBuffer>()            // w_down (E, I, H) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // w_down_scale (E, I / 128, H / 128) f32
      .template Arg<ffi::AnyBuffer>()            // ws_gate (H, Is) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // ws_gate_scale (H / 128, Is / 128) f32
      .template Arg<ffi::AnyBuffer>()            // ws_up (H, Is) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // ws_up_scale (H / 128, Is / 128) f32
      .template Arg<ffi::AnyBuffer>()            // ws_down (Is, H) f8e4m3fn
      .template Arg<ffi::AnyBuffer>()            // ws_down_scale (Is / 128, H / 128) f32
      .template Arg<ffi::AnyBuffer>()            // pos (T, k) s32
      .template Arg<ffi::AnyBuffer>()            // offsets (E + 1) s32
      .template Arg<ffi::AnyBuffer>()            // rows (R) s32
      .template Arg<ffi::AnyBuffer>()            // gu (R, 2I) bf16
      .template Arg<ffi::AnyBuffer>()            // gu_shared (T, 2Is) bf16
      .template Ret<ffi::AnyBuffer>()            // dx (T, H) bf16
      .template Ret<ffi::AnyBuffer>()            // dweights (T, k) f32
      .template Ret<ffi::AnyBuffer>()            // dw_gate (E, H, I) bf16
      .template Ret<ffi::AnyBuffer>()            // dw_up (E, H, I)
      .template Ret<ffi::AnyBuffer>()            // dw_down (E, I, H)
      .template Ret<ffi::AnyBuffer>()            // dws_gate (H, Is)
      .template Ret<ffi::AnyBuffer>()            // dws_up (H, Is)
      .template Ret<ffi::AnyBuffer>()            // dws_down (Is, H)
      .template Ret<ffi::AnyBuffer>()            // scratch xs_rows (R, H): xs, then dx_routed
      .template Ret<ffi::AnyBuffer>()            // scratch dy_routed (R, H)
      .template Ret<ffi::AnyBuffer>()            // scratch dgu (R, 2I), over gu
      .template Ret<ffi::AnyBuffer>()            // scratch dgu_shared (T, 2Is), over gu_shared
      .template Ret<ffi::AnyBuffer>()            // scratch h (R, I)
      .template Ret<ffi::AnyBuffer>()            // scratch h_shared (T, Is)
      .template Ret<ffi::AnyBuffer>()            // scratch dx_shared (T or 0, H)
      .template Ret<ffi::AnyBuffer>()            // scratch dw_parts f32 (R, ceil(I / 128))
      .template Ret<ffi::AnyBuffer>()            // scratch queue s32 (TileQueueInts(T, k, E))
      .template Ret<ffi::AnyBuffer>()            // scratch dyq (R, H) f8e4m3fn
      .template Ret<ffi::AnyBuffer>()            // scratch dyq_scale (H / 128, pitch) f32
      .template Ret<ffi::AnyBuffer>()            // scratch dyq_shared (T or 0, H) f8e4m3fn
      .template Ret<ffi::AnyBuffer>()            // scratch dyq_shared_scale f32
      .template Ret<ffi::AnyBuffer>()            // scratch dguq (R, 2I) f8e4m3fn
      .template Ret<ffi::AnyBuffer>()            // scratch dguq_scale (2I / 128, pitch) f32
      .template Ret<ffi::AnyBuffer>()            // scratch dguq_shared (T, 2Is) f8e4m3fn
      .template Ret<ffi::AnyBuffer>()            // scratch dguq_shared_scale f32
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("ranks");
}

// mok_quantize_weight: an expert weight (..., K, N) in 128 x 128 blocks by the "fp8" recipe
// (mok_jax/quantize.py, quantize_experts), the leading dimensions a batch of matrices (experts,
// and layers under vmap). Blocks at the edges hold what the shape leaves of them.
struct QuantizeDims {
  int64_t batch, K, N;  // batch: the product of the leading dimensions
  int64_t k_blocks, n_blocks;
};

ffi::ErrorOr<QuantizeDims> CheckQuantizeArgs(const char* target, ffi::AnyBuffer w,
                                             ffi::AnyBuffer data, ffi::AnyBuffer k_major,
                                             ffi::AnyBuffer scale);

template <class Binding>
auto BindQuantizeWeight(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // w (..., K, N) bf16|f32
      .template Ret<ffi::AnyBuffer>()            // data (..., K, N) f8e4m3fn
      .template Ret<ffi::AnyBuffer>()            // k_major (..., N, K) f8e4m3fn: data transposed
      .template Ret<ffi::AnyBuffer>();           // scale (..., K / 128, N / 128) f32, rounded up
}

}  // namespace mok
