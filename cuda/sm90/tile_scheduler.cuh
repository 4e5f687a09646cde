// Which output tile a linear tile index is, and over which reduction range (the launch's
// device queue hands the indices out in order, gemm_kernel.cuh). Within a group the tiles come
// in bands of raster_rows row tiles, rows fastest inside a band, so the CTAs busy at once share
// a few weight column panels and a few row blocks of A. Column tiles fastest instead would make
// every row tile re-read all of a large expert's weights from HBM (mixtral's gate|up: 235 MB per
// expert, 16 row tiles). The group offsets live in shared memory: finding a tile's group is a
// short search there, not a chain of global loads at the start of every tile. Row tiles are
// numbered without gaps, so that every index up to the last is work (block_m = 64 would
// otherwise leave every other index empty).
#pragma once

#include <cstdint>

#include "gemm_config.cuh"

namespace mok::sm90 {

// What a CTA's tile shares with its peer's in a cluster of two (ScheduleUnit). kSharesB: a
// pair of row tiles of one column tile, each CTA loading half of B for both. kSharesA: two
// column tiles of one row tile, whose A (the same k-tiles) rank 0 loads for both. kAbsent: the
// CTA has no tile in the unit; it walks the unit's k-steps to keep its pipeline in step with
// the peer's.
enum class Pairing : uint8_t { kNone, kSharesB, kSharesA, kAbsent };

struct GemmTile {
  int64_t m0;       // first row (kRowsByGroup: routed row; kGroupedK: row of C_g)
  int n_tile;       // column tile: kBlockN columns (kSwiGLU: kBlockN / 2 of each of gate, up)
  int group;
  int64_t m_end;    // rows of the output that exist: stores stop there
  int64_t k_begin;  // kGroupedK: first routed row of the group
  int num_k;        // k-steps of the GemmKind's kBlockK
  // kGroupedK: the k16 blocks at the end of the last k-step past the group's used rows, whose
  // MMAs would multiply only padding rows (zeros) and are not issued (MmaSteps).
  int idle_k16;
  int row_tile;     // kRowsByGroup: the row tile among all groups' (ScanGroupTiles numbering)
  bool half;        // only rows [m0, m0 + 64) are the group's
  bool narrow;      // only the first half of the tile's columns are in range
  Pairing pairing;  // in clusters of two (ScheduleUnit): what the tile shares with the peer's
  // kTail: kTailRows of the group's tail rows, [m0 + tail_at, m0 + tail_at + kTailRows), ride
  // in this tile; tail_last: the group's last tail, after which its padding rows get zeros.
  bool tail;
  bool tail_last;
  int tail_at;
  // kGroupedK in runs (ChainParams::run_tiles): k-step kt runs in stage kt (the reduction fits
  // in the stages; StageOf), and B's k-tiles are those the tile before it left there (keep_b).
  bool fixed_stages;
  bool keep_b;
  // Half and narrow tiles are split (MmaTileSplit): a warpgroup multiplies 64 x 128.
  __host__ __device__ bool split() const { return half || narrow; }
};

// An upper bound on the linear tiles of one GEMM, known on the host (it sizes the grid);
// TileCount is the exact count, known on the device once the offsets are.
template <Schedule kSched>
inline int64_t LinearTiles(const GemmParams& p) {
  if constexpr (kSched == Schedule::kRowsByGroup) {
    // With offsets every tile holds at least block_m of the m_total rows.
    const int64_t rows_per_tile = p.offsets ? p.block_m : GemmConfig::kBlockM;
    return (p.m_total + rows_per_tile - 1) / rows_per_tile * p.n_tiles;
  } else {
    return int64_t{p.groups} * p.m_tiles * p.n_tiles;
  }
}

// The tiles of one GEMM, exactly (LinearTiles bounds them on the host); tile_start as in
// ScheduleTile, or null.
template <Schedule kSched>
__device__ __forceinline__ int64_t TileCount(const GemmParams& p, const int32_t* tile_start) {
  if constexpr (kSched == Schedule::kRowsByGroup) {
    const int64_t rows = tile_start ? int64_t{tile_start[p.groups]}
                                    : (p.m_total + GemmConfig::kBlockM - 1) / GemmConfig::kBlockM;
    return rows * p.n_tiles;
  } else {
    return int64_t{p.groups} * p.m_tiles * p.n_tiles;
  }
}

// out[g] = the sum of count(h) over the groups h < g; out[groups] = the sum over all. Run by
// one warp: each lane sums a run of groups, then a scan across the lanes.
template <class Count>
__device__ __forceinline__ void ScanGroups(int groups, int lane, Count count, int32_t* out) {
  const int per_lane = (groups + 31) / 32;
  const int g0 = min(lane * per_lane, groups), g1 = min(g0 + per_lane, groups);
  int sum = 0;
  for (int g = g0; g < g1; ++g) sum += count(g);
  int inclusive = sum;
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  int run = inclusive - sum;
  for (int g = g0; g < g1; ++g) {
    out[g] = run;
    run += count(g);
  }
  if (lane == 31) out[groups] = inclusive;
}

// The tails of group g (kTail; used_end: UsedRowEnds): its rows past the last multiple of
// kBlockM in pieces of kTailRows, one on each of its last full row tiles, when it has more than
// kBlockM used rows and at most max_tails (and its full row tiles) suffice; else 0, and its last
// rows are a row tile of their own.
//
// Such a row tile streams all of B for a few rows: a half tile costs nearly a full one where the
// bytes into shared memory bound the launch, a tail about a sixteenth (2 KB a 48 KB stage, and
// m64n16 MMAs).
__device__ __forceinline__ int TailCount(const int32_t* offsets, const int32_t* used_end, int g,
                                         int max_tails) {
  constexpr int kM = GemmConfig::kBlockM;
  const int used = used_end[g] - offsets[g];
  const int full = used / kM, tails = (used % kM + kTailRows - 1) / kTailRows;
  return full > 0 && tails <= min(full, max_tails) ? tails : 0;
}

// tile_start[g] = the first row tile of group g, when the kBlockM-row tiles of all groups are
// numbered without gaps (a group of c rows has ceil(c / kBlockM) of them, the last a half tile
// when c mod kBlockM = 64; one with tails, floor(used / kBlockM)); tile_start[groups] = all of
// them. With used_end (UsedRowEnds, kTail), which it then overwrites with tail_first[g]: the
// first of group g's row tiles that take a tail (the rest of its row tiles do too), or -1. Run
// by one warp.
__device__ __forceinline__ void ScanGroupTiles(const int32_t* offsets, int32_t* used_end,
                                               int groups, int max_tails, int lane,
                                               int32_t* tile_start) {
  constexpr int kM = GemmConfig::kBlockM;
  ScanGroups(groups, lane, [&](int g) {
    if (used_end && TailCount(offsets, used_end, g, max_tails) > 0)
      return (used_end[g] - offsets[g]) / kM;
    return (offsets[g + 1] - offsets[g] + kM - 1) / kM;
  }, tile_start);
  if (used_end) {
    __syncwarp();
    for (int g = lane; g < groups; g += 32) {
      const int tails = TailCount(offsets, used_end, g, max_tails);
      used_end[g] = tails > 0 ? (used_end[g] - offsets[g]) / kM - tails : -1;
    }
  }
}

// used_end[g] = the end of group g's used rows (its first padding row, or its end): rows of
// a group are its routes first, then fewer than block_m <= 128 padding rows (row_tokens -1), so
// the last 128 rows hold the boundary. One warp per group; `warp` of `warps`.
__device__ __forceinline__ void UsedRowEnds(const int32_t* offsets, const int32_t* row_tokens,
                                            int groups, int warp, int warps, int lane,
                                            int32_t* used_end) {
  for (int g = warp; g < groups; g += warps) {
    const int begin = offsets[g], end = offsets[g + 1];
    int last = begin;
    for (int r = max(begin, end - 128) + lane; r < end; r += 32) {
      if (row_tokens[r] >= 0) last = r + 1;
    }
    last = __reduce_max_sync(0xffffffffu, last);
    if (lane == 0) used_end[g] = last;
  }
}

// The (row tile, column tile) of tile `local` of a group with `rows` row tiles and `cols`
// column tiles: bands of `band` row tiles, rows fastest within a band.
struct RasterPos {
  int64_t row;
  int col;
};
__device__ __forceinline__ RasterPos Raster(int64_t local, int64_t rows, int cols, int band) {
  const int64_t per_band = int64_t{band} * cols;
  const int64_t b = local / per_band;
  const int64_t in_band = local - b * per_band;
  const int64_t band_rows = min(int64_t{band}, rows - b * band);
  return {b * band + in_band % band_rows, static_cast<int>(in_band / band_rows)};
}

// Row tile `row` of the `rows` of group t.group (whose first is tile `first` of all groups')
// and column tile `col` of a kRowsByGroup GEMM, into t. tail_first: kTail's (ScanGroupTiles),
// or null. Tail j of a group (its row tile tail_first + j) is its rows [kBlockM rows + kTailRows
// j, + kTailRows).
template <int kBlockK, int kTileCols>
__device__ __forceinline__ void PlaceRowTile(const GemmParams& p, const int32_t* offsets,
                                             const int32_t* tail_first, int64_t first,
                                             int64_t rows, int64_t row, int col, GemmTile& t) {
  constexpr int kM = GemmConfig::kBlockM;
  const int64_t first_tail = tail_first ? tail_first[t.group] : -1;
  const int64_t tail = row - first_tail;
  t.tail = first_tail >= 0 && tail >= 0;
  t.tail_last = row == rows - 1;
  t.tail_at = static_cast<int>((rows - row) * kM + tail * kTailRows);
  t.n_tile = col;
  t.row_tile = static_cast<int>(first + row);
  t.m0 = (offsets ? offsets[t.group] : 0) + row * kM;
  t.m_end = offsets ? offsets[t.group + 1] : p.m_total;
  t.half = offsets && t.m_end - t.m0 <= kM / 2;
  t.narrow = p.n - t.n_tile * kTileCols <= kTileCols / 2;
  t.num_k = p.k / kBlockK;
}

// A tile with no rows placed yet and no flags set.
__device__ __forceinline__ GemmTile BlankTile() {
  GemmTile t;
  t.half = false;
  t.narrow = false;
  t.pairing = Pairing::kNone;
  t.tail = false;
  t.tail_last = false;
  t.tail_at = 0;
  t.fixed_stages = false;
  t.keep_b = false;
  t.idle_k16 = 0;
  t.k_begin = 0;
  t.group = 0;
  return t;
}

// The last of `groups` groups whose first linear index, first(g) (nondecreasing), is at or
// before `linear` (an empty group shares its first index with the next group).
template <class First>
__device__ __forceinline__ int FindGroup(int groups, int64_t linear, First first) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first(mid) <= linear) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// offsets, tile_start: the groups' offsets and ScanGroupTiles in shared memory, or null (one
// group); used_end: kGroupedK's UsedRowEnds in shared memory (the reduction ends there), or
// kTail's tail_first (ScanGroupTiles), or null (the padded ends; no tails).
// `linear` < TileCount (the launch's queue hands out no other). kTileCols: the output columns
// of a column tile (kSwiGLU: of h).
template <Schedule kSched, int kBlockK, int kTileCols>
__device__ __forceinline__ GemmTile ScheduleTile(const GemmParams& p, const int32_t* offsets,
                                                 const int32_t* tile_start,
                                                 const int32_t* used_end, int64_t linear) {
  using C = GemmConfig;
  GemmTile t = BlankTile();
  if constexpr (kSched == Schedule::kRowsByGroup) {
    int64_t first = 0, rows = (p.m_total + C::kBlockM - 1) / C::kBlockM;
    if (offsets) {
      t.group = FindGroup(p.groups, linear,
                          [&](int g) { return int64_t{tile_start[g]} * p.n_tiles; });
      first = tile_start[t.group];
      rows = tile_start[t.group + 1] - first;
    }
    const RasterPos pos = Raster(linear - first * p.n_tiles, rows, p.n_tiles, p.raster_rows);
    PlaceRowTile<kBlockK, kTileCols>(p, offsets, used_end, first, rows, pos.row, pos.col, t);
  } else {
    const int64_t per_group = int64_t{p.m_tiles} * p.n_tiles;
    t.group = static_cast<int>(linear / per_group);
    const RasterPos pos = Raster(linear - t.group * per_group, p.m_tiles, p.n_tiles,
                                 p.raster_rows);
    t.n_tile = pos.col;
    t.row_tile = 0;
    t.m0 = pos.row * C::kBlockM;
    t.m_end = p.m;
    t.k_begin = offsets ? offsets[t.group] : 0;
    const int64_t k_end = used_end ? used_end[t.group]
                          : offsets ? offsets[t.group + 1] : p.m_total;
    t.num_k = static_cast<int>((k_end - t.k_begin + kBlockK - 1) / kBlockK);
    // dsv3's 128 +- 11 routes an expert end half of its weight-gradient tiles in a 64-deep
    // k-step of 1-22 used rows: the k16 blocks past them are not multiplied (idle_k16), which
    // on an H200 takes about 1.7% off that launch.
    const int last_rows = static_cast<int>(k_end - t.k_begin) - (t.num_k - 1) * kBlockK;
    t.idle_k16 = t.num_k > 0 ? (kBlockK - (last_rows + 15) / 16 * 16) / 16 : 0;
  }
  return t;
}

// Clusters of two CTAs (kRowsByGroup). The queue hands out units, and both CTAs of a cluster
// take each: a pair of row tiles 2q, 2q + 1 of one group and one column tile, whose B (the
// group's weights) each CTA loads half of for both (TMA multicast), so that L2 serves B once
// for two row tiles; or, for a group's last row tile when it has an odd number, two of its
// column tiles side by side, whose A (the same rows) rank 0 loads for both (rank 1 has none
// past the last column, and then rank 0 loads its A alone).
// Within a group the pairs come first, in bands of raster_rows / 2 pairs as ScheduleTile's
// row tiles, then the odd row tile's units.
//
// pair_start[g] = the pairs of row tiles of the groups before g, from ScanGroupTiles' counts;
// pair_start[groups] = all of them. Run by one warp.
__device__ __forceinline__ void ScanGroupPairs(const int32_t* tile_start, int groups, int lane,
                                               int32_t* pair_start) {
  ScanGroups(groups, lane, [&](int g) { return (tile_start[g + 1] - tile_start[g]) / 2; },
             pair_start);
}

// The units before group g (g = groups: all of them) of a GEMM with `n_tiles` column tiles:
// tiles / pairs are the row tiles / pairs before it.
__device__ __forceinline__ int64_t UnitsBefore(int64_t tiles, int64_t pairs, int n_tiles) {
  return pairs * n_tiles + (tiles - 2 * pairs) * ((n_tiles + 1) / 2);
}

// The units of one GEMM (kRowsByGroup); tile_start and pair_start in shared memory, or null.
__device__ __forceinline__ int64_t UnitCount(const GemmParams& p, const int32_t* tile_start,
                                             const int32_t* pair_start) {
  const int64_t rows = tile_start ? int64_t{tile_start[p.groups]}
                                  : (p.m_total + GemmConfig::kBlockM - 1) / GemmConfig::kBlockM;
  const int64_t pairs = pair_start ? int64_t{pair_start[p.groups]} : rows / 2;
  return UnitsBefore(rows, pairs, p.n_tiles);
}

// The tile of the CTA of rank `rank` in unit `linear` < UnitCount; tail_first as in
// ScheduleTile.
template <int kBlockK, int kTileCols>
__device__ __forceinline__ GemmTile ScheduleUnit(const GemmParams& p, const int32_t* offsets,
                                                 const int32_t* tile_start,
                                                 const int32_t* pair_start,
                                                 const int32_t* tail_first, int64_t linear,
                                                 int rank) {
  GemmTile t = BlankTile();
  int64_t first = 0, rows = (p.m_total + GemmConfig::kBlockM - 1) / GemmConfig::kBlockM;
  int64_t local = linear;
  if (offsets) {
    t.group = FindGroup(p.groups, linear, [&](int g) {
      return UnitsBefore(tile_start[g], pair_start[g], p.n_tiles);
    });
    first = tile_start[t.group];
    rows = tile_start[t.group + 1] - first;
    local = linear - UnitsBefore(first, pair_start[t.group], p.n_tiles);
  }
  const int64_t pairs = rows / 2;
  if (local < pairs * p.n_tiles) {
    const RasterPos pos = Raster(local, pairs, p.n_tiles, max(1, p.raster_rows / 2));
    PlaceRowTile<kBlockK, kTileCols>(p, offsets, tail_first, first, rows, 2 * pos.row + rank,
                                     pos.col, t);
    t.pairing = t.narrow ? Pairing::kNone : Pairing::kSharesB;
  } else {
    const int col = 2 * static_cast<int>(local - pairs * p.n_tiles) + rank;
    PlaceRowTile<kBlockK, kTileCols>(p, offsets, tail_first, first, rows, rows - 1,
                                     min(col, p.n_tiles - 1), t);
    // Rank 1 past the last column tile has none; else the unit's second column tile exists.
    t.pairing = col >= p.n_tiles        ? Pairing::kAbsent
                : (col | 1) < p.n_tiles ? Pairing::kSharesA
                                        : Pairing::kNone;
  }
  return t;
}

}  // namespace mok::sm90
