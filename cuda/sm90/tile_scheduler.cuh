// Which output tile a CTA computes. One CTA per tile, column tiles fastest: the CTAs resident
// at once share row blocks of A (read from HBM once) and the weights of a few experts (L2).
#pragma once

#include <cstdint>

#include "gemm_config.cuh"

namespace mok::sm90 {

struct GemmTile {
  int64_t m0;      // first row
  int n_tile;      // column tile
  int group;       // expert of the row block
  int64_t m_end;   // rows of this problem in use: tiles start below it; rows past it unwritten
  bool valid;
};

__device__ __forceinline__ GemmTile ScheduleTile(const GemmParams& p) {
  GemmTile t;
  const int64_t linear = blockIdx.x;
  t.m0 = linear / p.n_tiles * GemmConfig::kBlockM;
  t.n_tile = static_cast<int>(linear % p.n_tiles);
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
  return t;
}

}  // namespace mok::sm90
