// Which output tiles a CTA computes, and over which reduction range. CTA c takes the linear
// tiles c, c + grid, c + 2 grid, ... (many on a persistent grid of one CTA per SM, one on
// a grid of one CTA per tile), column tiles fastest, so the CTAs busy at once share
// row blocks of A (read from HBM once) and the weights of a few experts (L2). The group offsets
// live in shared memory: finding a tile's group is a short search there, not a chain of global
// loads at the start of every tile. Row tiles are numbered without gaps, so that every index up
// to the last is work (block_m = 64 would otherwise leave every other index empty).
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
  int num_k;        // k-steps of kBlockK
  bool valid;       // false: past the last tile
  bool half;        // only rows [m0, m0 + 64) are the group's: the second warpgroup idles
};

// An upper bound on the linear tiles of one launch; the grid strides over them and stops at the
// first index past the last tile.
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

// offsets, tile_start: the groups' offsets and ScanGroupTiles in shared memory, or null (one
// group). Tiles come in increasing linear order; the first invalid one ends the CTA's walk.
template <Schedule kSched>
__device__ __forceinline__ GemmTile ScheduleTile(const GemmParams& p, const int32_t* offsets,
                                                 const int32_t* tile_start, int64_t linear) {
  using C = GemmConfig;
  GemmTile t;
  t.n_tile = static_cast<int>(linear % p.n_tiles);
  const int64_t rest = linear / p.n_tiles;
  t.valid = true;
  t.half = false;
  t.k_begin = 0;
  t.group = 0;
  if constexpr (kSched == Schedule::kRowsByGroup) {
    if (offsets) {
      t.valid = rest < tile_start[p.groups];
      if (!t.valid) return t;
      // The last group whose first tile is at or before this one (empty groups share their
      // first tile with the next group).
      int lo = 0, hi = p.groups - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= rest) lo = mid; else hi = mid - 1;
      }
      t.group = lo;
      t.m0 = offsets[lo] + (rest - tile_start[lo]) * C::kBlockM;
      t.m_end = offsets[lo + 1];
      t.half = t.m_end - t.m0 <= C::kBlockM / 2;
    } else {
      t.m0 = rest * C::kBlockM;
      t.m_end = p.m_total;
      t.valid = t.m0 < t.m_end;
    }
    t.num_k = p.k / C::kBlockK;
  } else {
    t.valid = rest < int64_t{p.groups} * p.m_tiles;
    t.group = static_cast<int>(rest / p.m_tiles);
    t.m0 = (rest % p.m_tiles) * C::kBlockM;
    t.m_end = p.m;
    t.k_begin = offsets ? offsets[t.group] : 0;
    const int64_t k_end = offsets ? offsets[t.group + 1] : p.m_total;
    t.num_k = static_cast<int>((k_end - t.k_begin + C::kBlockK - 1) / C::kBlockK);
  }
  return t;
}

}  // namespace mok::sm90
