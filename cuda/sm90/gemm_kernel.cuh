// The grouped expert GEMM kernel: warp-specialised (one producer warpgroup, two consumer
// warpgroups), TMA -> mbarrier ring -> wgmma, then an epilogue, over the tiles of a chain of
// GEMMs (ChainParams). The producer thread takes each tile from the device queue, schedules it
// (ScheduleTile) and passes it to the consumers through a small ring in shared memory; while
// the consumers run a tile's epilogue, it is already loading the next tile's stages. For the
// weight gradients, two more threads of the producer warpgroup issue the consumers' TMA stores
// (StageSlab).
#pragma once

#include <type_traits>

#include "epilogue.cuh"
#include "gemm_config.cuh"
#include "mainloop.cuh"
#include "ptx.cuh"
#include "tile_scheduler.cuh"

namespace mok::sm90 {

// Tiles in flight between the producer and the consumers: enough that a run of tiles with few
// k-steps does not stall the producer on the consumers' epilogues.
constexpr int kTileSlots = 4;

// The producer thread schedules each tile once and hands it over here, so that the 256 consumer
// threads do not each repeat ScheduleTile's 64-bit divisions before the first MMA: on the weight
// gradients' tiles of 2-3 k-steps that code would hold about a fifth of the warps' stall
// samples (ncu, dsv3, H200).
struct ChainSmem {
  int64_t first_tile[kMaxChain + 1];  // GEMM i's tiles are [first_tile[i], first_tile[i + 1])
  GemmTile slot_tile[kTileSlots];     // the tile handed to the consumers, scheduled
  int32_t slot_chain[kTileSlots];     // its GEMM in the chain; -1: no more tiles
  uint64_t slot_full[kTileSlots];     // the producer wrote slot_tile and slot_chain
  uint64_t slot_empty[kTileSlots];    // all 256 consumer threads read them
  // Clusters of two (ScheduleUnit): the unit that rank 0 took from the queue, in rank 1's
  // shared memory, and the pairs of row tiles before each group.
  int32_t unit_tile[kTileSlots];
  uint64_t unit_full[kTileSlots];     // rank 1's: rank 0 wrote unit_tile
  uint64_t unit_empty[kTileSlots];    // rank 0's: rank 1 read it
  int32_t pair_start[GemmConfig::kMaxGroups + 1];
  SlabHandoff slabs;  // kTmaStore: each consumer warpgroup's staged slab to its storer
};

template <class Kind>
constexpr size_t kGemmSmemBytes = sizeof(GemmSmemOf<Kind>) + sizeof(ChainSmem) + 1024;  // + align

// Which slot of the chain linear tile `linear` belongs to.
__device__ __forceinline__ int ChainIndex(const ChainSmem& cs, int slots, int64_t linear) {
  int i = 0;
  while (i + 1 < slots && linear >= cs.first_tile[i + 1]) ++i;
  return i;
}

// Calls f(std::integral_constant<int, i>) for slot i < kSlots: a constant index into the
// kernel parameters.
template <int kSlots, class F>
__device__ __forceinline__ void WithSlot(int i, F f) {
  static_assert(kSlots >= 1 && kSlots <= kMaxChain);
  if constexpr (kSlots == 1) {
    f(std::integral_constant<int, 0>{});
  } else {
    switch (i) {
      case 0: f(std::integral_constant<int, 0>{}); break;
      case 1: f(std::integral_constant<int, 1>{}); break;
      case 2: if constexpr (kSlots > 2) f(std::integral_constant<int, 2>{}); break;
      default: if constexpr (kSlots > 3) f(std::integral_constant<int, 3>{}); break;
    }
  }
}

// Slots 0, 1 run Kind0; 2, 3 Kind1.
template <class Kind0, class Kind1, int kSlot>
using SlotKind = std::conditional_t<(kSlot < 2), Kind0, Kind1>;

// The shared memory of a chain's CTA: the pipeline's (Kind0's layout), then ChainSmem.
template <class Kind0>
struct ChainStorage {
  GemmSmemOf<Kind0>& smem;
  ChainSmem& cs;
};

template <class Kind0>
__device__ __forceinline__ ChainStorage<Kind0> ChainStorageOf(uint8_t* smem_raw) {
  // 128-byte swizzling is a function of address bits 4-9: stages start 1024-byte aligned.
  auto& smem = *reinterpret_cast<GemmSmemOf<Kind0>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  return {smem, *reinterpret_cast<ChainSmem*>(&smem + 1)};
}

// Before any tile, in every thread of the CTA: the row groups into shared memory and their
// scans (the consumers, who have the registers for it), the producer thread's descriptor
// prefetches and barrier inits, then a CTA (cluster) barrier. Returns the groups' first row
// tiles (ScanGroupTiles) for the scheduler, or null.
template <class Kind0, class Kind1, int kSlots, bool kProducer, int kClusterM>
__device__ __forceinline__ const int32_t* ChainPrologue(const ChainParams& c,
                                                        ChainStorage<Kind0> st) {
  using C = GemmConfig;
  constexpr Schedule kSched = Kind0::kSched;
  constexpr int kConsumerThreads = 128 * C::kConsumerWarpgroups;
  auto& smem = st.smem;
  ChainSmem& cs = st.cs;
  // The slots with offsets share them (ChainTiles checks): one copy in shared memory, which
  // the consumers write and scan (they have the registers for it).
  const int32_t* group_offsets = nullptr;
  const int32_t* row_tokens = nullptr;
  int groups = 0, max_tails = 0;
  CUTE_UNROLL
  for (int i = 0; i < kSlots; ++i) {
    if (c.gemm[i].offsets) {
      group_offsets = c.gemm[i].offsets, groups = c.gemm[i].groups;
      row_tokens = c.gemm[i].row_tokens, max_tails = c.gemm[i].max_tails;
    }
  }
  const int32_t* tile_start = nullptr;
  if (group_offsets) {
    if (!kProducer) {
      for (int g = threadIdx.x - 128; g <= groups; g += kConsumerThreads)
        smem.offsets[g] = group_offsets[g];
    }
    CtaSync();
    if (kSched == Schedule::kRowsByGroup) {
      // Tails: which groups end in one, from their used rows.
      if (Kind0::kTail && row_tokens && !kProducer) {
        UsedRowEnds(smem.offsets, row_tokens, groups, threadIdx.x / 32 - 4,
                    kConsumerThreads / 32, threadIdx.x % 32, smem.used_end);
        NamedBarrierSync(1, kConsumerThreads);
      }
      if (!kProducer && threadIdx.x / 32 == 4) {
        ScanGroupTiles(smem.offsets, Kind0::kTail && row_tokens ? smem.used_end : nullptr,
                       groups, max_tails, threadIdx.x % 32, smem.tile_start);
        if (kClusterM > 1) {
          __syncwarp();
          ScanGroupPairs(smem.tile_start, groups, threadIdx.x % 32, cs.pair_start);
        }
      }
      tile_start = smem.tile_start;
    } else if (row_tokens && !kProducer) {
      UsedRowEnds(smem.offsets, row_tokens, groups, threadIdx.x / 32 - 4, kConsumerThreads / 32,
                  threadIdx.x % 32, smem.used_end);
    }
  }
  if (kProducer && threadIdx.x == 0) {
    CUTE_UNROLL
    for (int i = 0; i < kSlots; ++i) {
      WithSlot<kSlots>(i, [&](auto s) __attribute__((always_inline)) {
        constexpr int kSlot = decltype(s)::value;
        const GemmParams& p = c.gemm[kSlot];
        if (p.n_tiles == 0) return;
        using Kind = SlotKind<Kind0, Kind1, kSlot>;
        const bool uses_b1 = UsesB1<Kind>(p);
        PrefetchTmaDescriptor(&p.a);
        PrefetchTmaDescriptor(&p.b0);
        if (uses_b1) PrefetchTmaDescriptor(&p.b1);
        if constexpr (Kind::kFp8) {
          PrefetchTmaDescriptor(&p.a_scale);
        } else if (kSched == Schedule::kRowsByGroup) {
          PrefetchTmaDescriptor(&p.a_half);
          PrefetchTmaDescriptor(&p.b0_half);
          if (uses_b1) PrefetchTmaDescriptor(&p.b1_half);
        }
        if constexpr (Kind::kStoresByTma) {
          if (p.out0) PrefetchTmaDescriptor(&p.o0);
          if (Kind::kEpi == Epilogue::kSwiGLU || p.n > p.n_split) PrefetchTmaDescriptor(&p.o1);
        }
      });
    }
    for (int s = 0; s < Kind0::kStages; ++s) {
      BarrierInit(&smem.full[s], 1);
      BarrierInit(&smem.empty[s], C::kConsumerWarpgroups * kClusterM);
    }
    if (Kind0::kTmaStore) {
      for (int wg = 0; wg < C::kConsumerWarpgroups; ++wg) {
        BarrierInit(&cs.slabs.staged[wg], 1);
        BarrierInit(&cs.slabs.stored[wg], 1);
      }
    }
    for (int s = 0; s < kTileSlots; ++s) {
      BarrierInit(&cs.slot_full[s], 1);
      BarrierInit(&cs.slot_empty[s], kConsumerThreads);
      if (kClusterM > 1) {
        BarrierInit(&cs.unit_full[s], 1);
        BarrierInit(&cs.unit_empty[s], 1);
      }
    }
    FenceBarrierInit();
  }
  // The scan and the barriers are done; in clusters, also the peer's, before any multicast or
  // arrival reaches them.
  if constexpr (kClusterM > 1) ClusterSync();
  else CtaSync();
  return tile_start;
}

// The storers (the first threads of producer warps 1 and 2), for kTmaStore: each consumer
// warpgroup's staged slabs out by TMA stores (StageSlab), until it posts none.
template <class Kind0, int kSlots>
__device__ __forceinline__ void RunStorer(const ChainParams& c, ChainStorage<Kind0> st) {
  using C = GemmConfig;
  auto& smem = st.smem;
  ChainSmem& cs = st.cs;
  const int storer_wg = static_cast<int>(threadIdx.x) / 32 - 1;
  if (Kind0::kTmaStore && threadIdx.x % 32 == 0 && storer_wg >= 0 &&
      storer_wg < C::kConsumerWarpgroups) {
    const uint32_t base = SmemAddr(smem.stage[storer_wg]);
    for (uint32_t n = 0;; ++n) {
      BarrierWait(&cs.slabs.staged[storer_wg], n & 1);
      const SlabJob job = cs.slabs.job[storer_wg];
      if (job.slot < 0) break;
      WithSlot<kSlots>(job.slot, [&](auto s) __attribute__((always_inline)) {
        StoreSlab(c.gemm[decltype(s)::value], job, base);
      });
      BarrierArrive(&cs.slabs.stored[storer_wg]);
    }
    BulkWaitAll();  // the last stores have completed before the CTA exits
  }
}

// The producer thread: takes each tile from the queue (rank 0 of a cluster, which hands the
// unit to rank 1; runs of tiles for kRuns), schedules it, hands it to the consumers through
// the tile slots and loads its stages, waiting first for rows another slot of the launch
// writes; then a last slot that says there are no more tiles.
template <class Kind0, class Kind1, int kSlots, int kClusterM, class Iter>
__device__ __forceinline__ void RunScheduler(const ChainParams& c, ChainStorage<Kind0> st,
                                             const int32_t* tile_start, uint32_t rank, Iter& it) {
  using C = GemmConfig;
  constexpr Schedule kSched = Kind0::kSched;
  auto& smem = st.smem;
  ChainSmem& cs = st.cs;
  int64_t total = 0;
  CUTE_UNROLL
  for (int i = 0; i < kSlots; ++i) {
    cs.first_tile[i] = total;
    if constexpr (kClusterM > 1) {
      total += UnitCount(c.gemm[i], c.gemm[i].offsets ? tile_start : nullptr,
                         c.gemm[i].offsets ? cs.pair_start : nullptr);
    } else {
      total += TileCount<kSched>(c.gemm[i], c.gemm[i].offsets ? tile_start : nullptr);
    }
  }
  cs.first_tile[kSlots] = total;
  // The tile of slot i at linear index `linear`.
  auto schedule = [&](auto slot, int64_t linear) __attribute__((always_inline)) {
    const GemmParams& p = c.gemm[decltype(slot)::value];
    using Kind = SlotKind<Kind0, Kind1, decltype(slot)::value>;
    constexpr int kTileCols = Kind::kEpi == Epilogue::kSwiGLU ? C::kBlockN / 2 : C::kBlockN;
    const int32_t* used_end =
        (kSched == Schedule::kGroupedK || Kind::kTail) && p.offsets && p.row_tokens
            ? smem.used_end : nullptr;
    if constexpr (kClusterM > 1) {
      return ScheduleUnit<Kind0::kBlockK, kTileCols>(
          p, p.offsets ? smem.offsets : nullptr, p.offsets ? tile_start : nullptr,
          p.offsets ? cs.pair_start : nullptr, used_end,
          linear - cs.first_tile[decltype(slot)::value], static_cast<int>(rank));
    }
    return ScheduleTile<kSched, Kind0::kBlockK, kTileCols>(
        p, p.offsets ? smem.offsets : nullptr, p.offsets ? tile_start : nullptr, used_end,
        linear - cs.first_tile[decltype(slot)::value]);
  };
  // Runs (GemmKind::kRuns, the weight gradients, never in clusters; launched with
  // run_tiles > 1): the run's next tile and how many of it are left; the tile before.
  static_assert(!Kind0::kRuns || kClusterM == 1, "runs are one CTA's");
  int64_t run_next = 0;
  int run_left = 0;
  int last_i = -1, last_group = -1, last_n_tile = -1;  // of a tile in fixed stages
  for (uint32_t j = 0;; ++j) {
    const int slot = j % kTileSlots;
    // Tiles go out in queue order, as SMs free up (tiles waiting on rows, ragged row tiles,
    // CTAs that join from another chain).
    int64_t linear;
    bool run_first = true;
    if constexpr (Kind0::kRuns) {
      if (run_left == 0) {
        run_next = int64_t{atomicAdd(c.queue, 1)} * c.run_tiles;
        run_left = c.run_tiles;
      } else {
        run_first = false;
      }
      linear = run_next++;
      --run_left;
    } else if (kClusterM == 1 || rank == 0) {
      linear = atomicAdd(c.queue, 1);
      if constexpr (kClusterM > 1) {
        BarrierWaitCluster(&cs.unit_empty[slot], ((j / kTileSlots) & 1) ^ 1);
        StoreSharedCluster32(&cs.unit_tile[slot], 1,
                             static_cast<int32_t>(linear < total ? linear : total));
        BarrierArriveRelease(&cs.unit_full[slot], 1);
      }
    } else {
      BarrierWaitCluster(&cs.unit_full[slot], (j / kTileSlots) & 1);
      linear = *static_cast<volatile int32_t*>(&cs.unit_tile[slot]);
      BarrierArriveRelease(&cs.unit_empty[slot], 0);
    }
    const int i = linear < total ? ChainIndex(cs, kSlots, linear) : -1;
    GemmTile tile{};
    if (i >= 0) {
      WithSlot<kSlots>(i, [&](auto s) __attribute__((always_inline)) {
        tile = schedule(s, linear);
      });
      if constexpr (Kind0::kRuns) {
        // Same slot, group and column tile as the tile before in this run: the same B.
        tile.fixed_stages = tile.num_k <= Kind0::kStages;
        tile.keep_b = !run_first && tile.fixed_stages && last_i == i &&
                      last_group == tile.group && last_n_tile == tile.n_tile;
      }
    }
    if constexpr (Kind0::kRuns) {
      last_i = tile.fixed_stages ? i : -1;
      last_group = tile.group, last_n_tile = tile.n_tile;
    }
    BarrierWait(&cs.slot_empty[slot], ((j / kTileSlots) & 1) ^ 1);
    cs.slot_tile[slot] = tile;
    cs.slot_chain[slot] = i;
    BarrierArrive(&cs.slot_full[slot]);
    if (i < 0) break;
    WithSlot<kSlots>(i, [&](auto s) __attribute__((always_inline)) {
      constexpr int kSlot = decltype(s)::value;
      if (c.wait_base[kSlot] >= 0 && tile.pairing != Pairing::kAbsent) {
        // A is rows that another slot of this launch writes: wait for all of that slot's
        // column tiles of this row tile. Every tile handed out before this one is running
        // or done, and a waited-on tile waits on nothing itself: no deadlock, whatever the
        // grid.
        WaitAtLeast(c.ready + c.wait_base[kSlot] + tile.row_tile, c.wait_count[kSlot]);
        FenceProxyAsyncGlobal();
      }
      using Kind = SlotKind<Kind0, Kind1, kSlot>;
      if constexpr (Kind::kFp8) {
        LoadTileFp8<Kind>(c.gemm[kSlot], tile, smem, it);
      } else {
        LoadTile<Kind, kClusterM>(c.gemm[kSlot], tile, smem, static_cast<int>(rank), it);
      }
    });
  }
}

// The consumers' j-th tile from the producer: its GEMM in the chain (negative: no more tiles)
// and the tile, copied out so that the slot goes back to the producer at once.
struct TakenTile {
  int chain;
  GemmTile tile;
};
__device__ __forceinline__ TakenTile TakeTile(ChainSmem& cs, uint32_t j) {
  const int slot = j % kTileSlots;
  BarrierWaitLean(&cs.slot_full[slot], (j / kTileSlots) & 1);
  const TakenTile t{cs.slot_chain[slot], cs.slot_tile[slot]};
  BarrierArrive(&cs.slot_empty[slot]);
  return t;
}

// A consumer warpgroup's thread: each handed-over tile's MMAs (with a tail's, if it carries
// one) and its epilogue, then publishing its rows to a slot that waits on them.
template <class Kind0, class Kind1, int kSlots, int kClusterM, class Iter>
__device__ __forceinline__ void RunConsumer(const ChainParams& c, ChainStorage<Kind0> st,
                                            Iter& it) {
  using C = GemmConfig;
  constexpr Schedule kSched = Kind0::kSched;
  constexpr int kConsumerThreads = 128 * C::kConsumerWarpgroups;
  auto& smem = st.smem;
  ChainSmem& cs = st.cs;
  const int thread = threadIdx.x - 128;
  uint32_t slabs_posted = 0;  // kTmaStore: this warpgroup's slabs handed to its storer
#pragma unroll 1
  for (uint32_t j = 0;; ++j) {
    const TakenTile taken = TakeTile(cs, j);
    const int i = taken.chain;
    const GemmTile& tile = taken.tile;
    if (i < 0) break;
    const int wg = thread / 128;
    if (kClusterM > 1 && tile.pairing == Pairing::kAbsent) {
      SkipSteps<Kind0, kClusterM>(smem, tile.num_k, wg, thread % 128 == 0, it);
      continue;
    }
    // After a tile's stores: if another slot reads these rows with TMA, publish them once all
    // 256 threads' stores are visible to the async proxy at GPU scope. Each warpgroup's TMA
    // stores (StageAndStore) have completed when its storer's wait returns, and each thread
    // orders its own plain stores (a tail's) before async-proxy reads; the barrier puts all
    // of them before thread 0's release, which is cumulative: no thread needs a GPU-scope
    // fence of its own (a __threadfence in every thread as well costs qwen3_30b's
    // forward-MLP launch about 1% on an H200).
    auto publish = [&](auto s) __attribute__((always_inline)) {
      constexpr int kSlot = decltype(s)::value;
      if (c.ready_base[kSlot] >= 0) {
        if (thread % 128 == 0) BulkWaitAll();
        FenceProxyAsyncGlobal();
        NamedBarrierSync(1, kConsumerThreads);
        if (thread == 0) AddRelease(c.ready + c.ready_base[kSlot] + tile.row_tile, 1);
      }
    };
    // A tail tile's tail (kTail): its accumulators and its stores, before the tile is
    // published.
    typename TailLayouts<Kind0>::Accum tail_acc0, tail_acc1;
    auto store_tail = [&](auto s) __attribute__((always_inline)) {
      using Kind = SlotKind<Kind0, Kind1, decltype(s)::value>;
      if constexpr (Kind::kTail) {
        if (tile.tail) StoreTail<Kind>(c.gemm[decltype(s)::value], tile, thread, tail_acc0,
                                       tail_acc1);
      }
    };
    auto zero_tail = [&](auto s) __attribute__((always_inline)) {
      using Kind = SlotKind<Kind0, Kind1, decltype(s)::value>;
      if constexpr (Kind::kTail) {
        if (tile.tail && tile.tail_last) {
          ZeroTailPadding<Kind>(c.gemm[decltype(s)::value], tile, thread);
        }
      }
    };
    // mma(extra) with the tile's tail MMAs (TailMma) when it carries a tail, else NoTail.
    auto with_tail = [&](auto mma) __attribute__((always_inline)) {
      if constexpr (Kind0::kTail) {
        if (tile.tail) {
          mma(MakeTailMma<Kind0>(smem, wg, thread % 128, tail_acc0, tail_acc1));
          return;
        }
      }
      mma(NoTail{});
    };
    if (!tile.split()) {
      auto acc = cute::partition_fragment_C(
          typename GemmLayouts<Kind0>::TiledMma{},
          cute::Shape<cute::Int<C::kBlockM>, cute::Int<C::kBlockN>>{});
      // The SwiGLU backward's first g and u, in flight during the MMAs.
      uint4 gu_ahead[2][4];
      if constexpr (Kind0::kEpi == Epilogue::kSwiGLUBwd) {
        WithSlot<kSlots>(i, [&](auto s) __attribute__((always_inline)) {
          SwiGLUBwdLoadAhead(c.gemm[decltype(s)::value], tile, thread,
                             {tile.m0 + wg * kWarpgroupRows, 0}, gu_ahead);
        });
      }
      with_tail([&](auto extra) __attribute__((always_inline)) {
        MmaTile<Kind0, kClusterM>(tile, smem, thread, acc, it, extra);
      });
      WithSlot<kSlots>(i, [&](auto s) __attribute__((always_inline)) {
        constexpr int kSlot = decltype(s)::value;
        const WarpgroupPart part{tile.m0 + wg * kWarpgroupRows, 0};
        if constexpr (Kind0::kTmaStore) {
          StageSlab(c.gemm[kSlot], tile, smem, thread, part, acc, cs.slabs, slabs_posted,
                    kSlot);
        } else {
          store_tail(s);  // first: its accumulators' registers are free for StoreTile's
          StoreTile<SlotKind<Kind0, Kind1, kSlot>, (kClusterM > 1)>(
              c.gemm[kSlot], tile, smem, thread, part, acc,
              Kind0::kEpi == Epilogue::kSwiGLUBwd ? gu_ahead : nullptr);
          zero_tail(s);
          publish(s);
        }
      });
    } else if constexpr (kSched == Schedule::kRowsByGroup) {
      // Half: both warpgroups on the 64 rows, one column part each. Narrow: each on its own
      // 64 rows, column part 0. (Both: the second part is out of range; its stores are
      // skipped.)
      const int a_block = tile.half ? 0 : wg, part = tile.half ? wg : 0;
      auto acc = cute::partition_fragment_C(
          typename SplitLayouts<Kind0>::TiledMma{},
          cute::Shape<cute::Int<kWarpgroupRows>, cute::Int<C::kBlockN / 2>>{});
      // A narrow tile may carry a tail; a half tile never does.
      auto mma_split = [&](auto kind, auto extra) __attribute__((always_inline)) {
        MmaTileSplit<decltype(kind), kClusterM>(tile, smem, thread % 128, a_block, part, acc,
                                                it, extra);
      };
      auto mma_kind = [&](auto extra) __attribute__((always_inline)) {
        if (std::is_same_v<typename SplitLayouts<Kind0>::PartB,
                           typename SplitLayouts<Kind1>::PartB> || i < 2) {
          mma_split(Kind0{}, extra);
        } else {
          mma_split(Kind1{}, extra);
        }
      };
      with_tail(mma_kind);
      WithSlot<kSlots>(i, [&](auto s) __attribute__((always_inline)) {
        constexpr int kSlot = decltype(s)::value;
        store_tail(s);
        StoreTile<SlotKind<Kind0, Kind1, kSlot>, (kClusterM > 1)>(
            c.gemm[kSlot], tile, smem, thread,
            {tile.m0 + a_block * kWarpgroupRows, part}, acc);
        zero_tail(s);
        publish(s);
      });
    }
  }
  // The staging must outlive the last TMA stores' reads of it: the storer says when.
  if (thread % 128 == 0) {
    if constexpr (Kind0::kTmaStore) EndSlabs(cs.slabs, thread / 128, slabs_posted);
    else BulkWaitAll();
  }
}

// RunConsumer for FP8 chains (GemmKind::kFp8): each handed-over tile's MMAs with its block
// scales (MmaTileFp8) and its epilogue, then publishing its rows as RunConsumer does. FP8 tiles
// carry no tails and are never split or clustered.
template <class Kind0, class Kind1, int kSlots>
__device__ __forceinline__ void RunConsumerFp8(const ChainParams& c, ChainStorage<Kind0> st,
                                               uint32_t& it) {
  using C = GemmConfig;
  constexpr int kConsumerThreads = 128 * C::kConsumerWarpgroups;
  static_assert(Kind0::kFp8 && Kind1::kFp8, "an FP8 chain's GEMMs are all FP8");
  auto& smem = st.smem;
  ChainSmem& cs = st.cs;
  const int thread = threadIdx.x - 128;
  const int wg = thread / 128;
#pragma unroll 1
  for (uint32_t j = 0;; ++j) {
    const TakenTile taken = TakeTile(cs, j);
    const int i = taken.chain;
    const GemmTile& tile = taken.tile;
    if (i < 0) break;
    Fp8BScales scales;
    WithSlot<kSlots>(i, [&](auto s) __attribute__((always_inline)) {
      constexpr int kSlot = decltype(s)::value;
      scales = Fp8BScalesOf<SlotKind<Kind0, Kind1, kSlot>>(c.gemm[kSlot], tile);
    });
    auto acc = cute::partition_fragment_C(
        typename GemmLayouts<Kind0>::TiledMma{},
        cute::Shape<cute::Int<C::kBlockM>, cute::Int<C::kBlockN>>{});
    MmaTileFp8<Kind0>(tile, smem, thread, acc, it, scales);
    WithSlot<kSlots>(i, [&](auto s) __attribute__((always_inline)) {
      constexpr int kSlot = decltype(s)::value;
      StoreTile<SlotKind<Kind0, Kind1, kSlot>>(c.gemm[kSlot], tile, smem, thread,
                                               {tile.m0 + wg * kWarpgroupRows, 0}, acc);
      // As RunConsumer's publish: the TMA stores complete, every thread's plain stores (the
      // h scales) ordered before the async proxy's reads, then thread 0's release.
      if (c.ready_base[kSlot] >= 0) {
        if (thread % 128 == 0) BulkWaitAll();
        FenceProxyAsyncGlobal();
        NamedBarrierSync(1, kConsumerThreads);
        if (thread == 0) AddRelease(c.ready + c.ready_base[kSlot] + tile.row_tile, 1);
      }
    });
  }
  if (thread % 128 == 0) BulkWaitAll();  // the staging outlives the last TMA stores' reads
}

// The tiles of the chain `c` that this CTA takes, in the role of one warpgroup, run once a
// warpgroup has set its registers (setmaxnreg): kProducer for warpgroup 0 (its thread 0 the
// scheduler, warps 1 and 2 the storers), else a consumer warpgroup's. The roles meet at CTA
// barriers in their separate copies of this code, hence CtaSync rather than __syncthreads.
// kClusterM = 2: the CTAs of a cluster take units of two tiles (ScheduleUnit), rank 0 from the
// queue, and hands each to rank 1 through unit_tile.
template <class Kind0, class Kind1, int kSlots, bool kProducer, int kClusterM = 1>
__device__ __forceinline__ void RunChain(const ChainParams& c, uint8_t* smem_raw) {
  static_assert(Kind0::kMajorA == Kind1::kMajorA && Kind0::kMajorB == Kind1::kMajorB &&
                    Kind0::kSched == Kind1::kSched,
                "the GEMMs of a chain share shared-memory layouts, MMA and schedule");
  static_assert(Kind0::kTmaStore == Kind1::kTmaStore && Kind0::kStages == Kind1::kStages &&
                    Kind0::kBlockK == Kind1::kBlockK && Kind0::kTail == Kind1::kTail,
                "the GEMMs of a chain share the pipeline, staging and tails");
  static_assert(kGemmSmemBytes<Kind0> <= 227 * 1024, "past an H100/H200 CTA's shared memory");
  static_assert(kClusterM == 1 || (kClusterM == 2 && Kind0::kSched == Schedule::kRowsByGroup),
                "clusters of two row-grouped GEMM CTAs");
  const ChainStorage<Kind0> st = ChainStorageOf<Kind0>(smem_raw);
  const uint32_t rank = kClusterM > 1 ? ClusterRank() : 0;
  const int32_t* tile_start = ChainPrologue<Kind0, Kind1, kSlots, kProducer, kClusterM>(c, st);
  // Both roles walk the same tiles in the same order; `it` keeps their stages in step.
  std::conditional_t<Kind0::kRuns, StageRing, uint32_t> it{};
  if constexpr (kProducer) {
    RunStorer<Kind0, kSlots>(c, st);
    if (threadIdx.x == 0)
      RunScheduler<Kind0, Kind1, kSlots, kClusterM>(c, st, tile_start, rank, it);
  } else if constexpr (Kind0::kFp8) {
    static_assert(kClusterM == 1, "FP8 tiles run one CTA a tile");
    RunConsumerFp8<Kind0, Kind1, kSlots>(c, st, it);
  } else {
    RunConsumer<Kind0, Kind1, kSlots, kClusterM>(c, st, it);
  }
}

template <class Kind0, class Kind1, int kSlots, int kClusterM>
__global__ void __launch_bounds__(GemmConfig::kThreads, 1)
    GemmChainKernel(const __grid_constant__ ChainParams c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t smem_raw[];
  using C = GemmConfig;
  // The weight gradients' producer also keeps the runs of its queue (ChainParams::run_tiles),
  // which would spill at kProducerRegs; their consumers fit in the clustered launches' split.
  constexpr bool kWideProducer = kClusterM > 1 || Kind0::kRuns;
  if (threadIdx.x < 128) {
    SetMaxRegistersDec<kWideProducer ? C::kClusterProducerRegs : C::kProducerRegs>();
    RunChain<Kind0, Kind1, kSlots, true, kClusterM>(c, smem_raw);
  } else {
    SetMaxRegistersInc<kWideProducer ? C::kClusterConsumerRegs : C::kConsumerRegs>();
    RunChain<Kind0, Kind1, kSlots, false, kClusterM>(c, smem_raw);
  }
  // No CTA leaves while its peer may still multicast into it or arrive on its barriers.
  if constexpr (kClusterM > 1) ClusterSync();
#endif
}

}  // namespace mok::sm90
