// Host side of a grouped GEMM launch: TMA descriptors for the operands, grid, shared memory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>

#include "gemm_kernel.cuh"
#include "heuristics.cuh"
#include "shared_memory.h"
#include "tensor_map.h"

namespace mok::sm90 {

// A row-major bf16 matrix (rows, inner) in device memory.
struct Matrix {
  const void* base;
  int64_t inner;
  int64_t rows;
};

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline const char* Check(cudaError_t e) {
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// K-major operands are read in (64, box_rows) boxes; MN-major ones in one box of box_rows / 64
// panels of (64, block_k), one TMA for all of them (their width must be a multiple of 64).
inline bool Describe(CUtensorMap* map, const Matrix& m, bool k_major, int box_rows, int block_k) {
  if (k_major) return MakeTensorMap(map, m.base, m.inner, m.rows, GemmConfig::kBoxInner, box_rows);
  return MakePanelMap(map, m.base, m.inner, m.rows, block_k, box_rows / GemmConfig::kBoxInner);
}

// The fields that place a GEMM's rows: the groups of `offsets` (null: one group of m rows), of
// which the launch choices expect m_expected <= m to be used.
inline GemmParams RowGroups(const int32_t* offsets, int block_m, int groups, int64_t m,
                            int64_t m_expected) {
  GemmParams p{};
  p.offsets = offsets, p.block_m = block_m, p.groups = groups, p.m_total = m;
  p.m_expected = m_expected;
  return p;
}

// Fills in what `p` lacks for a GEMM of `Kind`: the tensor maps (b1 only if UsesB1), tile
// counts and order.
template <class Kind>
const char* PrepareGemm(GemmParams& p, const Matrix& a, const Matrix& b0, const Matrix& b1) {
  using C = GemmConfig;
  const bool uses_b1 = UsesB1<Kind>(p);
  // kSwiGLU's B is two halves, w_gate's and w_up's columns of the tile.
  const int b_cols = Kind::kEpi == Epilogue::kSwiGLU && !Kind::kKMajorB ? C::kBlockN / 2
                                                                         : C::kBlockN;
  if ((!Kind::kKMajorA && a.inner % C::kBoxInner != 0) ||
      (!Kind::kKMajorB && (b0.inner % C::kBoxInner != 0 ||
                           (uses_b1 && b1.inner % C::kBoxInner != 0))))
    return "an MN-major GEMM operand's width must be a multiple of 64";
  if (!Describe(&p.a, a, Kind::kKMajorA, C::kBlockM, Kind::kBlockK) ||
      !Describe(&p.b0, b0, Kind::kKMajorB, b_cols, Kind::kBlockK) ||
      (uses_b1 && !Describe(&p.b1, b1, Kind::kKMajorB, b_cols, Kind::kBlockK))) {
    return "cuTensorMapEncodeTiled refused a GEMM operand";
  }
  if (Kind::kSched == Schedule::kRowsByGroup &&
      (!Describe(&p.a_half, a, Kind::kKMajorA, C::kBlockM / 2, Kind::kBlockK) ||
       !Describe(&p.b0_half, b0, Kind::kKMajorB, b_cols / 2, Kind::kBlockK) ||
       (uses_b1 && !Describe(&p.b1_half, b1, Kind::kKMajorB, b_cols / 2, Kind::kBlockK)))) {
    return "cuTensorMapEncodeTiled refused a GEMM operand";
  }
  if (Kind::kTail && p.offsets && p.row_tokens &&
      !Describe(&p.a_tail, a, Kind::kKMajorA, kTailRows, Kind::kBlockK)) {
    return "cuTensorMapEncodeTiled refused a GEMM operand";
  }
  if constexpr (Kind::kTmaStore) {
    // One map over all groups' outputs, packed: group g's rows from g * m on.
    const int64_t rows = int64_t{p.groups} * p.m;
    auto out_map = [&](CUtensorMap* map, const void* base) {
      return MakeTensorMap(map, base, p.n_split, rows, kTmaStoreCols, kWarpgroupRows,
                           CU_TENSOR_MAP_SWIZZLE_64B);
    };
    if (!out_map(&p.o0, p.out0) || (p.n > p.n_split && !out_map(&p.o1, p.out1)))
      return "cuTensorMapEncodeTiled refused a GEMM output";
  } else if constexpr (Kind::kStoresByTma) {
    // Row-grouped (StageAndStore): (64 columns, 64 rows) boxes in the staging's 128-byte
    // swizzle over the m_total rows; kStore writes one output, kSwiGLU gu (if kept) and h.
    static_assert(Kind::kSched == Schedule::kRowsByGroup);
    if (Kind::kEpi == Epilogue::kStore && p.n_split != p.n)
      return "a row-grouped bf16 GEMM writes one output (n_split = n)";
    const int64_t o0_cols = Kind::kEpi == Epilogue::kSwiGLU ? 2 * int64_t{p.n} : p.n;
    auto out_map = [&](CUtensorMap* map, const void* base, int64_t cols) {
      return MakeTensorMap(map, base, cols, p.m_total, kStageCols, kWarpgroupRows);
    };
    if ((p.out0 && !out_map(&p.o0, p.out0, o0_cols)) ||
        (Kind::kEpi == Epilogue::kSwiGLU && !out_map(&p.o1, p.out1, p.n)))
      return "cuTensorMapEncodeTiled refused a GEMM output";
  }
  const int cols_per_tile = Kind::kEpi == Epilogue::kSwiGLU ? C::kBlockN / 2 : C::kBlockN;
  p.n_tiles = static_cast<int>(CeilDiv(p.n, cols_per_tile));
  if (Kind::kSched == Schedule::kGroupedK) p.m_tiles = static_cast<int>(CeilDiv(p.m, C::kBlockM));
  if (p.offsets && p.groups > C::kMaxGroups) return "too many groups for one grouped GEMM";
  if (p.offsets && p.block_m != 64 && p.block_m != C::kBlockM) return "block_m must be 64 or 128";
  p.tiles = LinearTiles<Kind::kSched>(p);
  p.raster_rows = kRasterRows;
  p.max_tails = MaxTails(p);
  return nullptr;
}

// PrepareGemm for an FP8 GEMM (GemmKind::kFp8): A e4m3 (rows, k) with its block scales
// (a_scale, blocks of k by a_pitch, MakeScaleMap); B^T e4m3 (groups * n, k) in b0 (kSwiGLU:
// w_gate^T, and w_up^T in b1; otherwise b1 serves k >= k_split), K-major both, read in
// (128 bytes, rows) boxes; its scales and (kSwiGLU) h's go in p's b_scale0, b_scale1, h_scale.
// Outputs: kSwiGLU h in e4m3 (out1) and gu if kept (out0, bf16), kStore one bf16 output (out0),
// kSwiGLUBwd dgu and h with plain stores (out0, out1).
template <class Kind>
const char* PrepareGemmFp8(GemmParams& p, const Matrix& a, const float* a_scale, int64_t a_pitch,
                           const Matrix& b0, const Matrix& b1) {
  static_assert(Kind::kFp8 && Kind::kSched == Schedule::kRowsByGroup);
  using C = GemmConfig;
  constexpr bool kSwiGLU = Kind::kEpi == Epilogue::kSwiGLU;
  constexpr auto kU8 = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  constexpr auto kSw128 = CU_TENSOR_MAP_SWIZZLE_128B;
  const bool split = !kSwiGLU && p.k_split < p.k;
  if (p.k % kFp8Block || p.n % kFp8Block || p.k_split % kFp8Block || p.k != a.inner ||
      p.k_split != b0.inner || (split && p.k - p.k_split != b1.inner))
    return "an FP8 GEMM's k, k_split and n must be multiples of 128, k the operands' inner size";
  if (p.n_split != p.n || (kSwiGLU && p.k_split != p.k))
    return "an FP8 GEMM has one output, and kSwiGLU one k";
  const uint32_t b_rows = kSwiGLU ? C::kBlockN / 2 : C::kBlockN;
  if (!MakeTensorMap(&p.a, a.base, a.inner, a.rows, kFp8Block, C::kBlockM, kSw128, kU8) ||
      !MakeScaleMap(&p.a_scale, a_scale, a.rows, a_pitch, p.k / kFp8Block) ||
      !MakeTensorMap(&p.b0, b0.base, b0.inner, b0.rows, kFp8Block, b_rows, kSw128, kU8) ||
      ((kSwiGLU || split) &&
       !MakeTensorMap(&p.b1, b1.base, b1.inner, b1.rows, kFp8Block, b_rows, kSw128, kU8)))
    return "cuTensorMapEncodeTiled refused an FP8 GEMM operand";
  auto bf16_map = [&](CUtensorMap* map, const void* base, int64_t cols) {
    return MakeTensorMap(map, base, cols, p.m_total, kStageCols, kWarpgroupRows);
  };
  bool out_ok = true;
  if constexpr (kSwiGLU) {
    out_ok = MakeTensorMap(&p.o1, p.out1, p.n, p.m_total, kFp8Block, kWarpgroupRows, kSw128,
                           kU8) &&
             (!p.out0 || bf16_map(&p.o0, p.out0, 2 * int64_t{p.n}));
  } else if constexpr (Kind::kEpi == Epilogue::kStore) {
    out_ok = bf16_map(&p.o0, p.out0, p.n);
  }
  if (!out_ok) return "cuTensorMapEncodeTiled refused an FP8 GEMM output";
  if (!p.b_scale0 || ((kSwiGLU || split) && !p.b_scale1) || (kSwiGLU && !p.h_scale))
    return "an FP8 GEMM needs its B scales (and kSwiGLU h's)";
  if (kSwiGLU && p.b_scale_nk) return "kSwiGLU reads the forward's weight scales";
  p.n_tiles = static_cast<int>(CeilDiv(p.n, kSwiGLU ? C::kBlockN / 2 : C::kBlockN));
  if (p.offsets && p.groups > C::kMaxGroups) return "too many groups for one grouped GEMM";
  if (p.offsets && p.block_m != 64 && p.block_m != C::kBlockM) return "block_m must be 64 or 128";
  p.tiles = LinearTiles<Kind::kSched>(p);
  p.raster_rows = kRasterRows;
  p.max_tails = 0;
  return nullptr;
}

inline const char* SmCount(int* sms) {
  int device = 0;
  if (auto err = Check(cudaGetDevice(&device))) return err;
  return Check(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device));
}

// Launches `kernel` (a GEMM kernel using `smem` bytes of dynamic shared memory) on `ctas` CTAs
// with `args` (at most one CTA per SM is resident: the shared memory allows no second one).
template <class... Params, class... Args>
const char* LaunchGemmKernel(void (*kernel)(Params...), size_t smem, int64_t ctas,
                             cudaStream_t stream, const Args&... args) {
  if (auto err = Check(AllowSharedMemory(reinterpret_cast<const void*>(kernel),
                                         static_cast<int>(smem))))
    return err;
  if (ctas == 0) return nullptr;
  kernel<<<static_cast<unsigned>(ctas), GemmConfig::kThreads, smem, stream>>>(args...);
  return Check(cudaGetLastError());
}

// How many clusters of `config`'s kernel fit on the device at once (not every SM may find a
// partner in its GPC), asked once per device and kernel.
template <class Kernel>
const char* ClustersThatFit(Kernel kernel, cudaLaunchConfig_t config, int* fit) {
  static std::mutex mu;
  static std::map<int, int> fits;
  int device = 0;
  if (auto err = Check(cudaGetDevice(&device))) return err;
  std::lock_guard<std::mutex> lock(mu);
  if (!fits.count(device)) {
    int n = 0;
    if (auto err = Check(cudaOccupancyMaxActiveClusters(&n, kernel, &config))) return err;
    fits[device] = n;
  }
  *fit = fits[device];
  return nullptr;
}

// Launches the chain `c` of prepared GEMMs on `ctas` CTAs; kClusterM = 2: on at most `ctas` / 2
// clusters of two, as many as fit at once.
template <class Kind0, class Kind1, int kSlots, int kClusterM = 1>
const char* LaunchChain(const ChainParams& c, int64_t ctas, cudaStream_t stream) {
  const auto kernel = GemmChainKernel<Kind0, Kind1, kSlots, kClusterM>;
  if constexpr (kClusterM == 1) {
    return LaunchGemmKernel(kernel, kGemmSmemBytes<Kind0>, ctas, stream, c);
  } else {
    constexpr size_t kSmem = kGemmSmemBytes<Kind0>;
    if (auto err = Check(AllowSharedMemory(reinterpret_cast<const void*>(kernel),
                                           static_cast<int>(kSmem))))
      return err;
    cudaLaunchConfig_t config{};
    config.blockDim = dim3(GemmConfig::kThreads);
    config.dynamicSmemBytes = kSmem;
    config.stream = stream;
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = kClusterM;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    int sms = 0;
    if (auto err = SmCount(&sms)) return err;
    config.gridDim = dim3(static_cast<unsigned>(sms / kClusterM * kClusterM));
    int fit = 0;
    if (auto err = ClustersThatFit(kernel, config, &fit)) return err;
    // A GPU whose SMs cannot host a pair (a small partition of one) runs the same tiles one CTA
    // a tile: the same bits.
    if (fit == 0) return LaunchChain<Kind0, Kind1, kSlots>(c, ctas, stream);
    const int64_t clusters = std::min<int64_t>((ctas + kClusterM - 1) / kClusterM, fit);
    config.gridDim = dim3(static_cast<unsigned>(clusters * kClusterM));
    return Check(cudaLaunchKernelEx(&config, kernel, c));
  }
}

// The upper bound on the tiles of the chain `c` of Kind0's pipeline, or an error: the kernel
// keeps one copy of the row groups (offsets, and the used rows' ends found from row_tokens) in
// shared memory, so the slots that have row groups must have the same ones; and TMA stores are
// not waited for, so no slot may count rows done for another to wait on.
template <class Kind0>
const char* ChainTiles(const ChainParams& c, int64_t* tiles) {
  for (int i = 0; i < kMaxChain; ++i) {
    if (Kind0::kTmaStore && c.ready_base[i] >= 0)
      return "a TMA-stored GEMM's rows cannot be waited on within its launch";
  }
  const GemmParams* grouped = nullptr;
  for (const GemmParams& p : c.gemm) {
    if (p.offsets == nullptr) continue;
    if (grouped && (p.offsets != grouped->offsets || p.groups != grouped->groups ||
                    p.row_tokens != grouped->row_tokens))
      return "the GEMMs of one launch with row groups must share them";
    grouped = &p;
  }
  *tiles = 0;
  for (int i = 0; i < kMaxChain; ++i) *tiles += c.gemm[i].tiles;
  return nullptr;
}

// The prepared GEMMs of `c` on a persistent grid that takes its tiles from c.queue.
template <class Kind0, class Kind1>
const char* LaunchQueued(const ChainParams& c, cudaStream_t stream) {
  int64_t tiles = 0;
  if (auto err = ChainTiles<Kind0>(c, &tiles)) return err;
  if (tiles == 0) return nullptr;
  int sms = 0;
  if (auto err = SmCount(&sms)) return err;
  // A unit of two tiles holds at least one: `tiles` bounds the units too. Only row-grouped
  // GEMMs run in clusters (a weight-gradient chain launched alone would not compile else).
  if constexpr (Kind0::kSched == Schedule::kRowsByGroup && !Kind0::kFp8) {
    if (UseClusters(c))
      return LaunchChain<Kind0, Kind1, kMaxChain, 2>(c, std::min<int64_t>(tiles, sms), stream);
  }
  return LaunchChain<Kind0, Kind1, kMaxChain>(c, std::min<int64_t>(tiles, sms), stream);
}

// An empty chain: no slot has tiles, waits or counts.
inline ChainParams EmptyChain() {
  ChainParams c{};
  for (int i = 0; i < kMaxChain; ++i) {
    c.wait_base[i] = -1, c.wait_count[i] = 0, c.ready_base[i] = -1;
  }
  c.run_tiles = 1;
  return c;
}

using cute::GMMA::Major;
// Forward: gu, h = SwiGLU(x_rows @ [w_gate | w_up]); y_routed = h @ w_down.
using FwdGateUp = GemmKind<Major::K, Major::MN, Epilogue::kSwiGLU, Schedule::kRowsByGroup>;
using FwdDown = GemmKind<Major::K, Major::MN, Epilogue::kStore, Schedule::kRowsByGroup>;
// The same in block-scaled e4m3 (Config(precision="fp8")): B is w_gate^T | w_up^T and w_down^T.
using FwdGateUpFp8 =
    GemmKind<Major::K, Major::K, Epilogue::kSwiGLU, Schedule::kRowsByGroup, false, true>;
using FwdDownFp8 = GemmKind<Major::K, Major::K, Epilogue::kStore, Schedule::kRowsByGroup, false, true>;
// Backward data gradients: dgu, h = SwiGLU'(dy_r @ w_down^T); dx_r = dgu @ [w_gate | w_up]^T.
using BwdDown = GemmKind<Major::K, Major::K, Epilogue::kSwiGLUBwd, Schedule::kRowsByGroup>;
using BwdGateUp = GemmKind<Major::K, Major::K, Epilogue::kStore, Schedule::kRowsByGroup>;
// The same in block-scaled e4m3: B is w_down and [w_gate | w_up] as they are (b_scale_nk);
// dx_r's GEMM is FwdDownFp8's kind with a second B past k_split.
using BwdDownFp8 =
    GemmKind<Major::K, Major::K, Epilogue::kSwiGLUBwd, Schedule::kRowsByGroup, false, true>;
using BwdGateUpFp8 = FwdDownFp8;
// Backward weight gradients: dW_g = A[rows of g]^T @ B[rows of g].
using BwdWeights = GemmKind<Major::MN, Major::MN, Epilogue::kStore, Schedule::kGroupedK>;
// The same in runs of tiles (ChainParams::run_tiles > 1).
using BwdWeightRuns =
    GemmKind<Major::MN, Major::MN, Epilogue::kStore, Schedule::kGroupedK, /*kRuns=*/true>;

}  // namespace mok::sm90
