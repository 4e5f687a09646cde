// Do the weights stream slower when read K-major? The SwiGLU backward reads w_down (E, I, H) as
// its B with K = H contiguous: a k-step of a 256-column tile is one TMA box of 256 rows x 128
// bytes, rows 14 KB apart, and the tile's next 128 bytes of each row come a k-step (about a
// microsecond) later. The forward reads w_gate (E, H, I) with N = I contiguous: 64 rows x 512
// bytes a k-step. dsv3's launches read HBM at about 3.5 TB/s (SwiGLU backward, K-major), 3.8
// (dx_r, K-major) and 4.0 (forward MLPs, MN-major) against 4.4-4.6 for a plain stream
// (docs/performance.md, What bounds dsv3). Here one CTA an SM reads dsv3's 7.5 GB of w_down in
// each pattern by TMA into a ring of 32 KB stages, a consumer thread releasing each stage
// `hold` ns after its bytes land (0: at once; about 1000 paces a CTA's k-steps as the kernels'
// MMAs do), tiles dealt out as the kernels' queue does (t = CTA, + grid, ...; eight column
// tiles of an expert side by side). Patterns (box inner x rows, a 32 KB box a stage):
//   kmajor64   (64 x 256, 128-byte swizzle): the SwiGLU backward's and dx_r's B today
//   kmajor128  (128 x 128): the same tile, 256 bytes of a row a box, two boxes a 128-deep step
//   kmajor256  (256 x 64): 512 bytes of a row a box, four boxes a 256-deep step
//   mnmajor    (256 x 64) over the same bytes seen as (E H, I): the forward's B
//   linear     (256 x 64) over the bytes seen as 256-wide rows: consecutive 32 KB
// Prints TB/s, the median of REPS (default 9) launches of each, taken in turn.
// Build: nvcc -std=c++17 -arch=sm_90a -O3 -Icuda/sm90 -o runs/probe/read_probe
//   tools/ab/read_probe.cu cuda/sm90/tensor_map.cc
// Run: runs/probe/read_probe [STAGES] (default 4)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "probe.cuh"
#include "ptx.cuh"
#include "tensor_map.h"

namespace {

using probe::Median;
namespace ptx = mok::sm90;

constexpr int64_t kE = 256, kI = 2048, kH = 7168;  // dsv3's w_down
constexpr int kTileN = 256;                          // a tile's B rows (K-major) or columns
constexpr int kStageBytes = 32 * 1024;
constexpr int kMaxStages = 6;

struct Pattern {
  const char* name;
  int box_inner, box_rows;
  bool swizzle;
  int kind;  // 0: K-major over (E I, H); 1: MN-major over (E H, I); 2: linear
};

// The boxes of CTA `cta`'s tiles in order; box b of the walk -> its (inner, row) origin.
struct Walk {
  int kind, box_inner, box_rows;
  int64_t tiles, boxes_per_tile;

  __device__ void Origin(int64_t tile, int64_t b, int32_t* c0, int32_t* c1) const {
    if (kind == 2) {  // consecutive boxes of a (rows, 256) view
      const int64_t box = tile * boxes_per_tile + b;
      *c0 = 0, *c1 = static_cast<int32_t>(box * box_rows);
      return;
    }
    const int64_t e = tile / (kI / kTileN), n = tile % (kI / kTileN);
    if (kind == 0) {  // rows n*256.. of expert e, K = H walked box_inner at a time
      const int per_k = kTileN / box_rows;
      *c0 = static_cast<int32_t>((b / per_k) * box_inner);
      *c1 = static_cast<int32_t>(e * kI + n * kTileN + (b % per_k) * box_rows);
    } else {  // columns n*256.. of expert e's (H, I), K = H walked box_rows at a time
      *c0 = static_cast<int32_t>(n * kTileN);
      *c1 = static_cast<int32_t>(e * kH + b * box_rows);
    }
  }
};

// Thread 0 issues, thread 32 consumes: waits for a stage's bytes, holds it `hold_ns`, frees it.
__global__ void __launch_bounds__(64) ReadKernel(const __grid_constant__ CUtensorMap map,
                                                Walk walk, int stages, int hold_ns,
                                                uint32_t* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) ptx::BarrierInit(&full[s], 1), ptx::BarrierInit(&empty[s], 1);
    ptx::FenceBarrierInit();
  }
  __syncthreads();
  const int64_t per_cta = (walk.tiles - blockIdx.x + gridDim.x - 1) / gridDim.x;
  const int64_t total = per_cta * walk.boxes_per_tile;
  if (threadIdx.x == 0) {
    for (int64_t i = 0; i < total; ++i) {
      const int s = static_cast<int>(i % stages);
      if (i >= stages) ptx::BarrierWait(&empty[s], static_cast<uint32_t>((i / stages - 1) & 1));
      const int64_t tile = blockIdx.x + (i / walk.boxes_per_tile) * gridDim.x;
      int32_t c0, c1;
      walk.Origin(tile, i % walk.boxes_per_tile, &c0, &c1);
      ptx::BarrierArriveExpectTx(&full[s], kStageBytes);
      ptx::TmaLoad2d(smem + s * kStageBytes, &map, &full[s], c0, c1);
    }
  } else if (threadIdx.x == 32) {
    uint32_t acc = 0;
    for (int64_t i = 0; i < total; ++i) {
      const int s = static_cast<int>(i % stages);
      ptx::BarrierWait(&full[s], static_cast<uint32_t>((i / stages) & 1));
      acc ^= *reinterpret_cast<const uint32_t*>(smem + s * kStageBytes + (i % 64) * 16);
      if (hold_ns > 0) {
        const uint64_t until = ptx::GlobalTimerNs() + hold_ns;
        while (ptx::GlobalTimerNs() < until) {
        }
      }
      ptx::BarrierArrive(&empty[s]);
    }
    if (acc == 0x9e3779b9u) *sink = acc;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int stages = argc > 1 ? std::atoi(argv[1]) : 4;
  const int reps = std::getenv("REPS") ? std::atoi(std::getenv("REPS")) : 9;
  if (stages < 1 || stages > kMaxStages) return std::fprintf(stderr, "stages 1-6\n"), 1;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t bytes = kE * kI * kH * 2;
  void* buf = nullptr;
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&buf, bytes));
  CHECK(cudaMemset(buf, 1, bytes));
  CHECK(cudaMalloc(&sink, 4));
  const Pattern patterns[] = {{"kmajor64", 64, 256, true, 0},
                              {"kmajor128", 128, 128, false, 0},
                              {"kmajor256", 256, 64, false, 0},
                              {"mnmajor", 256, 64, false, 1},
                              {"linear", 256, 64, false, 2}};
  const int smem = stages * kStageBytes;
  CHECK(cudaFuncSetAttribute(ReadKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::printf("read_probe: %.2f GB of bf16 (dsv3's w_down), %d CTAs, %d stages of 32 KB\n",
              bytes / 1e9, sms, stages);
  for (int hold : {0, 800, 1000, 1200}) {
    for (const Pattern& p : patterns) {
      CUtensorMap map;
      uint64_t inner = p.kind == 0 ? kH : p.kind == 1 ? kI : 256;
      uint64_t rows = bytes / 2 / inner;
      if (!mok::sm90::MakeTensorMap(&map, buf, inner, rows, p.box_inner, p.box_rows,
                                    p.swizzle ? CU_TENSOR_MAP_SWIZZLE_128B
                                              : CU_TENSOR_MAP_SWIZZLE_NONE)) {
        std::fprintf(stderr, "%s: tensor map refused\n", p.name);
        return 1;
      }
      Walk walk{p.kind, p.box_inner, p.box_rows, kE * (kI / kTileN),
                kE * kI * kH * 2 / kStageBytes / (kE * (kI / kTileN))};
      std::vector<float> ms;
      for (int r = 0; r <= reps; ++r) {
        CHECK(cudaEventRecord(a));
        ReadKernel<<<sms, 64, smem>>>(map, walk, stages, hold, sink);
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        CHECK(cudaGetLastError());
        float t;
        CHECK(cudaEventElapsedTime(&t, a, b));
        if (r > 0) ms.push_back(t);  // the first warms up
      }
      const float med = Median(ms);
      std::printf("hold %4d ns  %-10s box %3d x %3d  %7.3f ms  %5.2f TB/s\n", hold, p.name,
                  p.box_inner, p.box_rows, med, bytes / (med * 1e-3) / 1e12);
      std::fflush(stdout);
    }
  }
  return 0;
}
