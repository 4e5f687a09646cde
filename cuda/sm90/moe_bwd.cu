// Launch of the backward on one GPU, all on XLA's stream with no host synchronisation:
//
//   gu, h = SwiGLU(xs @ [w_gate | w_up]) (recompute only)  LaunchGateUp, as the forward
//   dy_r = w * dy (gathered), dweights = <dy, y_routed>    ScaleGatherKernel
//   dgu, h = SwiGLU'(dy_r @ w_down^T)                      BwdDown
//   dx_r = dgu @ [w_gate | w_up]^T  (f32)                  BwdGateUp
//   dw_down = h^T @ dy_r, [dw_gate | dw_up] = xs^T @ dgu   BwdWeights, one CTA per output tile
//   dx = sum_j dx_r[pos] + shared dx                       CombineKernel
//
// Every reduction has a single owner and a fixed order: the same bits on every run.
#include "../launch.h"
#include "combine.cuh"
#include "expert_mlp.cuh"
#include "gather.cuh"
#include "gemm_launch.cuh"

namespace mok::cuda {

using sm90::CeilDiv;
using sm90::Check;
using sm90::GemmParams;
using sm90::Matrix;

namespace {

// The expert MLPs' backward over the row groups of `offsets` (null: one group of m rows).
// x_rows, gu and dy_r are the MLP's input rows, saved pre-activations and output gradients.
struct MlpGrads {
  const void *x_rows, *gu, *dy_r;
  const void *w_gate, *w_up, *w_down;
  const int32_t* offsets;
  int block_m;
  int groups;
  int64_t m, H, I;
  void *dgu, *h;      // scratch
  float* dx_rows;     // (m, H)
  void *dw_gate, *dw_up, *dw_down;
};

const char* LaunchMlpBackward(const MlpGrads& g, cudaStream_t stream) {
  const int H = static_cast<int>(g.H), I = static_cast<int>(g.I);
  GemmParams p{};
  p.offsets = g.offsets, p.block_m = g.block_m, p.groups = g.groups, p.m_total = g.m;
  // dh = dy_r @ w_down^T; B(n, k) = w_down[group * I + n, k].
  p.n = I, p.k = H, p.k_split = H, p.n_split = I;
  p.aux = static_cast<const __nv_bfloat16*>(g.gu), p.out0 = g.dgu, p.out1 = g.h;
  if (auto err = sm90::LaunchGemm<sm90::BwdDown>(p, {g.dy_r, H, g.m},
                                                  {g.w_down, H, g.groups * g.I}, {}, stream))
    return err;
  // dx_r = [dg | du] @ [w_gate | w_up]^T; B(n, k) = w_gate[group * H + n, k] (k < I), then w_up.
  p.n = H, p.k = 2 * I, p.k_split = I, p.n_split = H;
  p.aux = nullptr, p.out0 = g.dx_rows, p.out1 = nullptr;
  if (auto err = sm90::LaunchGemm<sm90::BwdGateUp>(p, {g.dgu, 2 * g.I, g.m},
                                                    {g.w_gate, I, g.groups * g.H},
                                                    {g.w_up, I, g.groups * g.H}, stream))
    return err;
  // dw_down_g = h_g^T @ dy_r_g: (I, H) per group.
  p.m = I, p.n = H, p.n_split = H, p.group_stride = g.I * g.H;
  p.out0 = g.dw_down, p.out1 = g.dw_down;
  if (auto err = sm90::LaunchGemm<sm90::BwdWeights>(p, {g.h, I, g.m}, {g.dy_r, H, g.m}, {},
                                                     stream))
    return err;
  // [dw_gate_g | dw_up_g] = x_rows_g^T @ [dg_g | du_g]: (H, 2I) per group, split at I.
  p.m = H, p.n = 2 * I, p.n_split = I, p.group_stride = g.H * g.I;
  p.out0 = g.dw_gate, p.out1 = g.dw_up;
  return sm90::LaunchGemm<sm90::BwdWeights>(p, {g.x_rows, H, g.m}, {g.dgu, 2 * g.I, g.m}, {},
                                            stream);
}

}  // namespace

const char* LaunchMoeBwd(const MoeBwdArgs& a, cudaStream_t stream) {
  if (a.H % 64 || a.I % 64 || a.Is % 64) return "H, I and Is must be multiples of 64";
  if (a.T * a.k >= (int64_t{1} << 31) || a.R >= (int64_t{1} << 31))
    return "T * k and the routed rows must stay below 2^31";
  if (a.dy_f32 && a.Is > 0) return "a shared expert needs dy of x's dtype (bf16)";
  using bf16 = __nv_bfloat16;
  const int E = static_cast<int>(a.E), k = static_cast<int>(a.k), H = static_cast<int>(a.H);
  const int32_t* rows_in_use = a.offsets + E;
  const unsigned row_ctas = static_cast<unsigned>(CeilDiv(a.R, 8));

  if (auto err = Check(cudaMemsetAsync(a.dweights, 0, a.T * a.k * sizeof(float), stream)))
    return err;
  sm90::GatherKernel<<<row_ctas, 256, 0, stream>>>(static_cast<const uint4*>(a.x), a.rows,
                                                   rows_in_use, k, H / 8,
                                                   static_cast<uint4*>(a.xs));
  // Recompute: the forward's gate|up launches on the same rows (xs gathered as the forward
  // gathers it, x for the shared expert), hence the bits it would have saved. h is written too
  // and rewritten by BwdDown below.
  const void* gu = a.recompute ? a.gu_scratch : a.gu;
  const void* gu_shared = a.recompute ? a.gu_shared_scratch : a.gu_shared;
  if (a.recompute) {
    const sm90::ExpertMlp routed{a.xs, a.w_gate, a.w_up, a.w_down, a.offsets, a.block_m, E,
                                 a.R,  a.H,      a.I,    a.gu_scratch, a.h, nullptr, -1};
    if (auto err = sm90::LaunchGateUp(routed, stream)) return err;
    if (a.Is > 0) {
      const sm90::ExpertMlp shared{a.x,   a.ws_gate, a.ws_up, a.ws_down, nullptr,
                                   128,   1,         a.T,     a.H,       a.Is,
                                   a.gu_shared_scratch, a.h_shared, nullptr, -1};
      if (auto err = sm90::LaunchGateUp(shared, stream)) return err;
    }
  }
  const auto* y_routed = static_cast<const bf16*>(a.y_routed);
  auto* dy_r = static_cast<bf16*>(a.dy_routed);
  if (a.dy_f32) {
    sm90::ScaleGatherKernel<float><<<row_ctas, 256, 0, stream>>>(
        static_cast<const float*>(a.dy), y_routed, a.rows, rows_in_use, a.weights, k, H, dy_r,
        a.dweights);
  } else {
    sm90::ScaleGatherKernel<bf16><<<row_ctas, 256, 0, stream>>>(
        static_cast<const bf16*>(a.dy), y_routed, a.rows, rows_in_use, a.weights, k, H, dy_r,
        a.dweights);
  }
  MlpGrads routed{a.xs,      gu,      a.dy_routed, a.w_gate, a.w_up, a.w_down,
                  a.offsets, a.block_m, E,         a.R,      a.H,    a.I,
                  a.dgu,     a.h,     a.dx_routed, a.dw_gate, a.dw_up, a.dw_down};
  if (auto err = LaunchMlpBackward(routed, stream)) return err;
  if (a.Is > 0) {
    MlpGrads shared{a.x,          gu_shared,   a.dy,        a.ws_gate,  a.ws_up, a.ws_down,
                    nullptr,      128,         1,           a.T,        a.H,     a.Is,
                    a.dgu_shared, a.h_shared,  a.dx_shared, a.dws_gate, a.dws_up, a.dws_down};
    if (auto err = LaunchMlpBackward(shared, stream)) return err;
  }
  sm90::CombineKernel<float, bf16><<<static_cast<unsigned>(CeilDiv(a.T, 8)), 256, 0, stream>>>(
      a.dx_routed, a.Is > 0 ? a.dx_shared : nullptr, a.pos, nullptr, a.T, k, H,
      static_cast<bf16*>(a.dx));
  return Check(cudaGetLastError());
}

}  // namespace mok::cuda
