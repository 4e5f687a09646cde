// The launches declared in expert_mlp.cuh, in this one translation unit (NOTES there).
#include "expert_mlp.cuh"

#include <algorithm>

#include "../layout_contract.h"
#include "gemm_launch.cuh"

namespace mok::sm90 {

namespace {

GemmParams GateUpParams(const ExpertMlp& m) {
  GemmParams p{};
  p.offsets = m.offsets, p.block_m = m.block_m, p.groups = m.groups, p.m_total = m.m;
  p.n = static_cast<int>(m.I), p.k = static_cast<int>(m.H), p.k_split = p.k, p.n_split = p.n;
  p.out0 = m.gu, p.out1 = m.h;
  return p;
}

const char* PrepareGateUp(GemmParams& p, const ExpertMlp& m) {
  return PrepareGemm<FwdGateUp>(p, {m.x_rows, m.H, m.m}, {m.w_gate, m.I, m.groups * m.H},
                                {m.w_up, m.I, m.groups * m.H});
}

}  // namespace

const char* LaunchExpertMlps(const ExpertMlp* mlps, int count, bool gate_up, bool down,
                             int32_t* queue, cudaStream_t stream) {
  if (count > 2 || (count == 2 && mlps[1].offsets))
    return "LaunchExpertMlps takes the routed MLP and at most a shared one (no row groups)";
  ChainParams c = EmptyChain();
  c.queue = queue;
  c.ready = queue + kQueueHeaderInts;
  int64_t tiles = 0;
  for (int j = 0; j < count; ++j) {
    const ExpertMlp& m = mlps[j];
    GemmParams& up = c.gemm[j];  // slots 0, 1: gate|up
    if (gate_up) {
      up = GateUpParams(m);
      if (auto err = PrepareGateUp(up, m)) return err;
      tiles += up.tiles;
      if (down) c.ready_base[j] = m.ready_base;
    }
    if (down) {
      GemmParams& p = c.gemm[2 + j];  // slots 2, 3: down
      p.offsets = m.offsets, p.block_m = m.block_m, p.groups = m.groups, p.m_total = m.m;
      p.n = static_cast<int>(m.H), p.k = static_cast<int>(m.I), p.k_split = p.k;
      p.n_split = p.n, p.out0 = m.y, p.out1 = m.y;
      if (auto err = PrepareGemm<FwdDown>(p, {m.h, m.I, m.m}, {m.w_down, m.H, m.groups * m.I}, {}))
        return err;
      tiles += p.tiles;
      if (gate_up) c.wait_base[2 + j] = m.ready_base, c.wait_count[2 + j] = up.n_tiles;
    }
  }
  if (tiles == 0) return nullptr;
  int sms = 0;
  if (auto err = SmCount(&sms)) return err;
  return LaunchChain<FwdGateUp, FwdDown, kMaxChain>(c, std::min<int64_t>(tiles, sms), stream);
}

const char* LaunchGateUp(const ExpertMlp& mlp, cudaStream_t stream) {
  GemmParams p = GateUpParams(mlp);
  if (auto err = PrepareGateUp(p, mlp)) return err;
  // The forward's kernel (LaunchExpertMlps), slot 0 alone, tiles by grid stride.
  return LaunchGemmWith<FwdGateUp, FwdDown, kMaxChain>(p, stream);
}

}  // namespace mok::sm90
