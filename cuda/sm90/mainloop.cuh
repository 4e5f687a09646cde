// The GEMM mainloop: a producer thread that streams A and B k-tiles into a ring of shared-memory
// stages with TMA, and two consumer warpgroups that multiply them with wgmma.
#pragma once

#include <cute/tensor.hpp>

#include "gemm_config.cuh"
#include "ptx.cuh"
#include "tile_scheduler.cuh"

namespace mok::sm90 {

using bf16_t = cute::bfloat16_t;

// A: K-major 128-byte-swizzled rows (what a (64, 128) TMA box writes): (BM, BK, PIPE).
using SmemLayoutA = decltype(cute::tile_to_shape(
    cute::GMMA::Layout_K_SW128_Atom<bf16_t>{},
    cute::Shape<cute::Int<GemmConfig::kBlockM>, cute::Int<GemmConfig::kBlockK>,
                cute::Int<GemmConfig::kStages>>{}));
// B: N-major (the weights are (K, N) row-major). Atoms are ordered K first so that each group
// of 64 columns is one contiguous (64 N, 64 K) TMA box of 8 KB: (BN, BK, PIPE).
using SmemLayoutB = decltype(cute::tile_to_shape(
    cute::GMMA::Layout_MN_SW128_Atom<bf16_t>{},
    cute::Shape<cute::Int<GemmConfig::kBlockN>, cute::Int<GemmConfig::kBlockK>,
                cute::Int<GemmConfig::kStages>>{},
    cute::Step<cute::_2, cute::_1, cute::_3>{}));

// Two 64 x 256 wgmma atoms stacked along M, one per consumer warpgroup.
using TiledMma = decltype(cute::make_tiled_mma(
    cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::MN>{},
    cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

struct alignas(1024) GemmSmem {
  bf16_t a[GemmConfig::kStages][GemmConfig::kBlockM * GemmConfig::kBlockK];
  bf16_t b[GemmConfig::kStages][GemmConfig::kBlockN * GemmConfig::kBlockK];
  uint64_t full[GemmConfig::kStages];   // TMA bytes landed
  uint64_t empty[GemmConfig::kStages];  // both consumer warpgroups done reading
};

// Producer: one thread issues every TMA of the tile.
template <Epilogue kEpi>
__device__ __forceinline__ void LoadTile(const GemmParams& p, const GemmTile& tile,
                                         GemmSmem& smem) {
  using C = GemmConfig;
  const int num_k = p.k / C::kBlockK;
  const int b_row0 = tile.group * p.k;
  for (int kt = 0; kt < num_k; ++kt) {
    const int s = kt % C::kStages;
    const uint32_t round = kt / C::kStages;
    BarrierWait(&smem.empty[s], (round & 1) ^ 1);  // the first round finds every stage free
    BarrierArriveExpectTx(&smem.full[s], C::kStageBytes);
    TmaLoad2d(smem.a[s], &p.a, &smem.full[s], kt * C::kBlockK, static_cast<int32_t>(tile.m0));
#pragma unroll
    for (int j = 0; j < C::kBoxesB; ++j) {
      // kSwiGLU: boxes 0-1 are 128 columns of w_gate, boxes 2-3 the same columns of w_up.
      const bool up = kEpi == Epilogue::kSwiGLU && j >= C::kBoxesB / 2;
      const int col = kEpi == Epilogue::kSwiGLU
                          ? tile.n_tile * (C::kBlockN / 2) + (j % (C::kBoxesB / 2)) * C::kBoxInner
                          : tile.n_tile * C::kBlockN + j * C::kBoxInner;
      TmaLoad2d(smem.b[s] + j * C::kBoxInner * C::kBlockK, up ? &p.b1 : &p.b0, &smem.full[s],
                col, b_row0 + kt * C::kBlockK);
    }
  }
}

// Consumers: accumulate the (128, 256) tile; each warpgroup owns 64 rows of it.
// `thread` is the index among the 256 consumer threads.
template <class Accum>
__device__ __forceinline__ void MmaTile(const GemmParams& p, GemmSmem& smem, int thread,
                                        Accum& acc) {
  using namespace cute;
  using C = GemmConfig;
  Tensor sA = make_tensor(make_smem_ptr(&smem.a[0][0]), SmemLayoutA{});  // (BM, BK, PIPE)
  Tensor sB = make_tensor(make_smem_ptr(&smem.b[0][0]), SmemLayoutB{});  // (BN, BK, PIPE)
  TiledMma mma;
  auto thr = mma.get_thread_slice(thread);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
  const int num_k = p.k / C::kBlockK;
  const bool releaser = thread % 128 == 0;
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  for (int kt = 0; kt < num_k; ++kt) {
    const int s = kt % C::kStages;
    BarrierWait(&smem.full[s], (kt / C::kStages) & 1);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      gemm(mma, tCrA(_, _, kb, s), tCrB(_, _, kb, s), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    // Keep one k-step of wgmma in flight; the one before it has finished reading its stage.
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
    if (kt > 0 && releaser) BarrierArrive(&smem.empty[(kt - 1) % C::kStages]);
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
}

}  // namespace mok::sm90
