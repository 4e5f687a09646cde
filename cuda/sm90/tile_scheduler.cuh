// Which output tiles a CTA computes, and over which reduction range. Persistent: CTA c takes the
// linear tiles c, c + grid, c + 2 grid, ..., column tiles fastest, so the CTAs busy at once share
// row blocks of A (read from HBM once) and the weights of a few experts (L2). The group offsets
// live in shared memory: finding a tile's group is a short search there, not a chain of global
// loads at the start of every tile.
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
  bool valid;       // false: no tile starts at this linear index
  bool half;        // only rows [m0, m0 + 64) are the group's: the second warpgroup idles
};

// Linear tiles of one launch: the grid strides over them.
template <Schedule kSched>
inline int64_t LinearTiles(const GemmParams& p) {
  if constexpr (kSched == Schedule::kRowsByGroup) {
    // With offsets, a tile may start at every block_m-th row; only those at an even multiple of
    // kBlockM into their group do (the others are the second halves of tiles, and are skipped).
    const int64_t rows_per_index = p.offsets ? p.block_m : GemmConfig::kBlockM;
    return (p.m_total + rows_per_index - 1) / rows_per_index * p.n_tiles;
  } else {
    return int64_t{p.groups} * p.m_tiles * p.n_tiles;
  }
}

// offsets: the groups' offsets copied to shared memory, or null (one group).
template <Schedule kSched>
__device__ __forceinline__ GemmTile ScheduleTile(const GemmParams& p, const int32_t* offsets,
                                                 int64_t linear) {
  using C = GemmConfig;
  GemmTile t;
  t.n_tile = static_cast<int>(linear % p.n_tiles);
  const int64_t rest = linear / p.n_tiles;
  t.valid = true;
  t.half = false;
  t.k_begin = 0;
  t.group = 0;
  if constexpr (kSched == Schedule::kRowsByGroup) {
    t.m0 = rest * (offsets ? p.block_m : C::kBlockM);
    t.m_end = offsets ? offsets[p.groups] : p.m_total;
    t.valid = t.m0 < t.m_end;
    if (offsets && t.valid) {
      // The last group starting at or before m0; empty groups share their start with the next.
      int lo = 0, hi = p.groups - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= t.m0) lo = mid; else hi = mid - 1;
      }
      t.group = lo;
      t.valid = (t.m0 - offsets[lo]) % C::kBlockM == 0;
      t.m_end = offsets[lo + 1];
      t.half = t.m_end - t.m0 <= C::kBlockM / 2;
    }
    t.num_k = p.k / C::kBlockK;
  } else {
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
