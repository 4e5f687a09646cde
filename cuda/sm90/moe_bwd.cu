// Launch of the backward on one GPU, all on XLA's stream with no host synchronisation:
//
//   xs = x[token of each routed row] (recompute only)      GatherKernel, as the forward
//   gu, h = SwiGLU(xs @ [w_gate | w_up]) (recompute only)  LaunchExpertMlps, as the forward
//   dy_r = dy (gathered; f32 dy rounded to bf16)           GatherKernel
//   dh' = dy_r @ w_down^T, parts of <dh', h>;              BwdDown, dgu over gu
//   dgu, w h = SwiGLU'(w dh') (w: the row's route weight)
//   dw_down = (w h)^T @ dy_r, [dw_gate | dw_up] =          BwdWeights, one CTA per
//   xs^T @ dgu                                             weight-gradient tile
//   dx_r = dgu @ [w_gate | w_up]^T  (rounded to bf16)      BwdGateUp, over xs
//   dx = sum_j dx_r[pos] + shared dx; dweights = the       CombineKernel
//   sum of each route's parts
//
// dweights[t, j] = <dy[t], y_routed[pos]> = <dy[t] @ w_down^T, h[pos]>: the backward needs no
// y_routed, which the forward so keeps as scratch, not as a residual (b R H bytes a layer from
// the forward until the backward: README, Memory).
//
// The FP8 backward (LaunchMoeBwdFp8) is the same with its two data-gradient GEMMs in
// block-scaled e4m3: dy is gathered twice (bf16 for the weight gradients, e4m3 for dh'), and
// dgu quantized after BwdDown wrote it.
//
// Every reduction has a single owner and a fixed order: the same bits on every run.
#include "../launch.h"
#include "../layout_contract.h"
#include "combine.cuh"
#include "expert_mlp.cuh"
#include "gather.cuh"
#include "gather_fp8.cuh"
#include "gemm_launch.cuh"

namespace mok::cuda {

using sm90::CeilDiv;
using sm90::ChainParams;
using sm90::Check;
using sm90::GemmParams;

namespace {

// The expert MLPs' backward over the row groups of `offsets` (null: one group of m rows).
// x_rows, gu and dy_r are the MLP's input rows, saved pre-activations and output gradients
// (before the routes' weights); row_scale (null: 1) the weight of each row's route (row_tokens),
// and dw_parts (with row_scale) takes the rows' parts of dweights (GemmParams).
struct MlpGrads {
  const void *x_rows, *gu, *dy_r;
  const void *w_gate, *w_up, *w_down;
  const int32_t* offsets;
  const int32_t* row_tokens;  // with offsets: each row's route, -1 for padding (or null)
  const float* row_scale;
  int block_m;
  int groups;
  int64_t m, H, I;
  int64_t m_expected;  // the rows the launch choices expect used (GemmParams::m_expected)
  void *dgu, *h;      // scratch; h takes w h
  float* dw_parts;    // scratch (m, ceil(I / 128)) with row_scale
  void* dx_rows;      // (m, H)
  void *dw_gate, *dw_up, *dw_down;
};

// The fields of dh' = dy_r @ w_down^T (BwdDown and BwdDownFp8: its SwiGLU backward epilogue
// writes dgu, w h and the parts of dweights) and of dx_r = [dg | du] @ [w_gate | w_up]^T, but
// their operands.
GemmParams DownGrad(const MlpGrads& g) {
  GemmParams down = sm90::RowGroups(g.offsets, g.block_m, g.groups, g.m, g.m_expected);
  down.n = static_cast<int>(g.I), down.k = static_cast<int>(g.H);
  down.k_split = down.k, down.n_split = down.n;
  down.aux = static_cast<const __nv_bfloat16*>(g.gu), down.out0 = g.dgu, down.out1 = g.h;
  down.row_tokens = g.row_tokens, down.row_scale = g.row_scale;
  down.dw_parts = g.dw_parts, down.dw_part_cols = static_cast<int>(DwPartCols(g.I));
  return down;
}

GemmParams DxGrad(const MlpGrads& g) {
  GemmParams up = sm90::RowGroups(g.offsets, g.block_m, g.groups, g.m, g.m_expected);
  up.n = static_cast<int>(g.H), up.k = static_cast<int>(2 * g.I);
  up.k_split = static_cast<int>(g.I), up.n_split = up.n, up.out0 = g.dx_rows;
  return up;
}

// The data gradients of the MLPs (routed, and the shared one if count = 2) as two chains, each
// GEMM in slot j of the MLP: `down` computes dgu, w h = SwiGLU'(w (dy_r @ w_down^T)) and the
// parts of dweights, `dx` then dx_r = dgu @ [w_gate | w_up]^T.
const char* DataGradChains(const MlpGrads* mlps, int count, ChainParams* down_chain,
                           ChainParams* dx_chain) {
  *down_chain = sm90::EmptyChain();
  *dx_chain = sm90::EmptyChain();
  for (int j = 0; j < count; ++j) {
    const MlpGrads& g = mlps[j];
    const int H = static_cast<int>(g.H), I = static_cast<int>(g.I);
    // dh = dy_r @ w_down^T; B(n, k) = w_down[group * I + n, k].
    GemmParams& down = down_chain->gemm[j];
    down = DownGrad(g);
    if (auto err = sm90::PrepareGemm<sm90::BwdDown>(down, {g.dy_r, H, g.m},
                                                    {g.w_down, H, g.groups * g.I}, {}))
      return err;
    // dx_r = [dg | du] @ [w_gate | w_up]^T; B(n, k) = w_gate[group * H + n, k] (k < I), then
    // w_up.
    GemmParams& up = dx_chain->gemm[j];
    up = DxGrad(g);
    up.row_tokens = g.row_tokens;  // tails (kTail)
    if (auto err = sm90::PrepareGemm<sm90::BwdGateUp>(up, {g.dgu, 2 * g.I, g.m},
                                                      {g.w_gate, I, g.groups * g.H},
                                                      {g.w_up, I, g.groups * g.H}))
      return err;
  }
  return nullptr;
}

// The weight gradients of the MLPs as one chain, one CTA per output tile over the whole
// ragged reduction: dw_down_g = (w h)_g^T @ dy_r_g (I, H) (slots 0, 1) and [dw_gate_g |
// dw_up_g] = x_rows_g^T @ [dg_g | du_g] (H, 2I, split at I) (slots 2, 3). Each group's
// reduction stops at its last used row (rounded up to the Kind's kBlockK: 32, or 64 in runs):
// the padding rows are zero. Launched as `Kind` (BwdWeights, or BwdWeightRuns for run_tiles >
// 1), whose depth of k-steps the operands' tensor maps take, on the tile queue `queue`.
//
// Stopping there matters: with block_m = 128 a group's padded rows are 25% (gptoss_120b, 256
// routes an expert on average) to 47% (dsv3, 128) more than its routes.
template <class Kind>
const char* LaunchWeightGrads(const MlpGrads* mlps, int count, int run_tiles, int32_t* queue,
                              cudaStream_t stream) {
  ChainParams c = sm90::EmptyChain();
  for (int j = 0; j < count; ++j) {
    const MlpGrads& g = mlps[j];
    const int H = static_cast<int>(g.H), I = static_cast<int>(g.I);
    GemmParams& down = c.gemm[j];
    down = sm90::RowGroups(g.offsets, g.block_m, g.groups, g.m, g.m_expected);
    down.m = I, down.n = H, down.n_split = H;
    down.out0 = g.dw_down, down.out1 = g.dw_down, down.row_tokens = g.row_tokens;
    if (auto err = sm90::PrepareGemm<Kind>(down, {g.h, I, g.m}, {g.dy_r, H, g.m}, {}))
      return err;
    GemmParams& up = c.gemm[2 + j];
    up = sm90::RowGroups(g.offsets, g.block_m, g.groups, g.m, g.m_expected);
    up.m = H, up.n = 2 * I, up.n_split = I;
    up.out0 = g.dw_gate, up.out1 = g.dw_up, up.row_tokens = g.row_tokens;
    if (auto err = sm90::PrepareGemm<Kind>(up, {g.x_rows, H, g.m}, {g.dgu, 2 * g.I, g.m}, {}))
      return err;
  }
  c.queue = queue, c.run_tiles = run_tiles;
  return sm90::LaunchQueued<Kind, Kind>(c, stream);
}

// The weight gradients of the MLPs, in runs of tiles where WeightGradRunTiles finds them worth
// it, on tile queue 2.
const char* LaunchAllWeightGrads(const MlpGrads* mlps, int count, const MoeBwdArgs& a,
                                 cudaStream_t stream) {
  const int run_tiles = sm90::WeightGradRunTiles(CeilDiv(a.T * a.k, a.ranks), a.E);
  return run_tiles > 1 ? LaunchWeightGrads<sm90::BwdWeightRuns>(mlps, count, run_tiles,
                                                                 a.queue + 2, stream)
                       : LaunchWeightGrads<sm90::BwdWeights>(mlps, count, run_tiles,
                                                             a.queue + 2, stream);
}

// dx[t] = sum_j dx_r[pos[t, j]] in j order + the shared expert's dx; dweights[t, j] the sum of
// its route's dw_parts.
void LaunchDxCombine(const MoeBwdArgs& a, cudaStream_t stream) {
  using bf16 = __nv_bfloat16;
  sm90::CombineKernel<bf16, bf16><<<static_cast<unsigned>(CeilDiv(a.T, 8)), 256, 0, stream>>>(
      static_cast<const bf16*>(a.dx_routed),
      a.Is > 0 ? static_cast<const bf16*>(a.dx_shared) : nullptr, a.pos, nullptr, a.T,
      static_cast<int>(a.k), static_cast<int>(a.H), static_cast<bf16*>(a.dx), a.dw_parts,
      static_cast<int>(DwPartCols(a.I)), a.dweights);
}

}  // namespace

const char* LaunchMoeBwd(const MoeBwdArgs& a, cudaStream_t stream) {
  if (a.H % 64 || a.I % 64 || a.Is % 64) return "H, I and Is must be multiples of 64";
  if (a.T * a.k >= (int64_t{1} << 31) || a.R >= (int64_t{1} << 31))
    return "T * k and the routed rows must stay below 2^31";
  if (a.dy_f32 && a.Is > 0) return "a shared expert needs dy of x's dtype (bf16)";
  if (a.ranks < 1) return "ranks must be at least 1";
  using bf16 = __nv_bfloat16;
  const int E = static_cast<int>(a.E), k = static_cast<int>(a.k), H = static_cast<int>(a.H);

  // Tile queues (header ints): 0 the recompute's gate|up, 1 dgu, 2 the weight gradients, 3
  // dx_r; then the recompute's per-row-tile counts of gu. The first gather clears them.
  int32_t* ready = a.queue + kQueueHeaderInts;
  const int mlp_count = a.Is > 0 ? 2 : 1;
  const int64_t routes = a.T * a.k;
  const int64_t expected = ExpectedRoutedRows(routes, a.R, a.ranks);
  // Without recompute xs is the forward's (a residual): no gather of it, which saves 0.19 ms of
  // dsv3's forward+backward on an H200; keeping xs costs b R H bytes of residuals a layer
  // (README, Memory).
  const int64_t queue_ints = TileQueueInts(a.T, a.k, a.E);
  if (a.recompute) {
    sm90::GatherKernel<<<sm90::GatherCtas(a.T, E), 256, 0, stream>>>(
        static_cast<const bf16*>(a.x), a.pos, a.rows, a.offsets, a.T, k, a.block_m, H,
        static_cast<bf16*>(a.xs), a.queue, queue_ints);
  }
  // Recompute: the forward's gate|up launches on the same rows (xs gathered as the forward
  // gathers it, x for the shared expert), hence the bits it would have saved, into dgu, which
  // BwdDown then rewrites in place. h is written too and rewritten by BwdDown below.
  const void* gu = a.recompute ? a.dgu : a.gu;
  const void* gu_shared = a.recompute ? a.dgu_shared : a.gu_shared;
  if (a.recompute) {
    const sm90::ExpertMlp mlps[2] = {
        {a.xs, a.w_gate, a.w_up, a.w_down, a.offsets, a.rows, a.block_m, E, a.R, a.H, a.I,
         a.dgu, a.h, nullptr, -1, expected},
        {a.x, a.ws_gate, a.ws_up, a.ws_down, nullptr, nullptr, 128, 1, a.T, a.H, a.Is,
         a.dgu_shared, a.h_shared, nullptr, -1, a.T}};
    if (auto err = sm90::LaunchExpertMlps(mlps, mlp_count, /*down=*/false, a.queue + 0, ready,
                                          stream))
      return err;
  }
  auto* dy_r = static_cast<bf16*>(a.dy_routed);
  const int64_t zero_ints = a.recompute ? 0 : queue_ints;
  if (a.dy_f32) {
    sm90::GatherKernel<float><<<sm90::GatherCtas(a.T, E), 256, 0, stream>>>(
        static_cast<const float*>(a.dy), a.pos, a.rows, a.offsets, a.T, k, a.block_m, H, dy_r,
        a.queue, zero_ints);
  } else {
    sm90::GatherKernel<bf16><<<sm90::GatherCtas(a.T, E), 256, 0, stream>>>(
        static_cast<const bf16*>(a.dy), a.pos, a.rows, a.offsets, a.T, k, a.block_m, H, dy_r,
        a.queue, zero_ints);
  }
  const MlpGrads mlps[2] = {
      {a.xs_in, gu, a.dy_routed, a.w_gate, a.w_up, a.w_down, a.offsets, a.rows, a.weights,
       a.block_m, E, a.R, a.H, a.I, expected, a.dgu, a.h, a.dw_parts, a.dx_routed, a.dw_gate,
       a.dw_up, a.dw_down},
      {a.x, gu_shared, a.dy, a.ws_gate, a.ws_up, a.ws_down, nullptr, nullptr, nullptr, 128, 1,
       a.T, a.H, a.Is, a.T, a.dgu_shared, a.h_shared, nullptr, a.dx_shared, a.dws_gate,
       a.dws_up, a.dws_down}};
  // dgu and h first; then the weight gradients, which write theirs, and dx_r, which reads the
  // weights, each a launch of its own. dx_r comes last because its rows take the buffer of xs,
  // which the weight gradients read.
  //
  // Each route's dx is rounded to x's dtype, as each route's output is in the forward: against
  // f32 rows this halves what dx_r writes and the combine reads (qwen3_30b: 1.1 GB each way a
  // call; docs/performance.md, dx of each route in bf16).
  ChainParams down, dx;
  if (auto err = DataGradChains(mlps, mlp_count, &down, &dx)) return err;
  down.queue = a.queue + 1, dx.queue = a.queue + 3;
  if (auto err = sm90::LaunchQueued<sm90::BwdDown, sm90::BwdDown>(down, stream)) return err;
  if (auto err = LaunchAllWeightGrads(mlps, mlp_count, a, stream)) return err;
  // dx_r and the weight gradients are separate launches rather than one that shares its CTAs
  // between the two chains: on an H200 this takes 1.6-6.5% less than one dual launch on the
  // four bench shapes, and dx_r can run in clusters of two where experts have few rows
  // (UseClusters) (docs/performance.md, The backward's dx_r and weight gradients apart).
  if (auto err = sm90::LaunchQueued<sm90::BwdGateUp, sm90::BwdGateUp>(dx, stream)) return err;
  LaunchDxCombine(a, stream);
  return Check(cudaGetLastError());
}

namespace {

// The FP8 data gradients of the MLPs (routed, and the shared one if count = 2), as
// DataGradChains' two chains: dh' from dy in e4m3 and w_down as it is, then dx_r from dgu in
// e4m3 and w_gate | w_up as they are (their block scales (n, k): b_scale_nk).
struct Fp8Operands {
  const void* dyq;
  const float* dyq_scale;
  const void* dguq;
  const float* dguq_scale;
  int64_t pitch;
  const float *gate_scale, *up_scale, *down_scale;
};

const char* DataGradChainsFp8(const MlpGrads* mlps, const Fp8Operands* q, int count,
                              ChainParams* down_chain, ChainParams* dx_chain) {
  *down_chain = sm90::EmptyChain();
  *dx_chain = sm90::EmptyChain();
  for (int j = 0; j < count; ++j) {
    const MlpGrads& g = mlps[j];
    const int H = static_cast<int>(g.H), I = static_cast<int>(g.I);
    GemmParams& down = down_chain->gemm[j];
    down = DownGrad(g);
    down.b_scale0 = q[j].down_scale, down.b_scale_nk = true;
    if (auto err = sm90::PrepareGemmFp8<sm90::BwdDownFp8>(
            down, {q[j].dyq, H, g.m}, q[j].dyq_scale, q[j].pitch,
            {g.w_down, H, g.groups * g.I}, {}))
      return err;
    GemmParams& up = dx_chain->gemm[j];
    up = DxGrad(g);
    up.b_scale0 = q[j].gate_scale, up.b_scale1 = q[j].up_scale, up.b_scale_nk = true;
    if (auto err = sm90::PrepareGemmFp8<sm90::BwdGateUpFp8>(
            up, {q[j].dguq, 2 * g.I, g.m}, q[j].dguq_scale, q[j].pitch,
            {g.w_gate, I, g.groups * g.H}, {g.w_up, I, g.groups * g.H}))
      return err;
  }
  return nullptr;
}

}  // namespace

const char* LaunchMoeBwdFp8(const MoeBwdFp8Args& f, cudaStream_t stream) {
  const MoeBwdArgs& a = f.bwd;
  constexpr int64_t kBlock = sm90::kFp8Block;
  if (a.H % kBlock || a.I % kBlock || a.Is % kBlock)
    return "the FP8 backward needs H, I and Is multiples of 128";
  if (a.T * a.k >= (int64_t{1} << 31) || a.R >= (int64_t{1} << 31))
    return "T * k and the routed rows must stay below 2^31";
  if (a.dy_f32 || a.recompute) return "the FP8 backward takes bf16 dy and the forward's gu";
  if (a.ranks < 1) return "ranks must be at least 1";
  using bf16 = __nv_bfloat16;
  const int E = static_cast<int>(a.E), k = static_cast<int>(a.k), H = static_cast<int>(a.H);
  const int mlp_count = a.Is > 0 ? 2 : 1;
  const int64_t routes = a.T * a.k;
  const int64_t expected = ExpectedRoutedRows(routes, a.R, a.ranks);
  const int64_t pitch = Fp8ScalePitch(a.R), token_pitch = Fp8ScalePitch(a.T);
  // Tile queues as LaunchMoeBwd's (1 dgu, 2 the weight gradients, 3 dx_r), cleared by the
  // gather of xs: the FP8 forward keeps no bf16 rows of x.
  sm90::GatherKernel<<<sm90::GatherCtas(a.T, E), 256, 0, stream>>>(
      static_cast<const bf16*>(a.x), a.pos, a.rows, a.offsets, a.T, k, a.block_m, H,
      static_cast<bf16*>(a.xs), a.queue, TileQueueInts(a.T, a.k, a.E));
  sm90::GatherKernel<bf16><<<sm90::GatherCtas(a.T, E), 256, 0, stream>>>(
      static_cast<const bf16*>(a.dy), a.pos, a.rows, a.offsets, a.T, k, a.block_m, H,
      static_cast<bf16*>(a.dy_routed), nullptr, 0);
  sm90::GatherQuantizeKernel<<<sm90::GatherCtas(a.T, E), 256, 0, stream>>>(
      static_cast<const bf16*>(a.dy), a.pos, a.rows, a.offsets, a.T, k, a.block_m, H,
      static_cast<uint8_t*>(f.dyq), f.dyq_scale, pitch,
      a.Is > 0 ? static_cast<uint8_t*>(f.dyq_shared) : nullptr, f.dyq_shared_scale, token_pitch);
  const MlpGrads mlps[2] = {
      {a.xs, a.gu, a.dy_routed, a.w_gate, a.w_up, a.w_down, a.offsets, a.rows, a.weights,
       a.block_m, E, a.R, a.H, a.I, expected, a.dgu, a.h, a.dw_parts, a.dx_routed, a.dw_gate,
       a.dw_up, a.dw_down},
      {a.x, a.gu_shared, a.dy, a.ws_gate, a.ws_up, a.ws_down, nullptr, nullptr, nullptr, 128, 1,
       a.T, a.H, a.Is, a.T, a.dgu_shared, a.h_shared, nullptr, a.dx_shared, a.dws_gate,
       a.dws_up, a.dws_down}};
  const Fp8Operands q[2] = {
      {f.dyq, f.dyq_scale, f.dguq, f.dguq_scale, pitch, f.w_gate_scale, f.w_up_scale,
       f.w_down_scale},
      {f.dyq_shared, f.dyq_shared_scale, f.dguq_shared, f.dguq_shared_scale, token_pitch,
       f.ws_gate_scale, f.ws_up_scale, f.ws_down_scale}};
  ChainParams down, dx;
  if (auto err = DataGradChainsFp8(mlps, q, mlp_count, &down, &dx)) return err;
  down.queue = a.queue + 1, dx.queue = a.queue + 3;
  if (auto err = sm90::LaunchQueued<sm90::BwdDownFp8, sm90::BwdDownFp8>(down, stream))
    return err;
  // dgu into e4m3, the rows that BwdDown wrote (offsets[E]: the routed rows in use).
  sm90::QuantizeRowsKernel<<<sm90::QuantizeRowsCtas(a.R), 256, 0, stream>>>(
      static_cast<const bf16*>(a.dgu), a.R, a.offsets + a.E, static_cast<int>(2 * a.I),
      static_cast<uint8_t*>(f.dguq), f.dguq_scale, pitch);
  if (a.Is > 0) {
    sm90::QuantizeRowsKernel<<<sm90::QuantizeRowsCtas(a.T), 256, 0, stream>>>(
        static_cast<const bf16*>(a.dgu_shared), a.T, nullptr, static_cast<int>(2 * a.Is),
        static_cast<uint8_t*>(f.dguq_shared), f.dguq_shared_scale, token_pitch);
  }
  if (auto err = LaunchAllWeightGrads(mlps, mlp_count, a, stream)) return err;
  // dx_r last: it takes xs's buffer, which the weight gradients read (as LaunchMoeBwd's).
  if (auto err = sm90::LaunchQueued<sm90::BwdGateUpFp8, sm90::BwdGateUpFp8>(dx, stream))
    return err;
  LaunchDxCombine(a, stream);
  return Check(cudaGetLastError());
}

}  // namespace mok::cuda
