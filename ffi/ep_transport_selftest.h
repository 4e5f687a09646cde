// The NVLink transport run on its own, without XLA (mok_jax._mok_cuda.ep_transport_selftest,
// tests/test_ep_transport_cuda.py): the P ranks of a workspace, each on a stream of its own
// GPU (P streams of one GPU for a workspace of segments), run R rounds of LaunchEpDispatch, a
// stand-in expert (each received row times its expert's scale) and LaunchEpCombine, the
// launchers that the custom calls mok_ep_dispatch and mok_ep_combine run, concurrently;
// optionally each rank's round captured once into a CUDA graph and replayed R times, optionally
// with the dispatches of `in_flight` rounds enqueued before their combines (back-to-back calls
// of one kind), and optionally with one rank that never runs (the others' waits time out and
// trap).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../cuda/ep_transport.h"

namespace mok::cuda {

struct EpSelftestArgs {
  int64_t handle = 0;       // the workspace (workspace_cuda.h)
  EpLayout layout{};        // mok_jax.Workspace.layout for these dimensions
  int64_t T = 0, H = 0, C = 0;
  int k = 0, E = 0;         // E global experts, E / P a rank
  int rounds = 0;
  bool graph = false;       // capture each rank's round once, replay it `rounds` times
  int in_flight = 1;        // rounds whose dispatches run before the first of their combines
  int silent_rank = -1;     // a rank that never runs, or -1
  uint64_t wait_bound_ns = kEpWaitBoundNs;
  const uint16_t* x = nullptr;        // (R, P, T, H) bf16 bits: each round's tokens
  const int32_t* experts = nullptr;   // (R, P, T, k) global ids
  const float* weights = nullptr;     // (R, P, T, k), or null: weight 1
  const float* scales = nullptr;      // (E): the stand-in expert e multiplies by scales[e]
};

// What each rank had after each round; (R, P, ...) row-major. Received rows past a block's
// count are not written by the dispatch and hold whatever the buffer held.
struct EpSelftestResult {
  std::vector<uint16_t> x_recv;       // (R, P, P C, H)
  std::vector<int32_t> expert_recv;   // (R, P, P C)
  std::vector<float> weight_recv;     // (R, P, P C)
  std::vector<int32_t> route_recv;    // (R, P, P C)
  std::vector<int32_t> counts;        // (R, P, P, 1 + E / P)
  std::vector<int32_t> route;         // (R, P, P C)
  std::vector<int32_t> slot;          // (R, P, T k)
  std::vector<int32_t> sent;          // (R, P, P)
  std::vector<int32_t> need;          // (R, P, P)
  std::vector<uint16_t> y;            // (R, P, T, H)
  std::vector<float> out_weights;     // (R, P, T k)
  std::vector<int32_t> epochs;        // (P, kEpCalls) after the last round
};

// "" on success, else what failed (a bad argument, or the CUDA error a trap left).
std::string EpTransportSelftest(const EpSelftestArgs& args, EpSelftestResult* result);

}  // namespace mok::cuda
