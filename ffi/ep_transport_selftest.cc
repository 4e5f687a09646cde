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

// Hands out 256-byte aligned pieces of one allocation (or, with a null base, only counts them).
class Arena {
 public:
  template <class T>
  T* Take(int64_t count) {
    const int64_t at = used_;
    used_ += (count * static_cast<int64_t>(sizeof(T)) + 255) / 256 * 256;
    return base_ ? reinterpret_cast<T*>(base_ + at) : nullptr;
  }
  explicit Arena(char* base) : base_(base) {}
  int64_t used() const { return used_; }

 private:
  char* base_ = nullptr;
  int64_t used_ = 0;
};

struct Sizes {
  int64_t P, T, H, k, C, E_local, R;
  int64_t rows() const { return P * C; }
  int64_t per() const { return 1 + E_local; }
  int64_t routes() const { return T * k; }
};

// The buffers of one round in flight: its inputs, what the two calls take and give, and the
// stand-in expert's outputs.
struct WorkSet {
  uint16_t* x;
  int32_t* experts;
  float* weights;  // null: unweighted
  int32_t *route, *slot, *pos, *sent, *need, *counts_to;
  uint16_t* x_recv;
  int32_t* expert_recv;
  float* weight_recv;
  int32_t* route_recv;
  int32_t* counts_recv;
  uint16_t* rows_out;
  float* row_weights;
  uint16_t* y;
  float* out_weights;
};

// One rank's device buffers, stream and graph.
struct Rank {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaGraphExec_t graph = nullptr;
  void* memory = nullptr;
  EpTransportArgs base{};  // dimensions, layout, peers, CTAs; the buffers come from a WorkSet
  float* scales = nullptr;
  // all rounds' inputs
  uint16_t* in_x = nullptr;
  int32_t* in_experts = nullptr;
  float* in_weights = nullptr;
  std::vector<WorkSet> sets;
  // all rounds' results
  uint16_t* out_x_recv = nullptr;
  int32_t* out_expert_recv = nullptr;
  float* out_weight_recv = nullptr;
  int32_t* out_route_recv = nullptr;
  int32_t* out_counts = nullptr;
  int32_t* out_route = nullptr;
  int32_t* out_slot = nullptr;
  int32_t* out_sent = nullptr;
  int32_t* out_need = nullptr;
  uint16_t* out_y = nullptr;
  float* out_weights = nullptr;
};

// Lays out (or, with base null, only measures) a rank's buffers, `in_flight` work sets.
int64_t Carve(const Sizes& z, bool weighted, int in_flight, char* base, Rank* r) {
  Arena a(base);
  r->scales = a.Take<float>(z.E_local);
  r->in_x = a.Take<uint16_t>(z.R * z.T * z.H);
  r->in_experts = a.Take<int32_t>(z.R * z.routes());
  r->in_weights = weighted ? a.Take<float>(z.R * z.routes()) : nullptr;
  r->sets.assign(in_flight, WorkSet{});
  for (WorkSet& w : r->sets) {
    w.x = a.Take<uint16_t>(z.T * z.H);
    w.experts = a.Take<int32_t>(z.routes());
    w.weights = weighted ? a.Take<float>(z.routes()) : nullptr;
    w.route = a.Take<int32_t>(z.rows());
    w.slot = a.Take<int32_t>(z.routes());
    w.pos = a.Take<int32_t>(z.routes());
    w.sent = a.Take<int32_t>(z.P);
    w.need = a.Take<int32_t>(z.P);
    w.counts_to = a.Take<int32_t>(z.P * z.E_local);
    w.x_recv = a.Take<uint16_t>(z.rows() * z.H);
    w.expert_recv = a.Take<int32_t>(z.rows());
    w.weight_recv = a.Take<float>(z.rows());
    w.route_recv = a.Take<int32_t>(z.rows());
    w.counts_recv = a.Take<int32_t>(z.P * z.per());
    w.rows_out = a.Take<uint16_t>(z.rows() * z.H);
    w.row_weights = a.Take<float>(z.rows());
    w.y = a.Take<uint16_t>(z.T * z.H);
    w.out_weights = a.Take<float>(z.routes());
  }
  r->out_x_recv = a.Take<uint16_t>(z.R * z.rows() * z.H);
  r->out_expert_recv = a.Take<int32_t>(z.R * z.rows());
  r->out_weight_recv = a.Take<float>(z.R * z.rows());
  r->out_route_recv = a.Take<int32_t>(z.R * z.rows());
  r->out_counts = a.Take<int32_t>(z.R * z.P * z.per());
  r->out_route = a.Take<int32_t>(z.R * z.rows());
  r->out_slot = a.Take<int32_t>(z.R * z.routes());
  r->out_sent = a.Take<int32_t>(z.R * z.P);
  r->out_need = a.Take<int32_t>(z.R * z.P);
  r->out_y = a.Take<uint16_t>(z.R * z.T * z.H);
  r->out_weights = a.Take<float>(z.R * z.routes());
  return a.used();
}

// The arguments of both calls on work set w.
EpTransportArgs ArgsOf(const Rank& r, const WorkSet& w) {
  EpTransportArgs a = r.base;
  a.x = w.x, a.experts = w.experts, a.weights = w.weights;
  a.route = w.route, a.slot = w.slot, a.pos = w.pos, a.sent = w.sent, a.need = w.need;
  a.counts_to = w.counts_to;
  a.x_recv = w.x_recv, a.expert_recv = w.expert_recv, a.weight_recv = w.weight_recv;
  a.route_recv = w.route_recv, a.counts_recv = w.counts_recv;
  a.rows = w.rows_out, a.row_weights = w.row_weights, a.extra = nullptr;
  a.out = w.y, a.out_f32 = false, a.out_weights = w.out_weights;
  return a;
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

std::string Who(const Rank& r) { return "rank " + std::to_string(r.base.rank); }

bool EnqueueDispatch(const Rank& r, const WorkSet& w, Status& st) {
  return st.Launch(LaunchEpDispatch(ArgsOf(r, w), r.stream), Who(r) + ": LaunchEpDispatch");
}

// The stand-in experts on what the dispatch of w received, then the combine.
bool EnqueueCombine(const Rank& r, const WorkSet& w, Status& st) {
  const EpTransportArgs a = ArgsOf(r, w);
  return st.Launch(LaunchEpScaleRows(a, r.scales, w.rows_out, w.row_weights, r.stream),
                   Who(r) + ": LaunchEpScaleRows") &&
         st.Launch(LaunchEpCombine(a, r.stream), Who(r) + ": LaunchEpCombine");
}

// Round `round`'s inputs into w, and (after the round) its results out of w, on the rank's
// stream.
bool EnqueueInputs(const Sizes& z, int64_t round, const Rank& r, const WorkSet& w, Status& st) {
  return st.Cuda(CopyAsync(w.x, r.in_x + round * z.T * z.H, z.T * z.H, r.stream), "inputs") &&
         st.Cuda(CopyAsync(w.experts, r.in_experts + round * z.routes(), z.routes(), r.stream),
                 "inputs") &&
         (w.weights == nullptr ||
          st.Cuda(CopyAsync(w.weights, r.in_weights + round * z.routes(), z.routes(), r.stream),
                  "inputs"));
}

bool EnqueueResults(const Sizes& z, int64_t round, const Rank& r, const WorkSet& w, Status& st) {
  const int64_t rows = z.rows(), tk = z.routes();
  return st.Cuda(CopyAsync(r.out_x_recv + round * rows * z.H, w.x_recv, rows * z.H, r.stream),
                 "results") &&
         st.Cuda(CopyAsync(r.out_expert_recv + round * rows, w.expert_recv, rows, r.stream),
                 "results") &&
         st.Cuda(CopyAsync(r.out_weight_recv + round * rows, w.weight_recv, rows, r.stream),
                 "results") &&
         st.Cuda(CopyAsync(r.out_route_recv + round * rows, w.route_recv, rows, r.stream),
                 "results") &&
         st.Cuda(CopyAsync(r.out_counts + round * z.P * z.per(), w.counts_recv, z.P * z.per(),
                           r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_route + round * rows, w.route, rows, r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_slot + round * tk, w.slot, tk, r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_sent + round * z.P, w.sent, z.P, r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_need + round * z.P, w.need, z.P, r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_y + round * z.T * z.H, w.y, z.T * z.H, r.stream), "results") &&
         st.Cuda(CopyAsync(r.out_weights + round * tk, w.out_weights, tk, r.stream), "results");
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
  if (in.in_flight < 1) return "in_flight must be at least 1";
  if (in.graph && in.in_flight != 1) return "a graph holds one round: in_flight must be 1";
  if (in.E < 1 || in.E % P != 0) return "E must be a positive multiple of the workspace's ranks";
  if (in.silent_rank < -1 || in.silent_rank >= P) return "silent_rank must be -1 or a rank";
  if (in.layout.bytes > ws.bytes)
    return "the layout needs " + std::to_string(in.layout.bytes) + " bytes a rank, the workspace "
           "has " + std::to_string(ws.bytes);
  if (!in.x || !in.experts || !in.scales) return "x, experts and scales are required";
  for (const WorkspaceRank& r : ws.ranks) {
    if (r.device < 0) return "the self-test runs the ranks of one process: the workspace has "
                             "ranks of other processes";
  }
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
    EpTransportArgs& a = r.base;
    a.T = in.T, a.H = in.H, a.C = in.C, a.k = in.k, a.E_local = in.E / P;
    a.ranks = P, a.rank = s, a.layout = in.layout;
    a.peers = ws.ranks[s].peers, a.own = ws.ranks[s].base;
    a.wait_bound_ns = in.wait_bound_ns;
    if (!st.Cuda(cudaSetDevice(r.device), "cudaSetDevice")) break;
    if (!st.Launch(EpTransportCtas(r.device, on_device[r.device], &a.ctas), "EpTransportCtas"))
      break;
    if (!st.Launch(EpCheckArgs(a), "the dimensions and layout")) break;
    const int64_t bytes = Carve(z, weighted, in.in_flight, nullptr, &r);
    if (!st.Cuda(cudaMalloc(&r.memory, static_cast<size_t>(bytes)), "cudaMalloc of the buffers"))
      break;
    Carve(z, weighted, in.in_flight, static_cast<char*>(r.memory), &r);
    if (!st.Cuda(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "a stream")) break;
    // Rank s's slice of every round's inputs: (R, P, ...) on the host.
    const int64_t tH = z.T * z.H, tk = z.routes();
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
      const bool enqueued = EnqueueDispatch(r, r.sets[0], st) && EnqueueCombine(r, r.sets[0], st);
      const cudaError_t ended = cudaStreamEndCapture(r.stream, &g);
      if (enqueued && st.Cuda(ended, "cudaStreamEndCapture"))
        st.Cuda(cudaGraphInstantiate(&r.graph, g, 0), "cudaGraphInstantiate");
      if (g) cudaGraphDestroy(g);
    }
  }
  // Rounds in groups of in_flight: each rank enqueues the group's dispatches (each into a work
  // set of its own), then their combines, then their results.
  for (int64_t group = 0; group < z.R && st.ok(); group += in.in_flight) {
    const int n = static_cast<int>(std::min<int64_t>(in.in_flight, z.R - group));
    for (int s = 0; s < P && st.ok(); ++s) {
      if (!live(s)) continue;
      Rank& r = ranks[s];
      cudaSetDevice(r.device);
      for (int i = 0; i < n && st.ok(); ++i) {
        if (!EnqueueInputs(z, group + i, r, r.sets[i], st)) break;
        if (in.graph) st.Cuda(cudaGraphLaunch(r.graph, r.stream), "cudaGraphLaunch");
        else EnqueueDispatch(r, r.sets[i], st);
      }
      for (int i = 0; i < n && st.ok() && !in.graph; ++i) EnqueueCombine(r, r.sets[i], st);
      for (int i = 0; i < n && st.ok(); ++i) EnqueueResults(z, group + i, r, r.sets[i], st);
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
        Gather(ranks, &Rank::out_x_recv, rows * z.H, R, &result->x_recv, st) &&
        Gather(ranks, &Rank::out_expert_recv, rows, R, &result->expert_recv, st) &&
        Gather(ranks, &Rank::out_weight_recv, rows, R, &result->weight_recv, st) &&
        Gather(ranks, &Rank::out_route_recv, rows, R, &result->route_recv, st) &&
        Gather(ranks, &Rank::out_counts, z.P * z.per(), R, &result->counts, st) &&
        Gather(ranks, &Rank::out_route, rows, R, &result->route, st) &&
        Gather(ranks, &Rank::out_slot, z.routes(), R, &result->slot, st) &&
        Gather(ranks, &Rank::out_sent, z.P, R, &result->sent, st) &&
        Gather(ranks, &Rank::out_need, z.P, R, &result->need, st) &&
        Gather(ranks, &Rank::out_y, z.T * z.H, R, &result->y, st) &&
        Gather(ranks, &Rank::out_weights, z.routes(), R, &result->out_weights, st);
    result->epochs.assign(static_cast<size_t>(P) * kEpCalls, 0);
    for (int s = 0; done && s < P; ++s) {
      EpSync sync{};
      cudaSetDevice(ranks[s].device);
      st.Cuda(cudaMemcpy(&sync, static_cast<const char*>(ranks[s].base.own) + in.layout.sync,
                         sizeof(sync), cudaMemcpyDeviceToHost), "the epochs");
      for (int call = 0; call < kEpCalls; ++call)
        result->epochs[s * kEpCalls + call] = sync.epoch[call];
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
