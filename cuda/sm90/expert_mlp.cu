// The launches declared in expert_mlp.cuh, in this one translation unit (why: expert_mlp.cuh).
#include "expert_mlp.cuh"

#include "gemm_launch.cuh"

namespace mok::sm90 {

namespace {

// The chain of the routed MLP (slots 0 and 2) and at most one shared MLP (slots 1 and 3), its
// tiles taken from `counter` and its rows' readiness published in `ready`. Returns null, or a
// message for more MLPs or a second one with row groups.
template <class Mlp>
const char* QueuedChain(const Mlp* mlps, int count, int32_t* counter, int32_t* ready,
                        ChainParams& c) {
  if (count > 2 || (count == 2 && mlps[1].offsets))
    return "an expert-MLP launch takes the routed MLP and at most a shared one (no row groups)";
  c = EmptyChain();
  c.queue = counter;
  c.ready = ready;
  return nullptr;
}

}  // namespace

const char* LaunchExpertMlps(const ExpertMlp* mlps, int count, bool down,
                             int32_t* counter, int32_t* ready, cudaStream_t stream) {
  ChainParams c;
  if (const char* err = QueuedChain(mlps, count, counter, ready, c)) return err;
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

const char* LaunchExpertMlpsFp8(const ExpertMlpFp8* mlps, int count, int32_t* counter,
                                int32_t* ready, cudaStream_t stream) {
  ChainParams c;
  if (const char* err = QueuedChain(mlps, count, counter, ready, c)) return err;
  for (int j = 0; j < count; ++j) {
    const ExpertMlpFp8& m = mlps[j];
    GemmParams& up = c.gemm[j];  // slots 0, 1: gate|up
    up = RowGroups(m.offsets, m.block_m, m.groups, m.m, m.m_expected);
    up.n = static_cast<int>(m.I), up.k = static_cast<int>(m.H), up.k_split = up.k;
    up.n_split = up.n, up.out0 = m.gu, up.out1 = m.hq;
    up.b_scale0 = m.gate_scale, up.b_scale1 = m.up_scale;
    up.h_scale = m.hq_scale, up.h_scale_pitch = m.hq_pitch;
    if (auto err = PrepareGemmFp8<FwdGateUpFp8>(up, {m.xq, m.H, m.m}, m.xq_scale, m.xq_pitch,
                                                {m.w_gate, m.H, m.groups * m.I},
                                                {m.w_up, m.H, m.groups * m.I}))
      return err;
    GemmParams& p = c.gemm[2 + j];  // slots 2, 3: down
    p = RowGroups(m.offsets, m.block_m, m.groups, m.m, m.m_expected);
    p.n = static_cast<int>(m.H), p.k = static_cast<int>(m.I), p.k_split = p.k;
    p.n_split = p.n, p.out0 = m.y, p.out1 = m.y;
    p.b_scale0 = m.down_scale;
    if (auto err = PrepareGemmFp8<FwdDownFp8>(p, {m.hq, m.I, m.m}, m.hq_scale, m.hq_pitch,
                                              {m.w_down, m.I, m.groups * m.H}, {}))
      return err;
    c.ready_base[j] = m.ready_base;
    c.wait_base[2 + j] = m.ready_base, c.wait_count[2 + j] = up.n_tiles;
  }
  return LaunchQueued<FwdGateUpFp8, FwdDownFp8>(c, stream);
}

}  // namespace mok::sm90
