// The combine of the CPU targets: mok_moe_fwd's y, mok_moe_bwd's dx and mok_moe_combine (the
// home rank's sum under expert parallelism) all come from this one loop, so that they have the
// same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_math.h"

namespace mok::cpu {

// out[t] = round(sum_j weights[t, j] rows[pos[t, j]] in j order, then + extra[t]), in f32;
// routes with pos < 0 contribute nothing. weights null: each weight is 1 (w v = v exactly);
// extra null: nothing is added (not even +0, which would turn -0 into +0).
template <class S, class Y>
void CombineRows(int64_t T, int64_t k, int64_t H, const S* rows, const int32_t* pos,
                 const float* weights, const S* extra, Y* out) {
  std::vector<float> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) continue;
      const float w = weights ? weights[t * k + j] : 1.0f;
      const S* row = rows + int64_t{p} * H;
      for (int64_t h = 0; h < H; ++h) acc[h] += w * Load(row[h]);
    }
    if (extra)
      for (int64_t h = 0; h < H; ++h) acc[h] += Load(extra[t * H + h]);
    for (int64_t h = 0; h < H; ++h) out[t * H + h] = Store<Y>(acc[h]);
  }
}

}  // namespace mok::cpu
