// The grouped expert GEMM kernel: warp-specialised (one producer warpgroup, two consumer
// warpgroups), TMA -> mbarrier ring -> wgmma, then an epilogue, over the tiles that the grid
// stride gives the CTA. On a persistent grid, while the consumers run a tile's epilogue, the
// producer is already loading the next tile's stages.
#pragma once

#include "epilogue.cuh"
#include "gemm_config.cuh"
#include "mainloop.cuh"
#include "ptx.cuh"
#include "tile_scheduler.cuh"

namespace mok::sm90 {

constexpr size_t kGemmSmemBytes = sizeof(GemmSmem) + 1024;  // + alignment slack

template <class Kind>
__global__ void __launch_bounds__(GemmConfig::kThreads, 1)
    GroupedGemmKernel(const __grid_constant__ GemmParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = GemmConfig;
  extern __shared__ uint8_t smem_raw[];
  // 128-byte swizzling is a function of address bits 4-9: stages start 1024-byte aligned.
  GemmSmem& smem = *reinterpret_cast<GemmSmem*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int warpgroup = threadIdx.x / 128;
  const int32_t* offsets = nullptr;
  const int32_t* tile_start = nullptr;
  if (p.offsets) {
    for (int g = threadIdx.x; g <= p.groups; g += C::kThreads) smem.offsets[g] = p.offsets[g];
    offsets = smem.offsets;
    tile_start = smem.tile_start;
    __syncthreads();
    if (Kind::kSched == Schedule::kRowsByGroup && threadIdx.x / 32 == 1)
      ScanGroupTiles(offsets, p.groups, threadIdx.x % 32, smem.tile_start);
  }
  if (threadIdx.x == 0) {
    PrefetchTmaDescriptor(&p.a);
    PrefetchTmaDescriptor(&p.b0);
    if (Kind::kEpi == Epilogue::kSwiGLU || (Kind::kKMajorB && p.k_split < p.k))
      PrefetchTmaDescriptor(&p.b1);
    for (int s = 0; s < C::kStages; ++s) {
      BarrierInit(&smem.full[s], 1);
      BarrierInit(&smem.empty[s], C::kConsumerWarpgroups);
    }
    FenceBarrierInit();
  }
  __syncthreads();

  // Both roles walk the same tiles in the same order; `it` keeps their rings in step.
  uint32_t it = 0;
  if (warpgroup == 0) {
    SetMaxRegistersDec<C::kProducerRegs>();
    if (threadIdx.x != 0) return;
    for (int64_t linear = blockIdx.x; linear < p.tiles; linear += gridDim.x) {
      const GemmTile tile = ScheduleTile<Kind::kSched>(p, offsets, tile_start, linear);
      if (!tile.valid) break;
      LoadTile<Kind>(p, tile, smem, it);
    }
  } else {
    SetMaxRegistersInc<C::kConsumerRegs>();
    const int thread = threadIdx.x - 128;
#pragma unroll 1
    for (int64_t linear = blockIdx.x; linear < p.tiles; linear += gridDim.x) {
      const GemmTile tile = ScheduleTile<Kind::kSched>(p, offsets, tile_start, linear);
      if (!tile.valid) break;
      auto acc = cute::partition_fragment_C(
          typename GemmLayouts<Kind>::TiledMma{},
          cute::Shape<cute::Int<C::kBlockM>, cute::Int<C::kBlockN>>{});
      const bool idle = tile.half && warpgroup == 2;
      MmaTile<Kind>(tile, smem, thread, idle, acc, it);
      if (!idle) StoreTile<Kind>(p, tile, smem, thread, acc);
    }
  }
#endif
}

}  // namespace mok::sm90
