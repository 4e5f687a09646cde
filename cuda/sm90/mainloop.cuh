// The GEMM mainloop: a producer thread that streams A and B k-tiles into a ring of shared-memory
// stages with TMA, and two consumer warpgroups that multiply them with wgmma.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "gemm_config.cuh"
#include "ptx.cuh"
#include "quantize.cuh"
#include "tile_scheduler.cuh"

namespace mok::sm90 {

using bf16_t = cute::bfloat16_t;
using e4m3_t = cute::float_e4m3_t;

template <int kRows, int kBlockK, int kStages, class Elem = bf16_t>
using StagedK = decltype(cute::tile_to_shape(
    cute::GMMA::Layout_K_SW128_Atom<Elem>{},
    cute::Shape<cute::Int<kRows>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
// MN-major operands: atoms ordered K first, so that each group of 64 MN-columns is one
// contiguous (64 MN, kBlockK) panel, as MakePanelMap's boxes write them.
template <int kRows, int kBlockK, int kStages>
using StagedMN = decltype(cute::tile_to_shape(
    cute::GMMA::Layout_MN_SW128_Atom<bf16_t>{},
    cute::Shape<cute::Int<kRows>, cute::Int<kBlockK>, cute::Int<kStages>>{},
    cute::Step<cute::_2, cute::_1, cute::_3>{}));

// One of the two, named only when chosen (a K-major layout 32 deep does not exist).
template <bool kKMajor, int kRows, int kBlockK, int kStages>
struct Staged {
  using type = StagedMN<kRows, kBlockK, kStages>;
};
template <int kRows, int kBlockK, int kStages>
struct Staged<true, kRows, kBlockK, kStages> {
  using type = StagedK<kRows, kBlockK, kStages>;
};

// Shared-memory layouts (BM|BN, BK, PIPE) and the MMA of a GemmKind. K-major stages hold
// 128-byte swizzled rows, as a (64, rows) TMA box writes them.
template <class Kind, bool kFp8 = Kind::kFp8>
struct GemmLayouts {
  using SmemA = typename Staged<Kind::kKMajorA, GemmConfig::kBlockM, Kind::kBlockK,
                                Kind::kStages>::type;
  using SmemB = typename Staged<Kind::kKMajorB, GemmConfig::kBlockN, Kind::kBlockK,
                                Kind::kStages>::type;
  // Two 64 x 256 wgmma atoms stacked along M, one per consumer warpgroup.
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90_64x256x16_F32BF16BF16_SS<Kind::kMajorA, Kind::kMajorB>{},
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
};

// FP8 (kFp8): e4m3 stages 128 deep, (128 bytes, rows) TMA boxes. TiledMma here only shapes the
// f32 accumulators of the whole tile, whose values sit as the bf16 kernels' do (what the
// epilogues expect); the MMAs themselves are a warpgroup's 64 x 128 halves (MmaTileFp8).
template <class Kind>
struct GemmLayouts<Kind, true> {
  using SmemA = StagedK<GemmConfig::kBlockM, Kind::kBlockK, Kind::kStages, e4m3_t>;
  using SmemB = StagedK<GemmConfig::kBlockN, Kind::kBlockK, Kind::kStages, e4m3_t>;
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90_64x256x32_F32E4M3E4M3_SS_TN<>{},
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  using HalfMma = decltype(cute::make_tiled_mma(cute::SM90_64x128x32_F32E4M3E4M3_SS_TN<>{}));
};

// Epilogue staging, per consumer warpgroup: one (64, 64) bf16 tile, written and copied out once
// per 64 output columns, small so that four pipeline stages fit beside it; or (kTmaStore) its
// whole 64 x 256 slab of the output tile as eight (32 columns, 64 rows) TMA boxes; or
// (kSwiGLUBwd) (64, 96): g, u and h of 32 columns.
constexpr int kWarpgroupRows = GemmConfig::kBlockM / GemmConfig::kConsumerWarpgroups;
constexpr int kStageCols = 64;
constexpr int kTmaStoreCols = 32;
constexpr int kSwiGLUBwdStageCols = 96;

template <int kStages, int kBlockK, int kStageElems, int kTailElems>
struct alignas(1024) GemmSmem {
  bf16_t a[kStages][GemmConfig::kBlockM * kBlockK];
  bf16_t b[kStages][GemmConfig::kBlockN * kBlockK];
  // Apart from the stages, which the producer is already filling with the next tile.
  bf16_t stage[GemmConfig::kConsumerWarpgroups][kStageElems];
  // kTail: a tail tile's kTailRows rows of A for each stage (K-major, 1024-byte aligned after
  // the kilobyte multiples above); a token 8 elements elsewhere.
  bf16_t tail[kStages][kTailElems];
  int32_t offsets[GemmConfig::kMaxGroups + 1];     // the groups' first rows
  int32_t tile_start[GemmConfig::kMaxGroups + 1];  // kRowsByGroup: the groups' first tiles
  int32_t used_end[GemmConfig::kMaxGroups];        // kGroupedK: the groups' used rows' ends
  uint64_t full[kStages];   // TMA bytes landed
  uint64_t empty[kStages];  // both consumer warpgroups done reading
};
// FP8 (kFp8): e4m3 stages, each with its k-block's scales of A's 128 rows; the staging (64
// rows x 128 bytes a warpgroup) takes the bf16 columns of y, dx_r or gu (kStore, kSwiGLU) or
// h's e4m3 (kSwiGLU); kSwiGLUBwd's is the bf16 kernels' (64, 96).
template <int kStages, int kStageElems>
struct alignas(1024) GemmSmemFp8 {
  e4m3_t a[kStages][GemmConfig::kBlockM * kFp8Block];
  e4m3_t b[kStages][GemmConfig::kBlockN * kFp8Block];
  bf16_t stage[GemmConfig::kConsumerWarpgroups][kStageElems];
  float a_scale[kStages][GemmConfig::kBlockM];  // 512 bytes: TMA's 16-byte alignment holds
  int32_t offsets[GemmConfig::kMaxGroups + 1];
  int32_t tile_start[GemmConfig::kMaxGroups + 1];
  int32_t used_end[GemmConfig::kMaxGroups];
  uint64_t full[kStages];
  uint64_t empty[kStages];
};

template <class Kind, bool kFp8 = Kind::kFp8>
struct GemmSmemFor {
  using type =
      GemmSmem<Kind::kStages, Kind::kBlockK,
               kWarpgroupRows * (Kind::kTmaStore ? GemmConfig::kBlockN
                                 : Kind::kEpi == Epilogue::kSwiGLUBwd ? kSwiGLUBwdStageCols
                                                                      : kStageCols),
               Kind::kTail ? kTailRows * Kind::kBlockK : 8>;
};
template <class Kind>
struct GemmSmemFor<Kind, true> {
  static_assert(Kind::kBlockK == kFp8Block);
  using type = GemmSmemFp8<Kind::kStages,
                           kWarpgroupRows * (Kind::kEpi == Epilogue::kSwiGLUBwd
                                                 ? kSwiGLUBwdStageCols : kStageCols)>;
};
template <class Kind>
using GemmSmemOf = typename GemmSmemFor<Kind>::type;

// Where a k-step's stage is and which phase of its barriers comes next. The row-grouped GEMMs
// walk the stages as a ring: `it` (uint32_t) counts the k-steps of all earlier tiles of this
// CTA, and so do the weight gradients without runs. Those in runs (GemmKind::kRuns) keep a
// StageRing instead: a tile of a run whose reduction fits in the stages (fixed_stages) takes
// its k-step kt in stage kt, so that the run's later tiles find their B k-tiles where its first
// tile loaded them (keep_b); other tiles walk the ring. Each stage's phase is then its own bit,
// flipped at each use, by the producer and the consumers alike.
struct StageRing {
  uint32_t next = 0;    // the ring's next stage (mod kStages), for tiles that walk it
  uint32_t phases = 0;  // bit s: the uses of stage s so far, mod 2
};

template <class Kind>
__device__ __forceinline__ int StageOf(uint32_t it, int, bool) {
  return static_cast<int>(it % Kind::kStages);
}
template <class Kind>
__device__ __forceinline__ uint32_t PhaseOf(uint32_t it, int) {
  return (it / Kind::kStages) & 1;
}
template <class Kind>
__device__ __forceinline__ void Advance(uint32_t& it, int, bool) {
  ++it;
}
template <class Kind>
__device__ __forceinline__ int StageOf(const StageRing& r, int kt, bool fixed) {
  return fixed ? kt : static_cast<int>(r.next % Kind::kStages);
}
template <class Kind>
__device__ __forceinline__ uint32_t PhaseOf(const StageRing& r, int s) {
  return (r.phases >> s) & 1;
}
template <class Kind>
__device__ __forceinline__ void Advance(StageRing& r, int s, bool fixed) {
  r.phases ^= 1u << s;
  if (!fixed) ++r.next;
}

// Producer: one thread issues every TMA of the tile. `it`: where the tile's k-steps find their
// stages and phases (StageOf), continued across the tiles of this CTA.
//
// In clusters of kClusterM = 2 (ScheduleUnit), a tile that shares B (Pairing::kSharesB)
// loads its rank's half of B's k-tile (kSwiGLU: rank 0 the w_gate columns, rank 1 the w_up
// ones) multicast to both CTAs, whose stages then take in the same bytes as alone; a tile that
// shares A (kSharesA) takes its A from rank 0's load, multicast to both; an absent tile
// (kAbsent) loads nothing but still completes each stage's phase. Every CTA's `empty` barriers
// count the consumers of both (MmaSteps), so both producers refill a stage only once both have
// read it.
template <class Kind, int kClusterM = 1, class Smem, class Ring>
__device__ __forceinline__ void LoadTile(const GemmParams& p, const GemmTile& tile, Smem& smem,
                                         int rank, Ring& it) {
  using C = GemmConfig;
  constexpr int kBox = C::kBoxInner * Kind::kBlockK;  // elements of one MN-major panel
  const int n0 = tile.n_tile * C::kBlockN;
  // First row of B's k-tiles: the group's weights (kRowsByGroup) or its routed rows.
  const int64_t b_row0 = Kind::kSched == Schedule::kRowsByGroup
                             ? int64_t{tile.group} * p.k : tile.k_begin;
  // A split tile's stage holds only what its MMAs read (MmaTileSplit): a half tile's 64 rows of
  // A, a narrow tile's half of B.
  constexpr uint32_t kHalfA = C::kBlockM / 2 * Kind::kBlockK * sizeof(bf16_t);
  constexpr uint32_t kHalfB = C::kBlockN / 2 * Kind::kBlockK * sizeof(bf16_t);
  const bool half_a = Kind::kSched == Schedule::kRowsByGroup && tile.half;
  const bool half_b = Kind::kSched == Schedule::kRowsByGroup && tile.narrow;
  constexpr uint32_t kTailBytes = kTailRows * Kind::kBlockK * sizeof(bf16_t);
  const bool tail = Kind::kTail && tile.tail;
  // kGroupedK: B's k-tiles are already in the stages (keep_b): only A comes in.
  constexpr uint32_t kFullB = C::kBlockN * Kind::kBlockK * sizeof(bf16_t);
  const bool keep_b = Kind::kRuns && tile.keep_b;
  const bool fixed = tile.fixed_stages;
  const uint32_t stage_bytes = Kind::kStageBytes - (half_a ? kHalfA : 0) -
                               (half_b ? kHalfB : 0) + (tail ? kTailBytes : 0) -
                               (keep_b ? kFullB : 0);
  const CUtensorMap* a_map = half_a ? &p.a_half : &p.a;
  const CUtensorMap* b0_map = half_b ? &p.b0_half : &p.b0;
  const CUtensorMap* b1_map = half_b ? &p.b1_half : &p.b1;
  if (kClusterM > 1 && tile.pairing == Pairing::kAbsent) {
    for (int kt = 0; kt < tile.num_k; ++kt) {
      const int s = StageOf<Kind>(it, kt, fixed);
      BarrierWait(&smem.empty[s], PhaseOf<Kind>(it, s) ^ 1);
      BarrierArrive(&smem.full[s]);
      Advance<Kind>(it, s, fixed);
    }
    return;
  }
  const bool shared_b = kClusterM > 1 && tile.pairing == Pairing::kSharesB;
  const bool shared_a = kClusterM > 1 && tile.pairing == Pairing::kSharesA;
  constexpr uint16_t kBoth = 0x3;
  for (int kt = 0; kt < tile.num_k; ++kt) {
    const int s = StageOf<Kind>(it, kt, fixed);
    const int kk = kt * Kind::kBlockK;
    // The first use of a stage finds it free.
    BarrierWait(&smem.empty[s], PhaseOf<Kind>(it, s) ^ 1);
    Advance<Kind>(it, s, fixed);
    BarrierArriveExpectTx(&smem.full[s], stage_bytes);
    if constexpr (Kind::kKMajorA) {
      const auto m0 = static_cast<int32_t>(tile.m0);
      if (!shared_a) TmaLoad2d(smem.a[s], a_map, &smem.full[s], kk, m0);
      else if (rank == 0) TmaLoad2d(smem.a[s], a_map, &smem.full[s], kk, m0, kBoth);
      if constexpr (Kind::kTail) {
        // The tail's rows (both CTAs' tiles, when they share A).
        const int32_t t0 = m0 + tile.tail_at;
        if (tail && !shared_a) TmaLoad2d(smem.tail[s], &p.a_tail, &smem.full[s], kk, t0);
        else if (tail && rank == 0) {
          TmaLoad2d(smem.tail[s], &p.a_tail, &smem.full[s], kk, t0, kBoth);
        }
      }
    } else {
      // The tile's kBlockM / 64 panels of A in one box (m0 is a multiple of kBlockM).
      TmaLoad3d(smem.a[s], &p.a, &smem.full[s], 0, static_cast<int32_t>(tile.k_begin + kk),
                static_cast<int32_t>(tile.m0 / C::kBoxInner));
    }
    if constexpr (Kind::kKMajorB) {
      // B(n, k) = W[group * n + n, k]: one (64, 256) box from b0, or b1 past k_split; shared,
      // the (64, 128) box of rows [128 rank, 128 rank + 128).
      const bool second = kk >= p.k_split;
      const int32_t k0 = second ? kk - p.k_split : kk;
      if (shared_b) {
        TmaLoad2d(smem.b[s] + rank * (C::kBlockN / 2) * Kind::kBlockK,
                  second ? &p.b1_half : &p.b0_half, &smem.full[s], k0,
                  tile.group * p.n + n0 + rank * (C::kBlockN / 2), kBoth);
      } else {
        TmaLoad2d(smem.b[s], second ? b1_map : b0_map, &smem.full[s], k0, tile.group * p.n + n0);
      }
    } else if constexpr (Kind::kEpi == Epilogue::kSwiGLU) {
      // Panels 0-1 are 128 columns of w_gate, panels 2-3 the same columns of w_up.
      constexpr int kHalf = C::kBlockN / C::kBoxInner / 2;
      const int panel = tile.n_tile * kHalf;
      const auto row = static_cast<int32_t>(b_row0 + kk);
      if (shared_b) {
        TmaLoad3d(smem.b[s] + rank * kHalf * kBox, rank == 0 ? &p.b0 : &p.b1, &smem.full[s], 0,
                  row, panel, kBoth);
      } else {
        TmaLoad3d(smem.b[s], b0_map, &smem.full[s], 0, row, panel);
        TmaLoad3d(smem.b[s] + kHalf * kBox, b1_map, &smem.full[s], 0, row, panel);
      }
    } else {
      const auto row = static_cast<int32_t>(b_row0 + kk);
      if (shared_b) {
        constexpr int kHalf = C::kBlockN / C::kBoxInner / 2;
        TmaLoad3d(smem.b[s] + rank * kHalf * kBox, &p.b0_half, &smem.full[s], 0, row,
                  n0 / C::kBoxInner + rank * kHalf, kBoth);
      } else if (!keep_b) {
        TmaLoad3d(smem.b[s], b0_map, &smem.full[s], 0, row, n0 / C::kBoxInner);
      }
    }
  }
}

// The k-steps of one tile for a consumer warpgroup: its A and B fragments (MMA, MMA_M|N,
// MMA_K, PIPE) into acc. `it` as in LoadTile; `releaser` frees each stage for the producer.
// In clusters the stage is released to both CTAs' producers (LoadTile).
template <int kClusterM>
__device__ __forceinline__ void ReleaseStage(uint64_t* empty) {
  if constexpr (kClusterM == 1) {
    BarrierArrive(empty);
  } else {
    for (uint32_t rank = 0; rank < kClusterM; ++rank) BarrierArriveRemote(empty, rank);
  }
}

// The consumers' side of an absent tile (LoadTile): each stage's phase is waited for and the
// stage released. A named barrier keeps the warpgroup's four warps together, as wgmma does in
// MmaSteps: a warp that slept through a refill of its stage would wait for the wrong phase.
template <class Kind, int kClusterM, class Smem, class Ring>
__device__ __forceinline__ void SkipSteps(Smem& smem, int num_k, int wg, bool releaser,
                                          Ring& it) {
  for (int kt = 0; kt < num_k; ++kt) {
    const int s = StageOf<Kind>(it, kt, false);
    BarrierWait(&smem.full[s], PhaseOf<Kind>(it, s));
    NamedBarrierSync(2 + wg, 128);
    if (releaser) ReleaseStage<kClusterM>(&smem.empty[s]);
    Advance<Kind>(it, s, false);
  }
}

// No tail: MmaSteps' `extra`.
struct NoTail {
  __device__ __forceinline__ void fence() {}
  __device__ __forceinline__ void step(int, bool) {}
};

// `extra` adds its own wgmmas on stage s to each k-step's batch (step(s, first)) and fences its
// accumulators with acc's (fence()): a tail tile's (TailMma).
// kLastK16: the k16 blocks of the last k-step that are multiplied; a weight-gradient tile's
// last ones may hold only padding rows (GemmTile::idle_k16). A compile-time count, peeled off
// the loop: a run-time guard around the wgmmas makes ptxas serialize them (C7520).
template <class Kind, int kClusterM, int kLastK16, class Mma, class FragA, class FragB,
          class Smem, class Accum, class Ring, class Extra = NoTail>
__device__ __forceinline__ void MmaSteps(Mma& mma, const FragA& tCrA, const FragB& tCrB,
                                         Smem& smem, int num_k, bool fixed, bool releaser,
                                         Accum& acc, Ring& it, Extra extra = {}) {
  using namespace cute;
  constexpr int kK16 = decltype(size<2>(tCrA))::value;
  static_assert(kLastK16 >= 1 && kLastK16 <= kK16);
  if (num_k == 0) {  // an empty group: its weight gradient is zero
    clear(acc);
    return;
  }
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  int previous = 0;
  auto step = [&](int kt, auto k16) __attribute__((always_inline)) {
    const int s = StageOf<Kind>(it, kt, fixed);
    BarrierWait(&smem.full[s], PhaseOf<Kind>(it, s));
    Advance<Kind>(it, s, fixed);
    warpgroup_fence_operand(acc);
    extra.fence();
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < decltype(k16)::value; ++kb) {
      gemm(mma, tCrA(_, _, kb, s), tCrB(_, _, kb, s), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    extra.step(s, kt == 0);
    warpgroup_commit_batch();
    // Keep one k-step of wgmma in flight; the one before it has finished reading its stage.
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
    extra.fence();
    if (kt > 0 && releaser) ReleaseStage<kClusterM>(&smem.empty[previous]);
    previous = s;
  };
  if constexpr (kLastK16 == kK16) {
    for (int kt = 0; kt < num_k; ++kt) step(kt, Int<kK16>{});
  } else {
    for (int kt = 0; kt + 1 < num_k; ++kt) step(kt, Int<kK16>{});
    step(num_k - 1, Int<kLastK16>{});
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  extra.fence();
  if (releaser) ReleaseStage<kClusterM>(&smem.empty[previous]);  // may be refilled now
}

// f(Int<used>{}) for the run-time `used` in [1, kN].
template <int kN, class F>
__device__ __forceinline__ void WithK16(int used, F f) {
  if constexpr (kN == 1) {
    f(cute::Int<1>{});
  } else {
    if (used == kN) f(cute::Int<kN>{});
    else WithK16<kN - 1>(used, f);
  }
}

// A tail tile's extra MMAs for one consumer warpgroup (kTail): the tail's kTailRows rows times
// two 64-column panels of the stage's B, computed transposed, as wgmma m64n16k16 with the
// panel (MN- or K-major, as it lies) for A and the tail rows (K-major) for B, so that no wgmma
// runs on 64 rows of which kTailRows are used. Warpgroup w takes panels w and w + 2: for kSwiGLU a
// column's gate (panels 0-1) and up (2-3) then sit in the same thread and register, acc0 and
// acc1. acc0(v), acc1(v): panel column AccRow + AccRowStep(v), tail row AccCol + AccColStep(v)
// + v % 2.
template <class Kind>
struct TailLayouts {
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90_64x16x16_F32BF16BF16_SS<Kind::kMajorB, cute::GMMA::Major::K>{}));
  using Accum = decltype(cute::partition_fragment_C(
      TiledMma{}, cute::Shape<cute::Int<64>, cute::Int<kTailRows>>{}));
};

template <class Kind, class FragA, class FragT>
struct TailMma {
  static_assert(kTailRows == 16, "m64n16 on a B panel");
  typename TailLayouts<Kind>::TiledMma mma;
  FragA a0, a1;  // (MMA, MMA_M, MMA_K, PIPE) of panels w and w + 2
  FragT t;       // (MMA, MMA_N, MMA_K, PIPE)
  typename TailLayouts<Kind>::Accum& acc0;
  typename TailLayouts<Kind>::Accum& acc1;
  __device__ __forceinline__ void fence() {
    cute::warpgroup_fence_operand(acc0);
    cute::warpgroup_fence_operand(acc1);
  }
  __device__ __forceinline__ void step(int s, bool first) {
    using namespace cute;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(t); ++kb) {
      mma.accumulate_ = first && kb == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
      gemm(mma, a0(_, _, kb, s), t(_, _, kb, s), acc0);
      gemm(mma, a1(_, _, kb, s), t(_, _, kb, s), acc1);
    }
  }
};

// The TailMma of warpgroup `wg` (thread `wg_thread` in it) over the stages of `smem`.
template <class Kind, class Smem, class Accum>
__device__ __forceinline__ auto MakeTailMma(Smem& smem, int wg, int wg_thread, Accum& acc0,
                                            Accum& acc1) {
  using namespace cute;
  using L = GemmLayouts<Kind>;
  using T = TailLayouts<Kind>;
  using SmemT = StagedK<kTailRows, Kind::kBlockK, Kind::kStages>;
  Tensor sB = make_tensor(make_smem_ptr(&smem.b[0][0]), typename L::SmemB{});  // (BN, BK, PIPE)
  Tensor sT = make_tensor(make_smem_ptr(&smem.tail[0][0]), SmemT{});  // (16, BK, PIPE)
  auto panel = [&](int p) {
    return logical_divide(sB, make_tile(Layout<_64>{}))(make_coord(_, p), _, _);
  };
  typename T::TiledMma mma;
  auto thr = mma.get_thread_slice(wg_thread);
  auto a0 = thr.make_fragment_A(thr.partition_A(panel(wg)));
  auto a1 = thr.make_fragment_A(thr.partition_A(panel(wg + 2)));
  auto t = thr.make_fragment_B(thr.partition_B(sT));
  return TailMma<Kind, decltype(a0), decltype(t)>{mma, a0, a1, t, acc0, acc1};
}

// Consumers: accumulate the (128, 256) tile; each warpgroup owns 64 rows of it. `thread` is the
// index among the 256 consumer threads.
template <class Kind, int kClusterM = 1, class Smem, class Accum, class Ring,
          class Extra = NoTail>
__device__ __forceinline__ void MmaTile(const GemmTile& tile, Smem& smem, int thread,
                                        Accum& acc, Ring& it, Extra extra = {}) {
  using namespace cute;
  using L = GemmLayouts<Kind>;
  Tensor sA = make_tensor(make_smem_ptr(&smem.a[0][0]), typename L::SmemA{});  // (BM, BK, PIPE)
  Tensor sB = make_tensor(make_smem_ptr(&smem.b[0][0]), typename L::SmemB{});  // (BN, BK, PIPE)
  typename L::TiledMma mma;
  auto thr = mma.get_thread_slice(thread);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
  constexpr int kK16 = Kind::kBlockK / 16;
  auto steps = [&](auto last) __attribute__((always_inline)) {
    MmaSteps<Kind, kClusterM, decltype(last)::value>(mma, tCrA, tCrB, smem, tile.num_k,
                                                     tile.fixed_stages, thread % 128 == 0, acc,
                                                     it, extra);
  };
  if constexpr (Kind::kSched == Schedule::kGroupedK) WithK16<kK16>(kK16 - tile.idle_k16, steps);
  else steps(Int<kK16>{});
}

// A split tile, for tiles with at most 64 rows (half) or at most half of their columns (narrow)
// in range: each warpgroup multiplies 64 rows of the stage's A (row block `a_block`) by 128 of
// its B columns (part `part`), so no wgmma runs on rows or columns that are all padding. Part
// p of kSwiGLU's B, [w_gate 128 | w_up 128], is gate panel p and up panel p (a warpgroup
// needs a column's g and u); of the others, columns [128 p, 128 p + 128).
//
// Splitting the work this way keeps both warpgroups busy: were one to multiply 64 x 256 while
// the other idled, a half tile would take as long as a full one.
template <class Kind>
struct SplitLayouts {
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90_64x128x16_F32BF16BF16_SS<Kind::kMajorA, Kind::kMajorB>{}));
  using PartB = std::conditional_t<
      Kind::kEpi == Epilogue::kSwiGLU,
      cute::Layout<cute::Shape<cute::_64, cute::_2>, cute::Stride<cute::_1, cute::_128>>,
      cute::Layout<cute::_128>>;
};

// `wg_thread`: the index in the warpgroup.
template <class Kind, int kClusterM = 1, class Smem, class Accum, class Extra = NoTail>
__device__ __forceinline__ void MmaTileSplit(const GemmTile& tile, Smem& smem, int wg_thread,
                                             int a_block, int part, Accum& acc, uint32_t& it,
                                             Extra extra = {}) {
  using namespace cute;
  using L = GemmLayouts<Kind>;
  using S = SplitLayouts<Kind>;
  Tensor sA = make_tensor(make_smem_ptr(&smem.a[0][0]), typename L::SmemA{});
  Tensor sB = make_tensor(make_smem_ptr(&smem.b[0][0]), typename L::SmemB{});
  // (64, BK, PIPE) and (128, BK, PIPE): whole swizzle atoms (8 K-major rows, 64 MN-major
  // columns) of the stages, so the wgmma descriptors of the parts are canonical.
  Tensor sA_part = logical_divide(sA, make_tile(Layout<_64>{}))(make_coord(_, a_block), _, _);
  Tensor sB_part =
      logical_divide(sB, make_tile(typename S::PartB{}))(make_coord(_, part), _, _);
  typename S::TiledMma mma;
  auto thr = mma.get_thread_slice(wg_thread);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA_part));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB_part));
  MmaSteps<Kind, kClusterM, Kind::kBlockK / 16>(mma, tCrA, tCrB, smem, tile.num_k, false,
                                                wg_thread == 0, acc, it, extra);
}

// FP8 (kFp8) -----------------------------------------------------------------------------------

// Producer: A's k-block (128 bytes, 128 rows) and its 128 row scales, then B's: kSwiGLU's 128
// rows of w_gate^T and the same rows of w_up^T (its column tile's gate and up columns), else
// 256 rows of B^T (of b1 past k_split). Each tile loads whole stages: FP8 tiles are never split
// (the epilogues leave out the rows and columns past the tile's).
template <class Kind, class Smem>
__device__ __forceinline__ void LoadTileFp8(const GemmParams& p, const GemmTile& tile, Smem& smem,
                                            uint32_t& it) {
  static_assert(Kind::kFp8);
  using C = GemmConfig;
  constexpr bool kSwiGLU = Kind::kEpi == Epilogue::kSwiGLU;
  constexpr int kBRows = kSwiGLU ? C::kBlockN / 2 : C::kBlockN;
  const auto m0 = static_cast<int32_t>(tile.m0);
  const auto b_row = static_cast<int32_t>(int64_t{tile.group} * p.n + int64_t{tile.n_tile} * kBRows);
  for (int kt = 0; kt < tile.num_k; ++kt) {
    const int s = StageOf<Kind>(it, kt, false);
    const int kk = kt * Kind::kBlockK;
    BarrierWait(&smem.empty[s], PhaseOf<Kind>(it, s) ^ 1);  // the first use finds it free
    Advance<Kind>(it, s, false);
    BarrierArriveExpectTx(&smem.full[s], Kind::kStageBytes);
    TmaLoad2d(smem.a[s], &p.a, &smem.full[s], kk, m0);
    TmaLoad2d(smem.a_scale[s], &p.a_scale, &smem.full[s], m0, kt);
    if constexpr (kSwiGLU) {
      TmaLoad2d(smem.b[s], &p.b0, &smem.full[s], kk, b_row);
      TmaLoad2d(smem.b[s] + kBRows * Kind::kBlockK, &p.b1, &smem.full[s], kk, b_row);
    } else if (kk < p.k_split) {
      TmaLoad2d(smem.b[s], &p.b0, &smem.full[s], kk, b_row);
    } else {
      TmaLoad2d(smem.b[s], &p.b1, &smem.full[s], kk - p.k_split, b_row);
    }
  }
}

// The B scales of one FP8 tile: for each 128-column half of the tile, where its block's scale
// of k-block 0 is (null: the half is past n, its columns never stored), and the step between
// k-blocks; past k-block split (a K-major B past k_split), the same in b_scale1 from there.
// kSwiGLU's halves are the gate and up columns of the tile's one block of n.
struct Fp8BScales {
  const float* half[2];
  const float* past_split[2];
  int k_stride;
  int split;

  __device__ __forceinline__ const float* At(int h, int kt) const {
    const float* s = kt < split ? half[h] : past_split[h];
    return s ? s + int64_t{kt < split ? kt : kt - split} * k_stride : nullptr;
  }
};

template <class Kind>
__device__ __forceinline__ Fp8BScales Fp8BScalesOf(const GemmParams& p, const GemmTile& tile) {
  const int n_blocks = p.n / kFp8Block, split = p.k_split / kFp8Block;
  const int rest = (p.k - p.k_split) / kFp8Block;
  Fp8BScales s;
  s.split = split;
  if constexpr (Kind::kEpi == Epilogue::kSwiGLU) {
    const int64_t group = int64_t{tile.group} * split * n_blocks;
    s.k_stride = n_blocks;
    s.half[0] = s.past_split[0] = p.b_scale0 + group + tile.n_tile;
    s.half[1] = s.past_split[1] = p.b_scale1 + group + tile.n_tile;
  } else {
    // (k / 128, n / 128) a group, or with b_scale_nk (n / 128, k / 128).
    s.k_stride = p.b_scale_nk ? 1 : n_blocks;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int block = 2 * tile.n_tile + h;
      const bool in = block < n_blocks;
      const int64_t at = p.b_scale_nk ? int64_t{block} * split : block;
      const int64_t at_rest = p.b_scale_nk ? int64_t{block} * rest : block;
      s.half[h] = in ? p.b_scale0 + int64_t{tile.group} * split * n_blocks + at : nullptr;
      s.past_split[h] =
          in && rest > 0 ? p.b_scale1 + int64_t{tile.group} * rest * n_blocks + at_rest : nullptr;
    }
  }
  return s;
}

// Consumers: the (128, 256) FP8 tile into acc, f32, each warpgroup its 64 rows. Each k-step
// (a 128-deep block of K) multiplies one 128-column half of B at a time into `part` (four
// wgmma m64n128k32, started from zero), waits for them, and adds part times its rows' A scale
// and the half's B scale into acc: the tensor cores' e4m3 sums keep fewer bits than f32, so
// they run over 128 of K at most (DeepSeek-V3's promotion). Both halves at once would need 128
// more accumulator registers than the 232 a consumer has. acc's values sit as a 64 x 256
// wgmma accumulator's (value 64 h + v is the half's value v).
template <class Kind, class Smem, class Accum>
__device__ __forceinline__ void MmaTileFp8(const GemmTile& tile, Smem& smem, int thread,
                                           Accum& acc, uint32_t& it, const Fp8BScales& scales) {
  using namespace cute;
  using L = GemmLayouts<Kind>;
  const int wg = thread / 128, wg_thread = thread % 128;
  Tensor sA = make_tensor(make_smem_ptr(&smem.a[0][0]), typename L::SmemA{});  // (BM, BK, PIPE)
  Tensor sB = make_tensor(make_smem_ptr(&smem.b[0][0]), typename L::SmemB{});  // (BN, BK, PIPE)
  // (64, BK, PIPE) of A, (128, BK, PIPE) of B: whole swizzle atoms (8 rows) of the stages.
  Tensor sA_wg = logical_divide(sA, make_tile(Layout<_64>{}))(make_coord(_, wg), _, _);
  auto sB_half = [&](int h) {
    return logical_divide(sB, make_tile(Layout<_128>{}))(make_coord(_, h), _, _);
  };
  typename L::HalfMma mma;
  auto thr = mma.get_thread_slice(wg_thread);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA_wg));    // (MMA, MMA_M, MMA_K, PIPE)
  Tensor tCrB0 = thr.make_fragment_B(thr.partition_B(sB_half(0)));  // (MMA, MMA_N, MMA_K, PIPE)
  Tensor tCrB1 = thr.make_fragment_B(thr.partition_B(sB_half(1)));
  auto part = partition_fragment_C(mma, Shape<_64, _128>{});
  constexpr int kK32 = Kind::kBlockK / 32;
  static_assert(decltype(size(part))::value * 2 == decltype(size(acc))::value);
  // This thread's rows of the warpgroup's 64: r0 and r0 + 8 (the wgmma D layout).
  const int r0 = wg_thread / 32 * 16 + wg_thread % 32 / 4;
  clear(acc);
  for (int kt = 0; kt < tile.num_k; ++kt) {
    const int s = StageOf<Kind>(it, kt, false);
    // The B scales come from global memory (L1 after the first tile), in flight meanwhile.
    float b_scale[2];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h)
      b_scale[h] = scales.At(h, kt) ? __ldg(scales.At(h, kt)) : 0.0f;
    BarrierWait(&smem.full[s], PhaseOf<Kind>(it, s));
    Advance<Kind>(it, s, false);
    const uint32_t a_scale_at = SmemAddr(&smem.a_scale[s][wg * 64 + r0]);
    const float a_scale[2] = {__uint_as_float(LoadShared32(a_scale_at)),
                              __uint_as_float(LoadShared32(a_scale_at + 8 * sizeof(float)))};
    auto half = [&](const auto& tCrB, int h) __attribute__((always_inline)) {
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < kK32; ++kb) {
        mma.accumulate_ = kb == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
        gemm(mma, tCrA(_, _, kb, s), tCrB(_, _, kb, s), part);
      }
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(part);
      const float scale[2] = {a_scale[0] * b_scale[h], a_scale[1] * b_scale[h]};
      CUTE_UNROLL
      for (int v = 0; v < size(part); ++v)
        acc(size(part) * h + v) = fmaf(part(v), scale[(v >> 1) & 1], acc(size(part) * h + v));
    };
    half(tCrB0, 0);
    half(tCrB1, 1);
    if (wg_thread == 0) BarrierArrive(&smem.empty[s]);  // both halves have read the stage
  }
}

}  // namespace mok::sm90
