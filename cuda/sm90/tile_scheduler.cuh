// Which output tile a linear tile index is, and over which reduction range (the launch's
// device queue hands the indices out in order, gemm_kernel.cuh). Within a group the tiles come
// in bands of raster_rows row tiles, rows fastest inside a band, so the CTAs busy at once share
// a few weight column panels and a few row blocks of A. Column tiles fastest instead made every
// row tile re-read all of a large expert's weights from HBM (mixtral's gate|up: 235 MB per
// expert, 16 row tiles). The group offsets live in shared memory: finding a tile's group is a
// short search there, not a chain of global loads at the start of every tile. Row tiles are
// numbered without gaps, so that every index up to the last is work (block_m = 64 would
// otherwise leave every other index empty).
#pragma once

#include <cstdint>

#include "gemm_config.cuh"

namespace mok::sm90 {

struct GemmTile {
  int64_t m0;       // first row (kRowsByGroup: routed row; kGroupedK: row of C_g)
  int n_tile;       // column tile: kBlockN columns (kSwiGLU: kBlockN / 2 of each of gate, up)
  int group;
  int64_t m_end;    // rows of the output that exist: stores stop there
  int64_t k_begin;  // kGroupedK: first routed row of the group
  int num_k;        // k-steps of the GemmKind's kBlockK
  int row_tile;     // kRowsByGroup: the row tile among all groups' (ScanGroupTiles numbering)
  bool half;        // only rows [m0, m0 + 64) are the group's
  bool narrow;      // only the first half of the tile's columns are in range
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

// tile_start[g] = the first row tile of group g, when the kBlockM-row tiles of all groups are
// numbered without gaps (a group of c rows has ceil(c / kBlockM) of them, the last a half tile
// when c mod kBlockM = 64); tile_start[groups] = all of them. Run by one warp.
__device__ __forceinline__ void ScanGroupTiles(const int32_t* offsets, int groups, int lane,
                                               int32_t* tile_start) {
  constexpr int kM = GemmConfig::kBlockM;
  const int per_lane = (groups + 31) / 32;
  const int g0 = min(lane * per_lane, groups), g1 = min(g0 + per_lane, groups);
  int sum = 0;
  for (int g = g0; g < g1; ++g) sum += (offsets[g + 1] - offsets[g] + kM - 1) / kM;
  int inclusive = sum;
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  int run = inclusive - sum;
  for (int g = g0; g < g1; ++g) {
    tile_start[g] = run;
    run += (offsets[g + 1] - offsets[g] + kM - 1) / kM;
  }
  if (lane == 31) tile_start[groups] = inclusive;
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

// offsets, tile_start: the groups' offsets and ScanGroupTiles in shared memory, or null (one
// group); used_end (kGroupedK): UsedRowEnds in shared memory, or null (the padded ends).
// `linear` < TileCount (the launch's queue hands out no other). kTileCols: the output columns
// of a column tile (kSwiGLU: of h).
template <Schedule kSched, int kBlockK, int kTileCols>
__device__ __forceinline__ GemmTile ScheduleTile(const GemmParams& p, const int32_t* offsets,
                                                 const int32_t* tile_start,
                                                 const int32_t* used_end, int64_t linear) {
  using C = GemmConfig;
  GemmTile t;
  t.half = false;
  t.narrow = false;
  t.k_begin = 0;
  t.group = 0;
  if constexpr (kSched == Schedule::kRowsByGroup) {
    int64_t first = 0, rows = (p.m_total + C::kBlockM - 1) / C::kBlockM;
    if (offsets) {
      // The last group whose first tile is at or before this one (empty groups share their
      // first tile with the next group).
      int lo = 0, hi = p.groups - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (int64_t{tile_start[mid]} * p.n_tiles <= linear) lo = mid; else hi = mid - 1;
      }
      t.group = lo;
      first = tile_start[lo];
      rows = tile_start[lo + 1] - first;
    }
    const RasterPos pos = Raster(linear - first * p.n_tiles, rows, p.n_tiles, p.raster_rows);
    t.n_tile = pos.col;
    t.row_tile = static_cast<int>(first + pos.row);
    t.m0 = (offsets ? offsets[t.group] : 0) + pos.row * C::kBlockM;
    t.m_end = offsets ? offsets[t.group + 1] : p.m_total;
    t.half = offsets && t.m_end - t.m0 <= C::kBlockM / 2;
    t.narrow = p.n - t.n_tile * kTileCols <= kTileCols / 2;
    t.num_k = p.k / kBlockK;
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
  }
  return t;
}

}  // namespace mok::sm90
