// Launch of the forward on one GPU: layout -> gather -> GEMM1 (gate|up, SwiGLU) -> GEMM2 ->
// combine, all enqueued on XLA's stream with no host synchronisation.
#include <algorithm>
#include <mutex>

#include "../launch.h"
#include "combine.cuh"
#include "gemm_kernel.cuh"
#include "layout.cuh"
#include "tensor_map.h"

namespace mok::cuda {

using sm90::GemmConfig;
using sm90::GemmParams;

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <class Kernel>
cudaError_t AllowSmem(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

// C = A @ B_group for the row blocks of each group. a: (m_total, k); b0/b1: (groups * k, n).
template <sm90::Epilogue kEpi>
const char* LaunchGemm(const void* a, const void* b0, const void* b1, const int32_t* offsets,
                       int groups, int64_t m_total, int n, int k, void* out0, void* out1,
                       cudaStream_t stream) {
  using C = GemmConfig;
  GemmParams p{};
  const uint64_t b_rows = uint64_t(groups) * k;
  if (!sm90::MakeTensorMap(&p.a, a, k, m_total, C::kBoxInner, C::kBlockM) ||
      !sm90::MakeTensorMap(&p.b0, b0, n, b_rows, C::kBoxInner, C::kBlockK) ||
      (kEpi == sm90::Epilogue::kSwiGLU &&
       !sm90::MakeTensorMap(&p.b1, b1, n, b_rows, C::kBoxInner, C::kBlockK))) {
    return "cuTensorMapEncodeTiled refused a GEMM operand";
  }
  p.offsets = offsets;
  p.groups = groups;
  p.m_total = m_total;
  p.n = n;
  p.k = k;
  const int cols_per_tile = kEpi == sm90::Epilogue::kSwiGLU ? C::kBlockN / 2 : C::kBlockN;
  p.n_tiles = static_cast<int>(CeilDiv(n, cols_per_tile));
  p.out0 = static_cast<__nv_bfloat16*>(out0);
  p.out1 = static_cast<__nv_bfloat16*>(out1);
  static std::once_flag once;
  static cudaError_t attr = cudaSuccess;
  std::call_once(once, [] {
    attr = AllowSmem(sm90::GroupedGemmKernel<kEpi>, sm90::kGemmSmemBytes);
  });
  if (attr != cudaSuccess) return cudaGetErrorString(attr);
  const int64_t ctas = CeilDiv(m_total, C::kBlockM) * p.n_tiles;
  sm90::GroupedGemmKernel<kEpi>
      <<<static_cast<unsigned>(ctas), C::kThreads, sm90::kGemmSmemBytes, stream>>>(p);
  return nullptr;
}

const char* Check(cudaError_t e) { return e == cudaSuccess ? nullptr : cudaGetErrorString(e); }

}  // namespace

const char* LaunchMoeFwd(const MoeFwdArgs& a, cudaStream_t stream) {
  if (a.H % 64 || a.I % 64 || a.Is % 64) return "H, I and Is must be multiples of 64";
  if (a.E > sm90::kMaxExperts) return "at most 512 experts per GPU";
  const int64_t routes = a.T * a.k;
  if (routes >= (int64_t{1} << 31) || a.R >= (int64_t{1} << 31))
    return "T * k and the routed rows must stay below 2^31";
  const int E = static_cast<int>(a.E), k = static_cast<int>(a.k);
  const int64_t chunks = CeilDiv(routes, sm90::kLayoutChunk);

  // 1. Layout.
  if (auto err = Check(cudaMemsetAsync(a.rows, 0xff, a.R * sizeof(int32_t), stream))) return err;
  const size_t rank_smem = size_t{sm90::kLayoutWarps} * E * sizeof(int32_t);
  static std::once_flag once;
  static cudaError_t attr = cudaSuccess;
  std::call_once(once, [] {
    attr = AllowSmem(sm90::LayoutRankKernel,
                     size_t{sm90::kLayoutWarps} * sm90::kMaxExperts * sizeof(int32_t));
  });
  if (auto err = Check(attr)) return err;
  sm90::LayoutRankKernel<<<chunks, sm90::kLayoutChunk, rank_smem, stream>>>(
      a.experts, routes, E, a.pos, a.layout);
  sm90::LayoutOffsetsKernel<<<1, 1024, 0, stream>>>(a.layout, static_cast<int>(chunks), E,
                                                    GemmConfig::kBlockM, a.offsets);
  sm90::LayoutPositionsKernel<<<chunks, sm90::kLayoutChunk, 0, stream>>>(
      a.experts, routes, E, a.layout, a.offsets, a.pos, a.rows);
  // 2. Gather the routed token rows (zeros for padding rows).
  sm90::GatherKernel<<<CeilDiv(a.R, 8), 256, 0, stream>>>(
      static_cast<const uint4*>(a.x), a.rows, a.offsets + E, k, static_cast<int>(a.H / 8),
      static_cast<uint4*>(a.xs));
  // 3. Expert MLPs: gu and h = silu(g) * u, then y_routed = h @ w_down.
  const int H = static_cast<int>(a.H), I = static_cast<int>(a.I);
  if (auto err = LaunchGemm<sm90::Epilogue::kSwiGLU>(a.xs, a.w_gate, a.w_up, a.offsets, E, a.R,
                                                      I, H, a.gu, a.h, stream))
    return err;
  if (auto err = LaunchGemm<sm90::Epilogue::kStore>(a.h, a.w_down, nullptr, a.offsets, E, a.R, H,
                                                     I, a.y_routed, nullptr, stream))
    return err;
  // 4. The shared expert: one group of T rows read straight from x.
  if (a.Is > 0) {
    const int Is = static_cast<int>(a.Is);
    if (auto err = LaunchGemm<sm90::Epilogue::kSwiGLU>(a.x, a.ws_gate, a.ws_up, nullptr, 1, a.T,
                                                        Is, H, a.gu_shared, a.h_shared, stream))
      return err;
    if (auto err = LaunchGemm<sm90::Epilogue::kStore>(a.h_shared, a.ws_down, nullptr, nullptr, 1,
                                                       a.T, H, Is, a.y_shared, nullptr, stream))
      return err;
  }
  // 5. Combine.
  const auto* y_routed = static_cast<const uint4*>(a.y_routed);
  const auto* y_shared = a.Is > 0 ? static_cast<const uint4*>(a.y_shared) : nullptr;
  const unsigned combine_ctas = static_cast<unsigned>(CeilDiv(a.T, 8));
  if (a.y_f32) {
    sm90::CombineKernel<float><<<combine_ctas, 256, 0, stream>>>(
        y_routed, y_shared, a.pos, a.weights, a.T, k, H, static_cast<float*>(a.y));
  } else {
    sm90::CombineKernel<__nv_bfloat16><<<combine_ctas, 256, 0, stream>>>(
        y_routed, y_shared, a.pos, a.weights, a.T, k, H, static_cast<__nv_bfloat16*>(a.y));
  }
  return Check(cudaGetLastError());
}

}  // namespace mok::cuda
