// A probe of the GEMM mainloop alone, outside the layer: dense C = A B (A K-major, B MN-major in
// 64-column panels, as the forward's x and weights lie) with a SwiGLU epilogue stored from
// registers (h = silu(g) * u, g and u the tile's two column halves), persistent CTAs of one
// producer warpgroup (one thread issuing TMA) and two consumer warpgroups, for three tiles:
// 128 x 256 in 4 stages (the forward's: a warpgroup m64n256), 256 x 192 in 3 and in 4 stages (a
// warpgroup 2 x m64n192, 192 f32 accumulators a thread at setmaxnreg 232: no spills). It checks
// 64 outputs against a host dot product and prints TFLOP/s over REPS (default 50) launches; the
// same mainloops without the epilogue follow (their outputs are not checked).
//
// Build here (CUDA compiles on the build machine; run the binary on the device):
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 --expt-relaxed-constexpr \
//     -I$CUTLASS/include -Icuda/sm90 -Icuda -o runs/probe/tile_probe tools/ab/tile_probe.cu \
//     cuda/sm90/tensor_map.cc
// (CUTLASS: the nvidia-cutlass wheel's cutlass_library/source); then on the device, carrying
// runs/probe: runs/probe/tile_probe M N K (default 8448 3072 2880; M a multiple of 256, N of 768).
//
// NOTES: one H200, 2026-12-01 00:00 UTC (results/h200/h200_tile_probe.txt), TFLOP/s of
// 128 x 256 / 256 x 192 in 3 stages / in 4: M 8448, K 2880, N 3072: 663 / 651 / 672; N 6144:
// 667 / 663 / 680, and over 2000 launches back to back (the power limit) 554 / 573 / 581; K 7168,
// N 3072: 725 / 729 / 744. All outputs checked within bf16 rounding. 2026-12-01 00:47 UTC, 128
// x 256 without its epilogue: 798 (N 6144, K 2880), 763 (K 8192), 770-801 (N 3072, K 7168).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cmath>
#include <cute/tensor.hpp>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "epilogue.cuh"  // Silu, and through it the layer's PTX wrappers and bf16_t
#include "tensor_map.h"
using namespace cute;
using namespace mok::sm90;

template <int BM, int BN, int STAGES>
struct Cfg {
  static constexpr int BK = 64, WG_ROWS = BM / 2;
  using SmemA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<Int<BM>, Int<BK>, Int<STAGES>>{}));
  using SmemB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16_t>{}, Shape<Int<BN>, Int<BK>, Int<STAGES>>{}, Step<_2, _1, _3>{}));
  using Op = std::conditional_t<BN == 256, SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>,
                                SM90_64x192x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>>;
  struct alignas(1024) Smem {
    bf16_t a[STAGES][BM * BK];
    bf16_t b[STAGES][BN * BK];
    uint64_t full[STAGES], empty[STAGES];
  };
};

// Tile t: row tile t % row_tiles, column tile t / row_tiles (the CTAs busy at once share B).
template <int BM, int BN, int STAGES, bool kStore>
__global__ void __launch_bounds__(384, 1)
    Probe(__nv_bfloat16* h, int n_h, int row_tiles, int tiles, int num_k,
          const __grid_constant__ CUtensorMap amap, const __grid_constant__ CUtensorMap bmap) {
  using C = Cfg<BM, BN, STAGES>;
  extern __shared__ uint8_t raw[];
  auto& smem = *reinterpret_cast<typename C::Smem*>(raw);
  if (threadIdx.x == 0) for (int s = 0; s < STAGES; ++s) { BarrierInit(&smem.full[s], 1); BarrierInit(&smem.empty[s], 2); }
  FenceBarrierInit();
  __syncthreads();
  uint32_t it = 0;
  if (threadIdx.x >= 256) {
    SetMaxRegistersDec<40>();
    if (threadIdx.x != 256) return;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x)
      for (int kt = 0; kt < num_k; ++kt, ++it) {
        const int s = it % STAGES;
        BarrierWait(&smem.empty[s], ((it / STAGES) & 1) ^ 1);
        BarrierArriveExpectTx(&smem.full[s], (BM + BN) * C::BK * 2);
        TmaLoad2d(smem.a[s], &amap, &smem.full[s], kt * C::BK, (t % row_tiles) * BM);
        TmaLoad3d(smem.b[s], &bmap, &smem.full[s], 0, kt * C::BK, (t / row_tiles) * (BN / 64));
      }
    return;
  }
  SetMaxRegistersInc<232>();
  const int wg = threadIdx.x / 128, wt = threadIdx.x % 128;
  Tensor sA = make_tensor(make_smem_ptr(&smem.a[0][0]), typename C::SmemA{});
  Tensor sB = make_tensor(make_smem_ptr(&smem.b[0][0]), typename C::SmemB{});
  Tensor sAw = logical_divide(sA, make_tile(Layout<Int<C::WG_ROWS>>{}))(make_coord(_, wg), _, _);
  auto mma = make_tiled_mma(typename C::Op{});
  auto thr = mma.get_thread_slice(wt);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sAw));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor cC = thr.partition_C(make_identity_tensor(Shape<Int<C::WG_ROWS>, Int<BN>>{}));
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    auto acc = partition_fragment_C(mma, Shape<Int<C::WG_ROWS>, Int<BN>>{});
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    int previous = 0;
    for (int kt = 0; kt < num_k; ++kt, ++it) {
      const int s = it % STAGES;
      BarrierWait(&smem.full[s], (it / STAGES) & 1);
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        gemm(mma, tCrA(_, _, kb, s), tCrB(_, _, kb, s), acc);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc);
      if (kt > 0 && wt == 0) BarrierArrive(&smem.empty[previous]);
      previous = s;
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    if (wt == 0) BarrierArrive(&smem.empty[previous]);
    const int64_t row0 = int64_t(t % row_tiles) * BM + wg * C::WG_ROWS;
    const int col0 = (t / row_tiles) * (BN / 2);
    if constexpr (!kStore) {
      // No epilogue: the mainloop alone. One value of each wgmma atom's accumulators, so that
      // every atom's MMAs stay needed (with acc(0, 0, 0) alone, 256 x 192 printed 1300 TFLOP/s,
      // above the peak, on 2026-12-01).
      float keep = 0.0f;
      CUTE_UNROLL
      for (int m = 0; m < size<1>(acc); ++m) keep += acc(0, m, 0);
      if (t == 0 && wt == 0) h[wg] = __float2bfloat16_rn(keep);
    } else {
      CUTE_UNROLL
      for (int m = 0; m < size<1>(acc); ++m)
        CUTE_UNROLL
        for (int v = 0; v < size<0>(acc) / 2; ++v) {
          auto [r, c] = cC(v, m, 0);
          const float g = acc(v, m, 0), u = acc(v + size<0>(acc) / 2, m, 0);
          h[(row0 + r) * n_h + col0 + c] = __float2bfloat16_rn(Silu(g) * u);
        }
    }
  }
}

static float bf(const __nv_bfloat16& x) { return __bfloat162float(x); }

template <int BM, int BN, int STAGES, bool kStore = true>
void Run(const char* name, int M, int N, int K, __nv_bfloat16* a, __nv_bfloat16* b, __nv_bfloat16* h,
         const std::vector<__nv_bfloat16>& ha, const std::vector<__nv_bfloat16>& hb, int sms) {
  using C = Cfg<BM, BN, STAGES>;
  CUtensorMap amap, bmap;
  if (!MakeTensorMap(&amap, a, K, M, 64, BM, CU_TENSOR_MAP_SWIZZLE_128B) ||
      !MakePanelMap(&bmap, b, N, K, 64, BN / 64)) { printf("%s: tensor maps failed\n", name); return; }
  const int row_tiles = M / BM, tiles = row_tiles * (N / BN), num_k = K / 64;
  const int smem = sizeof(typename C::Smem);
  auto kernel = Probe<BM, BN, STAGES, kStore>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaMemset(h, 0, size_t(M) * (N / 2) * 2);
  kernel<<<sms, 384, smem>>>(h, N / 2, row_tiles, tiles, num_k, amap, bmap);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(e)); exit(1); }
  std::vector<__nv_bfloat16> hh(size_t(M) * (N / 2));
  cudaMemcpy(hh.data(), h, hh.size() * 2, cudaMemcpyDeviceToHost);
  double worst = kStore ? 0 : NAN;  // without the epilogue nothing to check
  for (int i = 0; kStore && i < 64; ++i) {
    const int r = (i * 7919) % M, c = (i * 104729) % (N / 2);
    const int tile_n = c / (BN / 2), cc = c % (BN / 2);
    double g = 0, u = 0;
    for (int k = 0; k < K; ++k) {
      g += bf(ha[size_t(r) * K + k]) * bf(hb[size_t(k) * N + tile_n * BN + cc]);
      u += bf(ha[size_t(r) * K + k]) * bf(hb[size_t(k) * N + tile_n * BN + BN / 2 + cc]);
    }
    const double want = g / (1 + std::exp(-g)) * u, got = bf(hh[size_t(r) * (N / 2) + c]);
    worst = std::fmax(worst, std::fabs(got - want) / (std::fabs(want) + 1e-2));
  }
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int i = 0; i < 5; ++i) kernel<<<sms, 384, smem>>>(h, N / 2, row_tiles, tiles, num_k, amap, bmap);
  const int reps = getenv("REPS") ? atoi(getenv("REPS")) : 50;
  cudaEventRecord(e0);
  for (int i = 0; i < reps; ++i) kernel<<<sms, 384, smem>>>(h, N / 2, row_tiles, tiles, num_k, amap, bmap);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  ms /= reps;
  printf("%-32s M %d N %d K %d: %d tiles, smem %d B, %.4f ms, %.1f TFLOP/s, worst rel err %.3g\n", name, M, N, K,
         tiles, smem, ms, 2.0 * M * N * K / ms / 1e9, worst);
}

int main(int argc, char** argv) {
  const int M = argc > 1 ? atoi(argv[1]) : 8448, N = argc > 2 ? atoi(argv[2]) : 3072, K = argc > 3 ? atoi(argv[3]) : 2880;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  std::vector<__nv_bfloat16> ha(size_t(M) * K), hb(size_t(K) * N);
  srand(1);
  for (auto& x : ha) x = __float2bfloat16((rand() % 2001 - 1000) / 1000.0f);
  for (auto& x : hb) x = __float2bfloat16((rand() % 2001 - 1000) / 30000.0f);
  __nv_bfloat16 *a, *b, *h;
  cudaMalloc(&a, ha.size() * 2); cudaMalloc(&b, hb.size() * 2); cudaMalloc(&h, size_t(M) * (N / 2) * 2);
  cudaMemcpy(a, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(b, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice);
  for (int round = 0; round < 2; ++round) {
    Run<128, 256, 4>("128x256, 4 stages", M, N, K, a, b, h, ha, hb, sms);
    Run<256, 192, 3>("256x192, 3 stages", M, N, K, a, b, h, ha, hb, sms);
    Run<256, 192, 4>("256x192, 4 stages", M, N, K, a, b, h, ha, hb, sms);
    Run<128, 256, 4, false>("128x256, 4 stages, no epilogue", M, N, K, a, b, h, ha, hb, sms);
    Run<256, 192, 4, false>("256x192, 4 stages, no epilogue", M, N, K, a, b, h, ha, hb, sms);
  }
  return 0;
}
