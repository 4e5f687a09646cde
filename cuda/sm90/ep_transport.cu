// The launchers of ep_transport.h: the NVLink transport's kernels (ep_transport.cuh) and, for
// the home sum, the forward's combine (combine.cu), so that y has the collective transport's
// code and bits.
#include <algorithm>
#include <cstdint>
#include <iterator>

#include "../ep_transport.h"
#include "../launch.h"
#include "ep_transport.cuh"

namespace mok::cuda {
namespace {

const char* LastError() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// CTAs of a kernel that moves up to `rows` rows a warp a row: no more than args.ctas.
unsigned RowCtas(const EpTransportArgs& a, int64_t rows) {
  const int64_t want = std::max<int64_t>(1, (rows + sm90::kEpWarps - 1) / sm90::kEpWarps);
  return static_cast<unsigned>(std::min<int64_t>(want, a.ctas));
}

struct Region {
  const char* name;
  int64_t offset, bytes;
};

}  // namespace

const char* EpCheckArgs(const EpTransportArgs& a) {
  if (a.ranks < 1 || a.ranks > kEpMaxRanks) return "ranks must be in [1, kEpMaxRanks = 256]";
  if (a.rank < 0 || a.rank >= a.ranks) return "rank must be in [0, ranks)";
  if (a.T < 1 || a.k < 1) return "T and k must be at least 1";
  if (a.H < 8 || a.H % 8 != 0) return "H must be a positive multiple of 8 (16-byte bf16 chunks)";
  if (a.E_local < 1 || a.E_local > kEpMaxLocalExperts)
    return "E_local must be in [1, kEpMaxLocalExperts = 1024]";
  if (a.C < 1 || a.C > a.T * a.k) return "C must be in [1, T k]";
  // Routes t k + j and send slots d C + i are int32 in the layout's arrays.
  if (a.T * a.k > INT32_MAX || int64_t{a.ranks} * a.C > INT32_MAX)
    return "T k and P C must fit int32";
  if (a.peers == nullptr || a.own == nullptr) return "the workspace's peers table is missing";
  if (a.ctas < 1) return "ctas must be at least 1 (EpTransportCtas)";
  if (a.wait_bound_ns == 0) return "wait_bound_ns must be positive";
  const EpLayout& l = a.layout;
  const int64_t P = a.ranks, rows = P * a.C, routes = a.T * a.k;
  Region regions[] = {
      {"recv_rows", l.recv_rows, rows * a.H * 2},
      {"combine_slots", l.combine_slots, routes * a.H * 2},
      {"recv_route", l.recv_route, rows * 4},
      {"recv_expert", l.recv_expert, rows * 4},
      {"recv_weight", l.recv_weight, rows * 4},
      {"combine_weight", l.combine_weight, routes * 4},
      {"counts", l.counts, P * (1 + a.E_local) * 4},
      {"flags", l.flags, int64_t{kEpStages} * P * 4},
      {"sync", l.sync, kEpSyncBytes},
  };
  for (const Region& r : regions) {
    if (r.offset < 0 || r.offset % 16 != 0 || r.offset + r.bytes > l.bytes)
      return "a region of the layout is misaligned (16 bytes) or past the segment's bytes: "
             "the layout is not Workspace.layout's for these dimensions";
  }
  std::sort(std::begin(regions), std::end(regions),
            [](const Region& x, const Region& y) { return x.offset < y.offset; });
  for (size_t i = 1; i < std::size(regions); ++i) {
    if (regions[i - 1].offset + regions[i - 1].bytes > regions[i].offset)
      return "two regions of the layout overlap";
  }
  return nullptr;
}

const char* EpTransportCtas(int device, int ranks_on_device, int* ctas) {
  if (ranks_on_device < 1) return "ranks_on_device must be at least 1";
  int previous = 0, sms = 0, fit = INT32_MAX;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device) != cudaSuccess)
    return LastError();
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const void* kernels[] = {reinterpret_cast<const void*>(sm90::EpDispatchKernel),
                           reinterpret_cast<const void*>(sm90::EpReceiveKernel),
                           reinterpret_cast<const void*>(sm90::EpCombineSendKernel),
                           reinterpret_cast<const void*>(sm90::EpCombineEndKernel),
                           reinterpret_cast<const void*>(sm90::EpScaleRowsKernel)};
  for (const void* kernel : kernels) {
    int n = 0;
    if (err == cudaSuccess)
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kEpThreads, 0);
    fit = std::min(fit, n);
  }
  cudaSetDevice(previous);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  // The ranks sharing the GPU split its resident CTAs evenly.
  *ctas = std::max(1, sms * fit / ranks_on_device);
  return nullptr;
}

const char* LaunchEpDispatch(const EpTransportArgs& a, cudaStream_t stream) {
  if (const char* bad = EpCheckArgs(a)) return bad;
  if (!a.x || !a.experts || !a.route || !a.slot || !a.pos || !a.sent || !a.need ||
      !a.counts_to || !a.x_recv || !a.expert_recv || !a.weight_recv || !a.route_recv ||
      !a.counts_recv)
    return "a buffer of the dispatch is missing";
  const unsigned rows = RowCtas(a, a.ranks * a.C);
  sm90::EpPlanKernel<<<a.ranks, kEpThreads, 0, stream>>>(a);
  sm90::EpAwaitKernel<<<1, kEpThreads, 0, stream>>>(a, kEpDispatchRead);
  sm90::EpDispatchKernel<<<rows, kEpThreads, 0, stream>>>(a);
  sm90::EpReceiveKernel<<<rows, kEpThreads, 0, stream>>>(a);
  return LastError();
}

const char* LaunchEpCombine(const EpTransportArgs& a, cudaStream_t stream) {
  if (const char* bad = EpCheckArgs(a)) return bad;
  if (!a.rows || !a.route_recv || !a.counts_recv || !a.pos || !a.out)
    return "a buffer of the combine is missing";
  if ((a.row_weights == nullptr) != (a.out_weights == nullptr))
    return "row_weights and out_weights go together";
  sm90::EpAwaitKernel<<<1, kEpThreads, 0, stream>>>(a, kEpCombineRead);
  sm90::EpCombineSendKernel<<<RowCtas(a, a.ranks * a.C), kEpThreads, 0, stream>>>(a);
  if (const char* err = LastError()) return err;
  CombineArgs c{};
  c.T = a.T, c.k = a.k, c.H = static_cast<int>(a.H);
  c.rows = static_cast<const char*>(a.own) + a.layout.combine_slots;
  c.pos = a.pos, c.weights = a.weights, c.extra = a.extra;
  c.out = a.out, c.out_f32 = a.out_f32;
  if (const char* err = LaunchCombine(c, stream)) return err;
  // A thread a route: a warp's worth of routes per RowCtas row.
  sm90::EpCombineEndKernel<<<RowCtas(a, (a.T * a.k + 31) / 32), kEpThreads, 0, stream>>>(a);
  return LastError();
}

const char* LaunchEpScaleRows(const EpTransportArgs& a, const float* scales, void* rows_out,
                              float* row_weights, cudaStream_t stream) {
  if (const char* bad = EpCheckArgs(a)) return bad;
  sm90::EpScaleRowsKernel<<<RowCtas(a, a.ranks * a.C), kEpThreads, 0, stream>>>(
      a, scales, static_cast<__nv_bfloat16*>(rows_out), row_weights);
  return LastError();
}

}  // namespace mok::cuda
