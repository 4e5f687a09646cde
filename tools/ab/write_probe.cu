// A probe of how fast this GPU writes a buffer the size of dsv3's weight gradients (22.5 GB of
// bf16) through HBM, alone: a plain stream of 16-byte stores; the same bytes written as the
// weight gradients write them, 128 x 256 bf16 tiles (512-byte row pieces, a warp a piece) in
// three orders of the tiles; those tiles by TMA stores from shared memory as the weight
// gradients store them (a 128-thread CTA stages a 64-row half tile, 32 KB, one thread stores it
// in boxes of 32, 64 or 256 columns, and the slab is written again once the stores have read
// it), with one or two slabs a CTA and one to four CTAs an SM; and a device-to-device copy of
// half the bytes for a read-and-write stream. It says what the weight gradients' stores could
// take at best, and what their store path costs against plain stores (docs/performance.md,
// What bounds dsv3). With `mixed`, only the storers' TMA stores beside loads from L2 by TMA (2
// to 6 boxes in flight a CTA) or by plain loads, beside TMA loads on the other half of the SMs,
// and those loads alone (MixedKernel), and with the stores queueing at most 1, 2 or 4 boxes
// unread at their SM: what loads beside the stores cost both, and what the stores' queue costs
// the loads.
//
// Build (here or on the device): nvcc -std=c++17 -arch=sm_90a -O3 -Icuda/sm90 -o
//   runs/probe/write_probe tools/ab/write_probe.cu cuda/sm90/tensor_map.cc; run:
//   runs/probe/write_probe [COLS] [GB] [mixed] (default 7168, 22.5).
// Each figure is the median of REPS (default 15) launches, each after a launch of the same.
#include <algorithm>
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

constexpr int kTileRows = 128, kTileCols = 256;  // bf16: a row piece is 512 bytes, 32 uint4
constexpr int kThreads = 128;                    // a warpgroup a tile, as the weight gradients

enum Order { kAlongRows, kAlongColumns, kRunsOfEight };

__global__ void StreamKernel(uint4* out, int64_t n, uint32_t seed) {
  const uint4 v = make_uint4(seed, seed + 1, seed + 2, seed + 3);
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = v;
}

// Tile t of the (rows, cols) buffer, persistent CTAs taking t = blockIdx.x, + gridDim.x, ...:
// along rows, consecutive tiles are neighbours in a row band (consecutive CTAs write adjacent
// 512-byte pieces of the same rows); along columns, they go down one column of tiles; runs of
// eight take eight row tiles of one column tile, runs going along the row band (the weight
// gradients' order where experts are small: wgrad runs).
__global__ void TileKernel(uint4* out, int64_t row_tiles, int col_tiles, int64_t cols,
                           Order order, uint32_t seed) {
  const uint4 v = make_uint4(seed, seed + 1, seed + 2, seed + 3);
  const int64_t tiles = row_tiles * col_tiles;
  const int64_t pitch = cols / 8;  // uint4 a row
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    int64_t rt, ct;
    if (order == kAlongRows) {
      rt = t / col_tiles, ct = t % col_tiles;
    } else if (order == kAlongColumns) {
      rt = t % row_tiles, ct = t / row_tiles;
    } else {
      const int64_t run = t / 8, band = run / col_tiles;
      ct = run % col_tiles, rt = band * 8 + t % 8;
      if (rt >= row_tiles) continue;
    }
    uint4* base = out + rt * kTileRows * pitch + ct * (kTileCols / 8);
#pragma unroll 4
    for (int r = warp; r < kTileRows; r += kThreads / 32) base[r * pitch + lane] = v;
  }
}

// The tiles along the row band again, each half tile (64 rows, 32 KB) staged by 128 threads
// (a warpgroup: named barrier 1) into one of kSlabs slabs and stored by its first thread in
// (kBoxCols, 64) boxes, one bulk group a half tile; a slab is staged again once the group that
// read it last is done reading. kInFlight > 0: a bulk group a box instead, at most kInFlight
// of them unread when the next is issued (the stores a thread keeps queued at its SM). A CTA
// takes tiles first, first + stride, ... (persistent CTAs: blockIdx.x, gridDim.x).
template <int kBoxCols, int kSlabs, int kInFlight = 0>
__device__ __forceinline__ void StoreTiles(const CUtensorMap& map, int64_t row_tiles,
                                           int col_tiles, uint32_t seed, uint4* slabs,
                                           int thread, int64_t first, int64_t stride) {
  constexpr int kHalfRows = kTileRows / 2, kSlabUint4 = kHalfRows * kTileCols / 8;
  const int64_t tiles = row_tiles * col_tiles;
  const uint4 v = make_uint4(seed, seed + 1, seed + 2, seed + 3);
  int half = 0;
  for (int64_t t = first; t < tiles; t += stride) {
    const int64_t rt = t / col_tiles, ct = t % col_tiles;
    for (int h = 0; h < 2; ++h, ++half) {
      const int slab = half % kSlabs;
      if (thread == 0) {
        if constexpr (kInFlight > 0) {
          mok::sm90::BulkWaitRead<(kSlabs - 1) * kTileCols / kBoxCols>();
        } else {
          mok::sm90::BulkWaitRead<kSlabs - 1>();
        }
      }
      mok::sm90::NamedBarrierSync(1, kThreads);
      uint4* s = slabs + slab * kSlabUint4;
      for (int i = thread; i < kSlabUint4; i += kThreads) s[i] = v;
      mok::sm90::FenceProxyAsyncShared();
      mok::sm90::NamedBarrierSync(1, kThreads);
      if (thread == 0) {
        const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(s));
        for (int c = 0; c < kTileCols; c += kBoxCols) {
          if constexpr (kInFlight > 0) mok::sm90::BulkWaitRead<kInFlight - 1>();
          mok::sm90::TmaStore2d(&map, base + c * kHalfRows * 2,
                                static_cast<int32_t>(ct * kTileCols + c),
                                static_cast<int32_t>(rt * kTileRows + h * kHalfRows));
          if constexpr (kInFlight > 0) mok::sm90::BulkCommitGroup();
        }
        if constexpr (kInFlight == 0) mok::sm90::BulkCommitGroup();
      }
    }
  }
  if (thread == 0) mok::sm90::BulkWaitAll();
}

template <int kBoxCols, int kSlabs>
__global__ void __launch_bounds__(kThreads)
    TmaTileKernel(const __grid_constant__ CUtensorMap map, int64_t row_tiles, int col_tiles,
                  uint32_t seed) {
  extern __shared__ __align__(1024) uint4 slabs[];
  StoreTiles<kBoxCols, kSlabs>(map, row_tiles, col_tiles, seed, slabs, threadIdx.x, blockIdx.x,
                               gridDim.x);
}

// The weight gradients' stores (StoreTiles<32, 2>: two slabs, (32, 64) boxes) by warpgroup 0,
// beside loads by warpgroup 1 of an L2-resident bf16 matrix (7168 columns, as dsv3's xs), 48 KB
// in flight: kLoads 1, TMA boxes of (64, 64) x 2 panels (16 KB, as the runs' A k-steps), three
// in flight from one thread, each reissued once its mbarrier says it landed; kLoads 2, 16-byte
// ld.global.cg by all 128 threads, 24 each, then waited for. The loads run until the stores are
// done and at least `min_samples` have been taken; stats[0..2] += their bytes, the samples (a
// TMA box; a round of the 24 plain loads) and the samples' latency (ns, issue to data). Says
// whether loads beside the stores wait behind them, and by which path less; with no rows to
// store, how the loads fare alone. kSplit: the even CTAs only store (all the tiles between
// them) and the odd ones only load, until every storing CTA is done (`storing` counts them
// down): whether loads on other SMs than the stores wait as long as loads on the same SMs,
// i.e. whether what slows them is the SM's own path (its TMA unit, its port to the memory
// system) or the memory system that all SMs share.
constexpr int kSrcCols = 7168;        // MixedKernel's source matrix: dsv3's xs rows
constexpr uint32_t kLoadBox = 16384;  // its TMA boxes: (64, 64) x 2 panels of bf16

__global__ void SetKernel(int* at, int value) { *at = value; }

// kLoads 1 with kInFlight boxes in flight (at most kMaxInFlight) of kBoxPanels panels (8 KB
// each; src_one: the map of one-panel boxes).
constexpr int kMaxInFlight = 6;
template <int kLoads, bool kSplit = false, int kInFlight = 3, int kBoxPanels = 2,
          int kStoresInFlight = 0>
__global__ void __launch_bounds__(2 * kThreads)
    MixedKernel(const __grid_constant__ CUtensorMap out, const __grid_constant__ CUtensorMap src,
                const __grid_constant__ CUtensorMap src_one, const uint4* src_plain,
                int64_t src_rows, int64_t row_tiles, int col_tiles, int64_t min_samples,
                uint32_t seed, unsigned long long* stats, int* storing) {
  extern __shared__ __align__(1024) uint4 smem[];
  constexpr int kSlabUint4 = kTileRows / 2 * kTileCols / 8;  // 32 KB
  constexpr int kRound = 24 * kThreads;  // uint4 of a plain round
  uint4* ring = smem + 2 * kSlabUint4;
  static_assert(kInFlight <= kMaxInFlight && (kBoxPanels == 1 || kBoxPanels == 2));
  __shared__ uint64_t full[kMaxInFlight];
  __shared__ volatile int done, stop[2];
  if (threadIdx.x == 0) {
    done = 0;
    for (auto& f : full) mok::sm90::BarrierInit(&f, 1);
    mok::sm90::FenceBarrierInit();
  }
  __syncthreads();
  const bool stores = !kSplit || blockIdx.x % 2 == 0;
  if (threadIdx.x < kThreads) {
    if (!stores) return;
    if (kSplit) {
      StoreTiles<32, 2>(out, row_tiles, col_tiles, seed, smem, threadIdx.x, blockIdx.x / 2,
                        gridDim.x / 2);
      if (threadIdx.x == 0) atomicSub(storing, 1);
    } else {
      StoreTiles<32, 2, kStoresInFlight>(out, row_tiles, col_tiles, seed, smem, threadIdx.x,
                                         blockIdx.x, gridDim.x);
    }
    if (threadIdx.x == 0) done = 1;
    return;
  }
  if (kLoads == 0 || (kSplit && stores)) return;
  // kSplit: this CTA stores nothing; it loads until the storing CTAs are done.
  auto stores_done = [&] {
    return kSplit ? *static_cast<volatile int*>(storing) <= 0 : done != 0;
  };
  const int thread = threadIdx.x - kThreads;
  unsigned long long bytes = 0, samples = 0, latency = 0;
  if (kLoads == 1) {
    if (thread != 0) return;
    constexpr uint32_t kBox = kLoadBox / 2 * kBoxPanels;
    const int64_t panels = kSrcCols / 64 - 1, rows = src_rows - 64;
    uint64_t issued[kInFlight];
    int64_t n = 0;
    for (;; ++n) {
      const int slot = static_cast<int>(n % kInFlight);
      if (n >= kInFlight) {  // load n - kInFlight used this slot
        mok::sm90::BarrierWait(&full[slot], ((n - kInFlight) / kInFlight) & 1);
        latency += mok::sm90::GlobalTimerNs() - issued[slot];
        bytes += kBox, ++samples;
        if (stores_done() && static_cast<int64_t>(samples) >= min_samples) break;
      }
      mok::sm90::BarrierArriveExpectTx(&full[slot], kBox);
      mok::sm90::TmaLoad3d(ring + slot * (kLoadBox / 16), kBoxPanels == 2 ? &src : &src_one,
                           &full[slot], 0, static_cast<int32_t>((n * 64 + blockIdx.x * 8) % rows),
                           static_cast<int32_t>((n * 7 + blockIdx.x) % panels));
      issued[slot] = mok::sm90::GlobalTimerNs();
    }
    for (int64_t m = n - (kInFlight - 1); m < n; ++m)
      mok::sm90::BarrierWait(&full[m % kInFlight], (m / kInFlight) & 1);
  } else {
    const int64_t span = src_rows * kSrcCols / 8 - kRound;
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int64_t n = 0;; ++n) {
      const uint64_t t0 = mok::sm90::GlobalTimerNs();
      const uint4* base = src_plain + (n * kRound + blockIdx.x * 4096) % span + thread;
      uint4 v[24];
#pragma unroll
      for (int i = 0; i < 24; ++i) {
        asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[i].x), "=r"(v[i].y), "=r"(v[i].z), "=r"(v[i].w)
                     : "l"(base + i * kThreads));
      }
#pragma unroll
      for (int i = 0; i < 24; ++i) {
        acc.x ^= v[i].x, acc.y ^= v[i].y, acc.z ^= v[i].z, acc.w ^= v[i].w;
      }
      // Thread 0 decides for the warpgroup whether this round was the last (stop[n % 2]).
      if (thread == 0) stop[n % 2] = stores_done() && n + 1 >= min_samples;
      mok::sm90::NamedBarrierSync(2, kThreads);
      latency += mok::sm90::GlobalTimerNs() - t0;
      bytes += kRound * 16, ++samples;
      if (stop[n % 2]) break;
    }
    if (acc.x == 0x12345678u && acc.y == seed) stats[3] = acc.z;  // keeps the loads
  }
  if (thread == 0) {
    atomicAdd(stats + 0, bytes);
    atomicAdd(stats + 1, samples);
    atomicAdd(stats + 2, latency);
  }
}

// The same half tiles in two (128 columns, 64 rows) boxes of a 4D view of the buffer, (64
// columns of a panel, 8 rows, 2 panels, 8 row groups), whose shared-memory rows lie 128 bytes
// apart in the 128-byte swizzle: each 8 x 8 matrix of stmatrix would meet 32 banks, where the
// (128, 64) boxes' 256-byte rows meet 16. The global writes go 8 rows of one panel, then of the
// next: whether HBM takes them at the rate of (128, 64) boxes is what this measures.
__device__ __forceinline__ void TmaStore4d(const CUtensorMap* map, uint32_t src, int32_t c0,
                                           int32_t c1, int32_t c2, int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__global__ void __launch_bounds__(kThreads)
    Tma4dTileKernel(const __grid_constant__ CUtensorMap map, int64_t row_tiles, int col_tiles,
                    uint32_t seed) {
  extern __shared__ __align__(1024) uint4 slabs[];
  constexpr int kHalfRows = kTileRows / 2, kSlabUint4 = kHalfRows * kTileCols / 8;
  const int64_t tiles = row_tiles * col_tiles;
  const uint4 v = make_uint4(seed, seed + 1, seed + 2, seed + 3);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t rt = t / col_tiles, ct = t % col_tiles;
    for (int h = 0; h < 2; ++h) {
      if (threadIdx.x == 0) mok::sm90::BulkWaitRead<0>();
      __syncthreads();
      for (int i = threadIdx.x; i < kSlabUint4; i += kThreads) slabs[i] = v;
      mok::sm90::FenceProxyAsyncShared();
      __syncthreads();
      if (threadIdx.x == 0) {
        const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(slabs));
        const int32_t group = static_cast<int32_t>((rt * kTileRows + h * kHalfRows) / 8);
        for (int b = 0; b < 2; ++b)
          TmaStore4d(&map, base + b * kHalfRows * 128 * 2, 0, 0,
                     static_cast<int32_t>(ct * 4 + 2 * b), group);
        mok::sm90::BulkCommitGroup();
      }
    }
  }
  if (threadIdx.x == 0) mok::sm90::BulkWaitAll();
}

bool Make4dMap(CUtensorMap* map, void* base, int64_t cols, int64_t rows) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                       &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess)
    return false;
  auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  cuuint64_t dims[4] = {64, 8, static_cast<cuuint64_t>(cols / 64),
                        static_cast<cuuint64_t>(rows / 8)};
  cuuint64_t strides[3] = {static_cast<cuuint64_t>(cols * 2), 128,
                           static_cast<cuuint64_t>(cols * 2 * 8)};
  cuuint32_t box[4] = {64, 8, 2, 8}, element_strides[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, base, dims, strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}


template <class Launch>
float TimeMs(Launch launch, int reps) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    launch(2 * i);  // the one before, so that each timed launch follows a busy GPU
    CHECK(cudaEventRecord(a));
    launch(2 * i + 1);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  return Median(ms);
}

// MixedKernel's variants: the stores alone, beside TMA loads and beside plain loads; and each
// kind of load alone.
void Mixed(void* buf, int64_t rows, int64_t cols, int64_t row_tiles, int col_tiles, int sms,
           int reps) {
  constexpr int64_t kSrcRows = 256;  // 3.7 MB: stays in L2
  void* src;
  unsigned long long* stats;
  CHECK(cudaMalloc(&src, kSrcRows * kSrcCols * 2));
  CHECK(cudaMemset(src, 0x3c, kSrcRows * kSrcCols * 2));
  CHECK(cudaMalloc(&stats, 4 * sizeof(unsigned long long)));
  int* storing;
  CHECK(cudaMalloc(&storing, sizeof(int)));
  CUtensorMap out, in, in_one;
  if (!mok::sm90::MakeTensorMap(&out, buf, cols, rows, 32, 64, CU_TENSOR_MAP_SWIZZLE_64B) ||
      !mok::sm90::MakePanelMap(&in, src, kSrcCols, kSrcRows, 64, 2) ||
      !mok::sm90::MakePanelMap(&in_one, src, kSrcCols, kSrcRows, 64, 1)) {
    std::fprintf(stderr, "no tensor maps for the mixed probe\n");
    std::exit(1);
  }
  const int smem = 2 * kTileRows / 2 * kTileCols * 2 + kMaxInFlight * kLoadBox;
  auto run = [&](auto kernel, const char* what, int64_t tiles, int64_t min_samples) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK(cudaMemset(stats, 0, 4 * sizeof(unsigned long long)));
    const int storers = sms / 2;  // kSplit's storing CTAs (the even ones of sms)
    const float ms = TimeMs([&](int i) {
      SetKernel<<<1, 1>>>(storing, storers);
      kernel<<<sms, 2 * kThreads, smem>>>(out, in, in_one, static_cast<const uint4*>(src),
                                          kSrcRows, tiles, col_tiles, min_samples, i, stats,
                                          storing);
    }, reps);
    unsigned long long s[3];
    CHECK(cudaMemcpy(s, stats, sizeof s, cudaMemcpyDeviceToHost));
    const double launches = 2.0 * reps;
    const double stored = tiles * col_tiles * kTileRows * kTileCols * 2.0;
    std::printf("  %-52s %8.3f ms  stores %5.2f TB/s  loads %5.2f TB/s, %6.2f us a sample\n",
                what, ms, stored / ms / 1e9, s[0] / launches / ms / 1e9,
                s[1] ? s[2] / 1e3 / s[1] : 0.0);
  };
  run(MixedKernel<0>, "TMA stores alone (two slabs, (32, 64) boxes)", row_tiles, 0);
  run(MixedKernel<1>, "  beside TMA loads, 3 x 16 KB in flight", row_tiles, 0);
  run(MixedKernel<2>, "  beside ld.global.cg, 48 KB in flight", row_tiles, 0);
  run(MixedKernel<1>, "TMA loads alone", 0, 30000);
  run(MixedKernel<2>, "ld.global.cg alone", 0, 10000);
  run(MixedKernel<1, false, 6>, "  beside TMA loads, 6 x 16 KB in flight", row_tiles, 0);
  run(MixedKernel<1, false, 6, 1>, "  beside TMA loads, 6 x 8 KB in flight", row_tiles, 0);
  run(MixedKernel<1, false, 2>, "  beside TMA loads, 2 x 16 KB in flight", row_tiles, 0);
  run(MixedKernel<1, false, 6>, "TMA loads alone, 6 x 16 KB in flight", 0, 60000);
  run(MixedKernel<0, false, 3, 2, 2>, "TMA stores alone, at most 2 boxes unread", row_tiles, 0);
  run(MixedKernel<1, false, 3, 2, 2>, "  beside TMA loads, 3 x 16 KB in flight", row_tiles, 0);
  run(MixedKernel<0, false, 3, 2, 4>, "TMA stores alone, at most 4 boxes unread", row_tiles, 0);
  run(MixedKernel<1, false, 3, 2, 4>, "  beside TMA loads, 3 x 16 KB in flight", row_tiles, 0);
  run(MixedKernel<0, false, 3, 2, 1>, "TMA stores alone, at most 1 box unread", row_tiles, 0);
  run(MixedKernel<1, false, 3, 2, 1>, "  beside TMA loads, 3 x 16 KB in flight", row_tiles, 0);
  run(MixedKernel<0, true>, "TMA stores alone, on the even half of the SMs", row_tiles, 0);
  run(MixedKernel<1, true>, "  beside TMA loads on the odd half, 3 x 16 KB in flight", row_tiles,
      0);
  CHECK(cudaFree(src));
  CHECK(cudaFree(stats));
  CHECK(cudaFree(storing));
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t cols = argc > 1 ? std::atoll(argv[1]) : 7168;
  const double gb = argc > 2 ? std::atof(argv[2]) : 22.5;
  const int reps = std::getenv("REPS") ? std::atoi(std::getenv("REPS")) : 15;
  if (cols % kTileCols) {
    std::fprintf(stderr, "COLS must be a multiple of %d\n", kTileCols);
    return 1;
  }
  const int64_t row_tiles = static_cast<int64_t>(gb * 1e9 / 2 / cols / kTileRows);
  const int64_t rows = row_tiles * kTileRows;
  const int64_t bytes = rows * cols * 2;
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint4* buf;
  CHECK(cudaMalloc(&buf, bytes));
  std::printf("write_probe: %lld x %lld bf16 (%.2f GB), %d SMs, median of %d launches\n",
              static_cast<long long>(rows), static_cast<long long>(cols), bytes / 1e9, sms, reps);
  auto report = [&](const char* what, float ms, double moved) {
    std::printf("  %-70s %8.3f ms  %6.2f TB/s\n", what, ms, moved / ms / 1e9);
  };
  const int col_tiles = static_cast<int>(cols / kTileCols);
  if (argc > 3 && std::string(argv[3]) == "mixed") {
    Mixed(buf, rows, cols, row_tiles, col_tiles, sms, reps);
    CHECK(cudaFree(buf));
    return 0;
  }
  const int64_t n16 = bytes / 16;
  for (int per_sm : {4, 16}) {
    const float ms = TimeMs([&](int i) {
      StreamKernel<<<sms * per_sm, 256, 0>>>(buf, n16, i);
    }, reps);
    char what[64];
    std::snprintf(what, sizeof what, "stream, 16-byte stores, %d CTAs an SM", per_sm);
    report(what, ms, bytes);
  }
  const struct { Order order; const char* name; } orders[] = {
      {kAlongRows, "tiles along the row band"},
      {kAlongColumns, "tiles down the columns"},
      {kRunsOfEight, "runs of eight row tiles, along the band"}};
  for (int per_sm : {2, 4}) {
    for (const auto& o : orders) {
      const float ms = TimeMs([&](int i) {
        TileKernel<<<sms * per_sm, kThreads, 0>>>(buf, row_tiles, col_tiles, cols, o.order, i);
      }, reps);
      char what[96];
      std::snprintf(what, sizeof what, "%s, %d tiles at once an SM", o.name, per_sm);
      report(what, ms, bytes);
    }
  }
  auto swizzle_name = [](CUtensorMapSwizzle s) {
    return s == CU_TENSOR_MAP_SWIZZLE_64B ? "64B" : s == CU_TENSOR_MAP_SWIZZLE_128B ? "128B"
                                                                                  : "none";
  };
  auto tma = [&](auto kernel, int box_cols, int slabs, CUtensorMapSwizzle swizzle) {
    CUtensorMap map;
    if (!mok::sm90::MakeTensorMap(&map, buf, cols, rows, box_cols, 64, swizzle)) {
      std::fprintf(stderr, "no tensor map for boxes of %d columns\n", box_cols);
      std::exit(1);
    }
    const int smem = slabs * kTileRows / 2 * kTileCols * 2;
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    for (int per_sm : {1, 2, 4}) {
      if (per_sm * (smem + 1024) > 227 * 1024) continue;
      const float ms = TimeMs([&](int i) {
        kernel<<<sms * per_sm, kThreads, smem>>>(map, row_tiles, col_tiles, i);
      }, reps);
      char what[96];
      std::snprintf(what, sizeof what, "TMA, (%d, 64) boxes, swizzle %s, %d slab(s), %d CTAs an SM",
                    box_cols, swizzle_name(swizzle), slabs, per_sm);
      report(what, ms, bytes);
    }
  };
  // Swizzles a box width allows (a box row must fit in the swizzle's span; a 64-byte row in
  // the 128-byte swizzle would take 128 bytes of shared memory, more than the slab).
  tma(TmaTileKernel<32, 1>, 32, 1, CU_TENSOR_MAP_SWIZZLE_64B);  // the weight gradients' boxes
  tma(TmaTileKernel<32, 2>, 32, 2, CU_TENSOR_MAP_SWIZZLE_64B);
  tma(TmaTileKernel<32, 1>, 32, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
  tma(TmaTileKernel<64, 1>, 64, 1, CU_TENSOR_MAP_SWIZZLE_128B);
  tma(TmaTileKernel<64, 2>, 64, 2, CU_TENSOR_MAP_SWIZZLE_128B);
  tma(TmaTileKernel<64, 1>, 64, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
  tma(TmaTileKernel<128, 1>, 128, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
  tma(TmaTileKernel<256, 1>, 256, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
  tma(TmaTileKernel<256, 2>, 256, 2, CU_TENSOR_MAP_SWIZZLE_NONE);
  {
    CUtensorMap map;
    if (!Make4dMap(&map, buf, cols, rows)) {
      std::fprintf(stderr, "no 4D tensor map\n");
      return 1;
    }
    const int smem = kTileRows / 2 * kTileCols * 2;
    CHECK(cudaFuncSetAttribute(Tma4dTileKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               smem));
    for (int per_sm : {1, 2, 4}) {
      const float ms = TimeMs([&](int i) {
        Tma4dTileKernel<<<sms * per_sm, kThreads, smem>>>(map, row_tiles, col_tiles, i);
      }, reps);
      char what[96];
      std::snprintf(what, sizeof what, "TMA, 4D (64, 8, 2, 8) boxes, swizzle 128B, %d CTAs an SM",
                    per_sm);
      report(what, ms, bytes);
    }
  }
  const int64_t half = bytes / 2;
  const float ms = TimeMs([&](int) {
    CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(buf) + half, buf, half,
                          cudaMemcpyDeviceToDevice));
  }, reps);
  report("copy of half (read + write, both counted)", ms, bytes);
  CHECK(cudaFree(buf));
  return 0;
}
