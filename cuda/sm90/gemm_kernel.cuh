// The grouped expert GEMM kernel: warp-specialised (one producer warpgroup, two consumer
// warpgroups), TMA -> 4-stage mbarrier ring -> wgmma, then an epilogue. One CTA per tile.
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
  const GemmTile tile = ScheduleTile<Kind::kSched>(p);
  if (!tile.valid) return;  // a row block past the rows in use: uniform over the CTA

  extern __shared__ uint8_t smem_raw[];
  // 128-byte swizzling is a function of address bits 4-9: stages start 1024-byte aligned.
  GemmSmem& smem = *reinterpret_cast<GemmSmem*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int warpgroup = threadIdx.x / 128;
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

  if (warpgroup == 0) {
    SetMaxRegistersDec<C::kProducerRegs>();
    if (threadIdx.x == 0) LoadTile<Kind>(p, tile, smem);
  } else {
    SetMaxRegistersInc<C::kConsumerRegs>();
    const int thread = threadIdx.x - 128;
    auto acc = cute::partition_fragment_C(
        typename GemmLayouts<Kind>::TiledMma{},
        cute::Shape<cute::Int<C::kBlockM>, cute::Int<C::kBlockN>>{});
    MmaTile<Kind>(tile, smem, thread, acc);
    StoreTile<Kind>(p, tile, smem, thread, acc);
  }
#endif
}

}  // namespace mok::sm90
