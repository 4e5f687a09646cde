// EpTransportSelftest (ep_transport_selftest.h).
//
// Nothing on the host waits for a stream until every rank's work of every round is enqueued:
// a rank's kernels wait for its peers', so a host wait on one rank before the others were
// enqueued would wait for ever. Inputs therefore go to the GPU before the first launch, and
// results come back after the last.
#include "ep_transport_selftest.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "workspace_cuda.h"

namespace mok::cuda {
namespace {

// Hands out 256-byte aligned pieces of one allocation.
class Arena {
 public:
  template <class T>
  T* Take(int64_t count) {
    const int64_t at = used_;
    used_ += (count * static_cast<int64_t>(sizeof(T)) + 255) / 256 * 256;
    return reinterpret_cast<T*>(base_ + at);
  }
  void Reset(char* base) { base_ = base, used_ = 0; }
  int64_t used() const { return used_; }

 private:
  char* base_ = nullptr;
  int64_t used_ = 0;
};

// One rank's device buffers, stream and graph.
struct Rank {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaGraphExec_t graph = nullptr;
  void* memory = nullptr;
  EpTransportArgs args{};
  // all rounds' inputs, and this round's
  uint16_t* in_x = nullptr;
  int32_t* in_experts = nullptr;
  float* in_weights = nullptr;
  uint16_t* x = nullptr;
  int32_t* experts = nullptr;
  float* weights = nullptr;
  float* scales = nullptr;
  uint16_t* rows_out = nullptr;
  // a snapshot of the receive side, taken between dispatch and combine
  uint16_t* snap_rows = nullptr;
  int32_t* snap_route = nullptr;
  int32_t* snap_expert = nullptr;
  int32_t* snap_counts = nullptr;
  // all rounds' results
  uint16_t* out_recv_rows = nullptr;
  int32_t* out_recv_route = nullptr;
  int32_t* out_recv_expert = nullptr;
  int32_t* out_counts = nullptr;
  int32_t* out_route = nullptr;
  int32_t* out_slot = nullptr;
  int32_t* out_sent = nullptr;
  int32_t* out_need = nullptr;
  uint16_t* out_y = nullptr;
};

struct Sizes {
  int64_t P, T, H, k, C, E_local, R;
  int64_t rows() const { return P * C; }
  int64_t per() const { return 1 + E_local; }
};

// Lays out (or, with base null, only measures) a rank's buffers.
int64_t Carve(const Sizes& z, bool weighted, char* base, Rank* r) {
  Arena a;
  a.Reset(base);
  r->in_x = a.Take<uint16_t>(z.R * z.T * z.H);
  r->in_experts = a.Take<int32_t>(z.R * z.T * z.k);
  r->in_weights = weighted ? a.Take<float>(z.R * z.T * z.k) : nullptr;
  r->x = a.Take<uint16_t>(z.T * z.H);
  r->experts = a.Take<int32_t>(z.T * z.k);
  r->weights = weighted ? a.Take<float>(z.T * z.k) : nullptr;
  r->scales = a.Take<float>(z.E_local);
  r->rows_out = a.Take<uint16_t>(z.rows() * z.H);
  r->args.route = a.Take<int32_t>(z.rows());
  r->args.slot = a.Take<int32_t>(z.T * z.k);
  r->args.pos = a.Take<int32_t>(z.T * z.k);
  r->args.sent = a.Take<int32_t>(z.P);
  r->args.need = a.Take<int32_t>(z.P);
  r->args.counts_to = a.Take<int32_t>(z.P * z.E_local);
  r->args.y = a.Take<uint16_t>(z.T * z.H);
  r->snap_rows = a.Take<uint16_t>(z.rows() * z.H);
  r->snap_route = a.Take<int32_t>(z.rows());
  r->snap_expert = a.Take<int32_t>(z.rows());
  r->snap_counts = a.Take<int32_t>(z.P * z.per());
  r->out_recv_rows = a.Take<uint16_t>(z.R * z.rows() * z.H);
  r->out_recv_route = a.Take<int32_t>(z.R * z.rows());
  r->out_recv_expert = a.Take<int32_t>(z.R * z.rows());
  r->out_counts = a.Take<int32_t>(z.R * z.P * z.per());
  r->out_route = a.Take<int32_t>(z.R * z.rows());
  r->out_slot = a.Take<int32_t>(z.R * z.T * z.k);
  r->out_sent = a.Take<int32_t>(z.R * z.P);
  r->out_need = a.Take<int32_t>(z.R * z.P);
  r->out_y = a.Take<uint16_t>(z.R * z.T * z.H);
  return a.used();
}

// The first failure, kept; later calls only add to it when nothing failed before.
class Status {
 public:
  bool Cuda(cudaError_t err, const std::string& what) {
    if (err == cudaSuccess) return true;
    if (message_.empty())
      message_ = what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
    return false;
  }
  bool Launch(const char* err, const std::string& what) {
    if (err == nullptr) return true;
    if (message_.empty()) message_ = what + ": " + err;
    return false;
  }
  bool Fail(const std::string& what) {
    if (message_.empty()) message_ = what;
    return false;
  }
  bool ok() const { return message_.empty(); }
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

template <class T>
cudaError_t CopyAsync(T* dst, const T* src, int64_t count, cudaStream_t stream) {
  return cudaMemcpyAsync(dst, src, static_cast<size_t>(count) * sizeof(T),
                         cudaMemcpyDeviceToDevice, stream);
}

// One rank's round on its stream (also what a graph captures): plan, dispatch, the snapshot of
// what arrived, the stand-in experts, combine.
bool EnqueueRound(const Sizes& z, Rank& r, Status& st) {
  const EpTransportArgs& a = r.args;
  const char* ws = static_cast<const char*>(a.own);
  const std::string who = "rank " + std::to_string(a.rank);
  return st.Launch(LaunchEpPlan(a, r.stream), who + ": LaunchEpPlan") &&
         st.Launch(LaunchEpDispatch(a, r.stream), who + ": LaunchEpDispatch") &&
         st.Cuda(CopyAsync(r.snap_rows, reinterpret_cast<const uint16_t*>(ws + a.layout.recv_rows),
                           z.rows() * z.H, r.stream), who + ": snapshot") &&
         st.Cuda(CopyAsync(r.snap_route, reinterpret_cast<const int32_t*>(ws + a.layout.recv_route),
                           z.rows(), r.stream), who + ": snapshot") &&
         st.Cuda(CopyAsync(r.snap_expert,
                           reinterpret_cast<const int32_t*>(ws + a.layout.recv_expert), z.rows(),
                           r.stream), who + ": snapshot") &&
         st.Cuda(CopyAsync(r.snap_counts, reinterpret_cast<const int32_t*>(ws + a.layout.counts),
                           z.P * z.per(), r.stream), who + ": snapshot") &&
         st.Launch(LaunchEpScaleRows(a, r.scales, r.rows_out, r.stream),
                   who + ": LaunchEpScaleRows") &&
         st.Launch(LaunchEpCombine(a, r.stream), who + ": LaunchEpCombine");
}

// Round `round`'s inputs into place, and (after the round) its results out, on the rank's stream.
bool EnqueueInputs(const Sizes& z, int64_t round, Rank& r, Status& st) {
  return st.Cuda(CopyAsync(r.x, r.in_x + round * z.T * z.H, z.T * z.H, r.stream), "inputs") &&
         st.Cuda(CopyAsync(r.experts, r.in_experts + round * z.T * z.k, z.T * z.k, r.stream),
                 "inputs") &&
         (r.weights == nullptr ||
          st.Cuda(CopyAsync(r.weights, r.in_weights + round * z.T * z.k, z.T * z.k, r.stream),
                  "inputs"));
}

bool EnqueueResults(const Sizes& z, int64_t round, Rank& r, Status& st) {
  const EpTransportArgs& a = r.args;
  const int64_t rows = z.rows(), tk = z.T * z.k;
  return st.Cuda(CopyAsync(r.out_recv_rows + round * rows * z.H, r.snap_rows, rows * z.H,
                           r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_recv_route + round * rows, r.snap_route, rows, r.stream),
                 "results") &&
         st.Cuda(CopyAsync(r.out_recv_expert + round * rows, r.snap_expert, rows, r.stream),
                 "results") &&
         st.Cuda(CopyAsync(r.out_counts + round * z.P * z.per(), r.snap_counts, z.P * z.per(),
                           r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_route + round * rows, a.route, rows, r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_slot + round * tk, a.slot, tk, r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_sent + round * z.P, a.sent, z.P, r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_need + round * z.P, a.need, z.P, r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_y + round * z.T * z.H, static_cast<uint16_t*>(a.y), z.T * z.H,
                           r.stream), "results");
}

// out[(round, rank, ...)] = the rank's (round, ...) buffer.
template <class T>
bool Gather(const std::vector<Rank>& ranks, T* Rank::*buffer, int64_t per_round, int64_t R,
            std::vector<T>* out, Status& st) {
  const int64_t P = static_cast<int64_t>(ranks.size());
  out->assign(static_cast<size_t>(R * P * per_round), T{});
  std::vector<T> host(static_cast<size_t>(R * per_round));
  for (int64_t s = 0; s < P; ++s) {
    cudaSetDevice(ranks[s].device);
    if (!st.Cuda(cudaMemcpy(host.data(), ranks[s].*buffer, host.size() * sizeof(T),
                            cudaMemcpyDeviceToHost), "results to the host"))
      return false;
    for (int64_t r = 0; r < R; ++r)
      std::copy(host.begin() + r * per_round, host.begin() + (r + 1) * per_round,
                out->begin() + (r * P + s) * per_round);
  }
  return true;
}

// Hardware queues of a GPU: streams beyond them share one, in order.
int MaxStreamsOnOneGpu() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int n = v ? std::atoi(v) : 0;
  return n > 0 ? n : 8;  // the driver's default
}

}  // namespace

std::string EpTransportSelftest(const EpSelftestArgs& in, EpSelftestResult* result) {
  WorkspaceInfo ws;
  if (!WorkspaceLookup(in.handle, &ws)) return "no workspace has handle " + std::to_string(in.handle);
  const int P = static_cast<int>(ws.ranks.size());
  if (in.rounds < 1) return "rounds must be at least 1";
  if (in.E < 1 || in.E % P != 0) return "E must be a positive multiple of the workspace's ranks";
  if (in.silent_rank < -1 || in.silent_rank >= P) return "silent_rank must be -1 or a rank";
  if (in.layout.bytes > ws.bytes)
    return "the layout needs " + std::to_string(in.layout.bytes) + " bytes a rank, the workspace "
           "has " + std::to_string(ws.bytes);
  if (!in.x || !in.experts || !in.scales) return "x, experts and scales are required";
  const Sizes z{P, in.T, in.H, in.k, in.C, in.E / P, in.rounds};

  std::map<int, int> on_device;
  for (const WorkspaceRank& r : ws.ranks) ++on_device[r.device];
  for (const auto& [device, n] : on_device) {
    if (n > MaxStreamsOnOneGpu())
      return std::to_string(n) + " ranks on GPU " + std::to_string(device) + " need as many "
             "hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, default 8): a rank sharing one with "
             "another could wait behind it for ever";
  }

  int previous_device = 0;
  cudaGetDevice(&previous_device);
  Status st;
  std::vector<Rank> ranks(P);
  const bool weighted = in.weights != nullptr;
  for (int s = 0; s < P && st.ok(); ++s) {
    Rank& r = ranks[s];
    r.device = ws.ranks[s].device;
    EpTransportArgs& a = r.args;
    a.T = in.T, a.H = in.H, a.C = in.C, a.k = in.k, a.E_local = in.E / P;
    a.ranks = P, a.rank = s, a.layout = in.layout;
    a.peers = ws.ranks[s].peers, a.own = ws.ranks[s].base;
    a.wait_bound_ns = in.wait_bound_ns;
    if (!st.Cuda(cudaSetDevice(r.device), "cudaSetDevice")) break;
    if (!st.Launch(EpTransportCtas(r.device, on_device[r.device], &a.ctas), "EpTransportCtas"))
      break;
    if (!st.Launch(EpCheckArgs(a), "the dimensions and layout")) break;
    const int64_t bytes = Carve(z, weighted, nullptr, &r);
    if (!st.Cuda(cudaMalloc(&r.memory, static_cast<size_t>(bytes)), "cudaMalloc of the buffers"))
      break;
    Carve(z, weighted, static_cast<char*>(r.memory), &r);
    a.x = r.x, a.experts = r.experts, a.weights = r.weights, a.rows_out = r.rows_out;
    a.extra = nullptr;
    if (!st.Cuda(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "a stream")) break;
    // Rank s's slice of every round's inputs: (R, P, ...) on the host.
    const int64_t tH = z.T * z.H, tk = z.T * z.k;
    for (int64_t round = 0; round < z.R && st.ok(); ++round) {
      const int64_t at = round * P + s;
      st.Cuda(cudaMemcpy(r.in_x + round * tH, in.x + at * tH, tH * 2, cudaMemcpyHostToDevice),
              "inputs to the GPU");
      st.Cuda(cudaMemcpy(r.in_experts + round * tk, in.experts + at * tk, tk * 4,
                         cudaMemcpyHostToDevice), "inputs to the GPU");
      if (weighted)
        st.Cuda(cudaMemcpy(r.in_weights + round * tk, in.weights + at * tk, tk * 4,
                           cudaMemcpyHostToDevice), "inputs to the GPU");
    }
    st.Cuda(cudaMemcpy(r.scales, in.scales + int64_t{s} * z.E_local, z.E_local * 4,
                       cudaMemcpyHostToDevice), "scales to the GPU");
  }

  // The copies above ran on the legacy stream, which the ranks' non-blocking streams do not
  // wait for (and a pageable copy may return before its DMA ends): finish them here.
  for (const auto& [device, n] : on_device) {
    if (!st.ok()) break;
    cudaSetDevice(device);
    st.Cuda(cudaDeviceSynchronize(), "the inputs' copies");
  }

  auto live = [&](int s) { return s != in.silent_rank; };
  if (st.ok() && in.graph) {
    for (int s = 0; s < P && st.ok(); ++s) {
      if (!live(s)) continue;
      Rank& r = ranks[s];
      cudaSetDevice(r.device);
      cudaGraph_t g = nullptr;
      if (!st.Cuda(cudaStreamBeginCapture(r.stream, cudaStreamCaptureModeThreadLocal),
                   "cudaStreamBeginCapture"))
        break;
      const bool enqueued = EnqueueRound(z, r, st);
      const cudaError_t ended = cudaStreamEndCapture(r.stream, &g);
      if (enqueued && st.Cuda(ended, "cudaStreamEndCapture"))
        st.Cuda(cudaGraphInstantiate(&r.graph, g, 0), "cudaGraphInstantiate");
      if (g) cudaGraphDestroy(g);
    }
  }
  for (int64_t round = 0; round < z.R && st.ok(); ++round) {
    for (int s = 0; s < P && st.ok(); ++s) {
      if (!live(s)) continue;
      Rank& r = ranks[s];
      cudaSetDevice(r.device);
      if (!EnqueueInputs(z, round, r, st)) break;
      if (in.graph) st.Cuda(cudaGraphLaunch(r.graph, r.stream), "cudaGraphLaunch");
      else EnqueueRound(z, r, st);
      if (st.ok()) EnqueueResults(z, round, r, st);
    }
  }
  // Every rank's stream, even after a failure: a trap shows here.
  for (int s = 0; s < P; ++s) {
    if (ranks[s].stream == nullptr) continue;
    cudaSetDevice(ranks[s].device);
    st.Cuda(cudaStreamSynchronize(ranks[s].stream), "rank " + std::to_string(s));
  }

  if (st.ok()) {
    const int64_t rows = z.rows(), R = z.R;
    const bool done =
        Gather(ranks, &Rank::out_recv_rows, rows * z.H, R, &result->recv_rows, st) &&
        Gather(ranks, &Rank::out_recv_route, rows, R, &result->recv_route, st) &&
        Gather(ranks, &Rank::out_recv_expert, rows, R, &result->recv_expert, st) &&
        Gather(ranks, &Rank::out_counts, z.P * z.per(), R, &result->counts, st) &&
        Gather(ranks, &Rank::out_route, rows, R, &result->route, st) &&
        Gather(ranks, &Rank::out_slot, z.T * z.k, R, &result->slot, st) &&
        Gather(ranks, &Rank::out_sent, z.P, R, &result->sent, st) &&
        Gather(ranks, &Rank::out_need, z.P, R, &result->need, st) &&
        Gather(ranks, &Rank::out_y, z.T * z.H, R, &result->y, st);
    result->epochs.assign(static_cast<size_t>(P) * kEpStages, 0);
    for (int s = 0; done && s < P; ++s) {
      EpSync sync{};
      cudaSetDevice(ranks[s].device);
      st.Cuda(cudaMemcpy(&sync, static_cast<const char*>(ranks[s].args.own) + in.layout.sync,
                         sizeof(sync), cudaMemcpyDeviceToHost), "the epochs");
      for (int stage = 0; stage < kEpStages; ++stage)
        result->epochs[s * kEpStages + stage] = sync.epoch[stage];
    }
  }

  for (Rank& r : ranks) {
    cudaSetDevice(r.device);
    if (r.graph) cudaGraphExecDestroy(r.graph);
    if (r.stream) cudaStreamDestroy(r.stream);
    if (r.memory) cudaFree(r.memory);
  }
  if (st.ok()) cudaGetLastError();
  cudaSetDevice(previous_device);
  return st.message();
}

}  // namespace mok::cuda
