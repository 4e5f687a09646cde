// Which output tile a CTA computes, and over which reduction range. One CTA per tile, column
// tiles fastest: the CTAs resident at once share row blocks of A (read from HBM once) and the
// weights of a few experts (L2).
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
  bool valid;
};

template <Schedule kSched>
__device__ __forceinline__ GemmTile ScheduleTile(const GemmParams& p) {
  using C = GemmConfig;
  GemmTile t;
  const int64_t linear = blockIdx.x;
  t.n_tile = static_cast<int>(linear % p.n_tiles);
  const int64_t rest = linear / p.n_tiles;
  t.valid = true;
  t.k_begin = 0;
  if constexpr (kSched == Schedule::kRowsByGroup) {
    t.m0 = rest * C::kBlockM;
    t.group = 0;
    t.m_end = p.offsets ? p.offsets[p.groups] : p.m_total;
    t.valid = t.m0 < t.m_end;
    if (p.offsets && t.valid) {
      // The last group starting at or before m0; empty groups share their start with the next.
      int lo = 0, hi = p.groups - 1;
      while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (p.offsets[mid] <= t.m0) lo = mid; else hi = mid - 1;
      }
      t.group = lo;
    }
    t.num_k = p.k / C::kBlockK;
  } else {
    t.group = static_cast<int>(rest / p.m_tiles);
    t.m0 = (rest % p.m_tiles) * C::kBlockM;
    t.m_end = p.m;
    t.k_begin = p.offsets ? p.offsets[t.group] : 0;
    const int64_t k_end = p.offsets ? p.offsets[t.group + 1] : p.m_total;
    t.num_k = static_cast<int>((k_end - t.k_begin + C::kBlockK - 1) / C::kBlockK);
  }
  return t;
}

}  // namespace mok::sm90
