// Launch of the forward on one GPU: layout -> gather -> expert MLPs (gate|up with SwiGLU, then
// down, routed and shared, one launch) -> combine, all enqueued on XLA's stream with no host
// synchronisation.
#include "../launch.h"
#include "combine.cuh"
#include "expert_mlp.cuh"
#include "gather.cuh"
#include "gemm_launch.cuh"
#include "layout.cuh"
#include "shared_memory.h"

namespace mok::cuda {

using sm90::CeilDiv;
using sm90::Check;
using sm90::GemmConfig;
using sm90::GemmParams;
using sm90::Matrix;

const char* LaunchMoeFwd(const MoeFwdArgs& a, cudaStream_t stream) {
  if (a.H % 64 || a.I % 64 || a.Is % 64) return "H, I and Is must be multiples of 64";
  if (a.E > sm90::kMaxExperts) return "at most 512 experts per GPU";
  if (a.ranks < 1) return "ranks must be at least 1";
  const int64_t routes = a.T * a.k;
  if (routes >= (int64_t{1} << 31) || a.R >= (int64_t{1} << 31))
    return "T * k and the routed rows must stay below 2^31";
  const int E = static_cast<int>(a.E), k = static_cast<int>(a.k);
  const int64_t chunks = CeilDiv(routes, sm90::kLayoutChunk);
  const int64_t expected = ExpectedRoutedRows(routes, a.R, a.ranks);

  // 1. Layout; it also clears the expert-MLP launch's tile queue.
  int32_t* queue = a.layout + LayoutCountInts(routes, a.E);
  const size_t rank_smem = size_t{sm90::kLayoutWarps} * E * sizeof(int32_t);
  if (auto err = Check(sm90::AllowSharedMemory(
          reinterpret_cast<const void*>(sm90::LayoutRankKernel),
          static_cast<int>(size_t{sm90::kLayoutWarps} * sm90::kMaxExperts * sizeof(int32_t)))))
    return err;
  sm90::LayoutRankKernel<<<chunks, sm90::kLayoutChunk, rank_smem, stream>>>(
      a.experts, routes, E, a.pos, a.layout, queue, TileQueueInts(a.T, a.k, a.E));
  sm90::LayoutOffsetsKernel<<<1, 1024, 0, stream>>>(a.layout, static_cast<int>(chunks), E,
                                                    a.block_m, a.offsets, a.rows);
  sm90::LayoutPositionsKernel<<<chunks, sm90::kLayoutChunk, 0, stream>>>(
      a.experts, routes, E, a.layout, a.offsets, a.pos, a.rows, a.R);
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
  using bf16 = __nv_bfloat16;
  const auto* y_routed = static_cast<const bf16*>(a.y_routed);
  const auto* y_shared = a.Is > 0 ? static_cast<const bf16*>(a.y_shared) : nullptr;
  const unsigned combine_ctas = static_cast<unsigned>(CeilDiv(a.T, 8));
  const int H = static_cast<int>(a.H);
  if (a.y_f32) {
    sm90::CombineKernel<bf16, float><<<combine_ctas, 256, 0, stream>>>(
        y_routed, y_shared, a.pos, a.weights, a.T, k, H, static_cast<float*>(a.y));
  } else {
    sm90::CombineKernel<bf16, bf16><<<combine_ctas, 256, 0, stream>>>(
        y_routed, y_shared, a.pos, a.weights, a.T, k, H, static_cast<bf16*>(a.y));
  }
  return Check(cudaGetLastError());
}

}  // namespace mok::cuda
