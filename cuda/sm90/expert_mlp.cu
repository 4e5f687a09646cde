// The launches declared in expert_mlp.cuh, in this one translation unit (why: expert_mlp.cuh).
#include "expert_mlp.cuh"

#include "gemm_launch.cuh"

namespace mok::sm90 {

const char* LaunchExpertMlps(const ExpertMlp* mlps, int count, bool down,
                             int32_t* counter, int32_t* ready, cudaStream_t stream) {
  if (count > 2 || (count == 2 && mlps[1].offsets))
    return "LaunchExpertMlps takes the routed MLP and at most a shared one (no row groups)";
  ChainParams c = EmptyChain();
  c.queue = counter;
  c.ready = ready;
  for (int j = 0; j < count; ++j) {
    const ExpertMlp& m = mlps[j];
    GemmParams& up = c.gemm[j];  // slots 0, 1: gate|up
    up = RowGroups(m.offsets, m.block_m, m.groups, m.m, m.m_expected);
    up.row_tokens = m.rows;
    up.n = static_cast<int>(m.I), up.k = static_cast<int>(m.H), up.k_split = up.k;
    up.n_split = up.n, up.out0 = m.gu, up.out1 = m.h;
    if (auto err = PrepareGemm<FwdGateUp>(up, {m.x_rows, m.H, m.m},
                                          {m.w_gate, m.I, m.groups * m.H},
                                          {m.w_up, m.I, m.groups * m.H}))
      return err;
    if (down) {
      GemmParams& p = c.gemm[2 + j];  // slots 2, 3: down
      p = RowGroups(m.offsets, m.block_m, m.groups, m.m, m.m_expected);
      p.row_tokens = m.rows;
      p.n = static_cast<int>(m.H), p.k = static_cast<int>(m.I), p.k_split = p.k;
      p.n_split = p.n, p.out0 = m.y, p.out1 = m.y;
      if (auto err = PrepareGemm<FwdDown>(p, {m.h, m.I, m.m}, {m.w_down, m.H, m.groups * m.I}, {}))
        return err;
      c.ready_base[j] = m.ready_base;
      c.wait_base[2 + j] = m.ready_base, c.wait_count[2 + j] = up.n_tiles;
    }
  }
  return LaunchQueued<FwdGateUp, FwdDown>(c, stream);
}

}  // namespace mok::sm90
