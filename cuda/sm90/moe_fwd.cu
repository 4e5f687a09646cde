// Launch of the forward on one GPU: layout -> gather -> expert MLPs (gate|up with SwiGLU, then
// down, routed and shared, one launch) -> combine, all enqueued on XLA's stream with no host
// synchronisation. The FP8 forward (LaunchMoeFwdFp8) is the same four steps, its gather
// quantizing the token rows and its MLPs block-scaled e4m3.
#include "../launch.h"
#include "combine.cuh"
#include "expert_mlp.cuh"
#include "gather.cuh"
#include "gather_fp8.cuh"
#include "gemm_launch.cuh"
#include "layout.cuh"
#include "shared_memory.h"

namespace mok::cuda {

using sm90::CeilDiv;
using sm90::Check;
using sm90::GemmConfig;
using sm90::GemmParams;
using sm90::Matrix;

namespace {

// The arguments both forwards check alike.
const char* CheckShape(int64_t T, int64_t k, int64_t E, int64_t R, int64_t ranks) {
  if (E > sm90::kMaxExperts) return "at most 512 experts per GPU";
  if (ranks < 1) return "ranks must be at least 1";
  if (T * k >= (int64_t{1} << 31) || R >= (int64_t{1} << 31))
    return "T * k and the routed rows must stay below 2^31";
  return nullptr;
}

// 1. Layout: pos, offsets and rows of the routes; it also clears the expert-MLP launch's tile
// queue (at `queue` in the layout scratch).
const char* LaunchLayout(int64_t T, int64_t k, int64_t E, int block_m, int64_t R,
                         const int32_t* experts, int32_t* pos, int32_t* offsets, int32_t* rows,
                         int32_t* layout, int32_t* queue, cudaStream_t stream) {
  const int64_t routes = T * k;
  const int64_t chunks = CeilDiv(routes, sm90::kLayoutChunk);
  const size_t rank_smem = size_t{sm90::kLayoutWarps} * E * sizeof(int32_t);
  if (auto err = Check(sm90::AllowSharedMemory(
          reinterpret_cast<const void*>(sm90::LayoutRankKernel),
          static_cast<int>(size_t{sm90::kLayoutWarps} * sm90::kMaxExperts * sizeof(int32_t)))))
    return err;
  const int e = static_cast<int>(E);
  sm90::LayoutRankKernel<<<chunks, sm90::kLayoutChunk, rank_smem, stream>>>(
      experts, routes, e, pos, layout, queue, TileQueueInts(T, k, E));
  sm90::LayoutOffsetsKernel<<<1, 1024, 0, stream>>>(layout, static_cast<int>(chunks), e,
                                                    block_m, offsets, rows);
  sm90::LayoutPositionsKernel<<<chunks, sm90::kLayoutChunk, 0, stream>>>(
      experts, routes, e, layout, offsets, pos, rows, R);
  return nullptr;
}

// 4. Combine: y[t] = round(sum_j w[t, j] y_routed[pos[t, j]] + y_shared[t]).
void LaunchCombine(const void* y_routed, const void* y_shared, const int32_t* pos,
                   const float* weights, int64_t T, int64_t k, int64_t H, void* y, bool y_f32,
                   cudaStream_t stream) {
  using bf16 = __nv_bfloat16;
  const auto* routed = static_cast<const bf16*>(y_routed);
  const auto* shared = static_cast<const bf16*>(y_shared);
  const unsigned ctas = static_cast<unsigned>(CeilDiv(T, 8));
  const int kk = static_cast<int>(k), h = static_cast<int>(H);
  if (y_f32) {
    sm90::CombineKernel<bf16, float><<<ctas, 256, 0, stream>>>(routed, shared, pos, weights, T,
                                                               kk, h, static_cast<float*>(y));
  } else {
    sm90::CombineKernel<bf16, bf16><<<ctas, 256, 0, stream>>>(routed, shared, pos, weights, T,
                                                              kk, h, static_cast<bf16*>(y));
  }
}

}  // namespace

const char* LaunchMoeFwd(const MoeFwdArgs& a, cudaStream_t stream) {
  if (a.H % 64 || a.I % 64 || a.Is % 64) return "H, I and Is must be multiples of 64";
  if (auto err = CheckShape(a.T, a.k, a.E, a.R, a.ranks)) return err;
  const int64_t routes = a.T * a.k;
  const int E = static_cast<int>(a.E), k = static_cast<int>(a.k);
  const int64_t expected = ExpectedRoutedRows(routes, a.R, a.ranks);

  // 1. Layout; it also clears the expert-MLP launch's tile queue.
  int32_t* queue = a.layout + LayoutCountInts(routes, a.E);
  if (auto err = LaunchLayout(a.T, a.k, a.E, a.block_m, a.R, a.experts, a.pos, a.offsets, a.rows,
                              a.layout, queue, stream))
    return err;
  // 2. Gather the routed token rows (zeros for padding rows).
  sm90::GatherKernel<<<sm90::GatherCtas(a.T, E), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.x), a.pos, a.rows, a.offsets, a.T, k, a.block_m,
      static_cast<int>(a.H), static_cast<__nv_bfloat16*>(a.xs), nullptr, 0);
  // 3. Expert MLPs, routed and shared (one group of T rows read straight from x), in one
  // launch: gu (unless null: not kept) and h = silu(g) * u, then y = h @ w_down.
  sm90::ExpertMlp mlps[2] = {
      {a.xs, a.w_gate, a.w_up, a.w_down, a.offsets, a.rows, a.block_m, E, a.R, a.H, a.I, a.gu, a.h,
       a.y_routed, 0, expected},
      {a.x, a.ws_gate, a.ws_up, a.ws_down, nullptr, nullptr, 128, 1, a.T, a.H, a.Is, a.gu_shared,
       a.h_shared, a.y_shared, static_cast<int>(RoutedRowTilesBound(routes, a.E)), a.T}};
  const int count = a.Is > 0 ? 2 : 1;
  if (auto err = sm90::LaunchExpertMlps(mlps, count, /*down=*/true, queue,
                                        queue + kQueueHeaderInts, stream))
    return err;
  // 4. Combine.
  LaunchCombine(a.y_routed, a.Is > 0 ? a.y_shared : nullptr, a.pos, a.weights, a.T, a.k, a.H,
                a.y, a.y_f32, stream);
  return Check(cudaGetLastError());
}

const char* LaunchMoeFwdFp8(const MoeFwdFp8Args& a, cudaStream_t stream) {
  constexpr int64_t kBlock = sm90::kFp8Block;
  if (a.H % kBlock || a.I % kBlock || a.Is % kBlock)
    return "the FP8 forward needs H, I and Is multiples of 128";
  if (auto err = CheckShape(a.T, a.k, a.E, a.R, a.ranks)) return err;
  const int64_t routes = a.T * a.k;
  const int E = static_cast<int>(a.E), k = static_cast<int>(a.k);
  const int64_t expected = ExpectedRoutedRows(routes, a.R, a.ranks);
  const int64_t routed_pitch = Fp8ScalePitch(a.R), token_pitch = Fp8ScalePitch(a.T);

  // 1. Layout, as the bf16 forward's.
  int32_t* queue = a.layout + LayoutCountInts(routes, a.E);
  if (auto err = LaunchLayout(a.T, a.k, a.E, a.block_m, a.R, a.experts, a.pos, a.offsets, a.rows,
                              a.layout, queue, stream))
    return err;
  // 2. Gather the routed token rows in e4m3 with their 1 x 128 scales (zeros and scale 1 for
  // padding rows), and every token's for the shared expert.
  const bool shared = a.Is > 0;
  sm90::GatherQuantizeKernel<<<sm90::GatherCtas(a.T, E), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.x), a.pos, a.rows, a.offsets, a.T, k, a.block_m,
      static_cast<int>(a.H), static_cast<uint8_t*>(a.xq), a.xq_scale, routed_pitch,
      shared ? static_cast<uint8_t*>(a.xq_shared) : nullptr, a.xq_shared_scale, token_pitch);
  // 3. Expert MLPs, routed and shared, in one launch: gu (if kept), hq = quantize(silu(g) * u),
  // then y = hq @ w_down.
  sm90::ExpertMlpFp8 mlps[2] = {
      {a.xq, a.xq_scale, routed_pitch, a.w_gate, a.w_up, a.w_down, a.w_gate_scale, a.w_up_scale,
       a.w_down_scale, a.offsets, a.block_m, E, a.R, a.H, a.I, a.gu, a.hq, a.hq_scale,
       routed_pitch, a.y_routed, 0, expected},
      {a.xq_shared, a.xq_shared_scale, token_pitch, a.ws_gate, a.ws_up, a.ws_down,
       a.ws_gate_scale, a.ws_up_scale, a.ws_down_scale, nullptr, 128, 1, a.T, a.H, a.Is,
       a.gu_shared, a.hq_shared, a.hq_shared_scale, token_pitch, a.y_shared,
       static_cast<int>(RoutedRowTilesBound(routes, a.E)), a.T}};
  if (auto err = sm90::LaunchExpertMlpsFp8(mlps, shared ? 2 : 1, queue, queue + kQueueHeaderInts,
                                           stream))
    return err;
  // 4. Combine, as the bf16 forward's.
  LaunchCombine(a.y_routed, shared ? a.y_shared : nullptr, a.pos, a.weights, a.T, a.k, a.H, a.y,
                a.y_f32, stream);
  return Check(cudaGetLastError());
}

}  // namespace mok::cuda
