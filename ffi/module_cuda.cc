// Python module mok_jax._mok_cuda: the CUDA targets as capsules for jax.ffi.register_ffi_target,
// the symmetric workspaces of expert parallelism (mok_jax.Workspace) and the NVLink
// transport's self-test.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../cuda/ep_transport.h"
#include "capsule.h"
#include "ep_transport_selftest.h"
#include "moe_cuda.h"
#include "workspace_cuda.h"

namespace nb = nanobind;

namespace {

template <class T>
using HostArray = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;

// A NumPy array that owns `values`, of shape `shape`.
template <class T>
nb::object ToNumpy(std::vector<T>&& values, std::vector<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(values));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.data(), owner));
}

const char* StatusName(mok::cuda::WorkspaceStatus status) {
  using S = mok::cuda::WorkspaceStatus;
  switch (status) {
    case S::kOk: return "ok";
    case S::kBadArgument: return "bad_argument";
    case S::kOutOfMemory: return "out_of_memory";
    case S::kNoPeerAccess: return "no_peer_access";
    case S::kNotSupported: return "not_supported";
    case S::kCudaError: return "cuda_error";
  }
  return "cuda_error";
}

mok::cuda::EpLayout LayoutOf(const nb::dict& d) {
  mok::cuda::EpLayout l{};
  auto get = [&](const char* name) { return nb::cast<int64_t>(d[name]); };
  l.recv_rows = get("recv_rows"), l.combine_slots = get("combine_slots");
  l.recv_route = get("recv_route"), l.recv_expert = get("recv_expert");
  l.recv_weight = get("recv_weight"), l.combine_weight = get("combine_weight");
  l.counts = get("counts"), l.flags = get("flags"), l.sync = get("sync");
  l.bytes = get("bytes");
  return l;
}

template <class T>
void CheckShape(const char* name, const std::vector<size_t>& want, const HostArray<T>& a) {
  bool same = a.ndim() == want.size();
  for (size_t i = 0; same && i < a.ndim(); ++i) same = a.shape(i) == want[i];
  if (!same) throw std::invalid_argument(std::string("ep_transport_selftest: ") + name +
                                         " has the wrong shape");
}

}  // namespace

NB_MODULE(_mok_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["mok_moe_fwd"] = mok::Capsule(MokMoeFwdCuda);
    targets["mok_moe_bwd"] = mok::Capsule(MokMoeBwdCuda);
    targets["mok_moe_combine"] = mok::Capsule(MokMoeCombineCuda);
    targets["mok_ep_dispatch"] = mok::Capsule(MokEpDispatchCuda);
    targets["mok_ep_combine"] = mok::Capsule(MokEpCombineCuda);
    targets["mok_moe_fwd_fp8"] = mok::Capsule(MokMoeFwdFp8Cuda);
    targets["mok_moe_bwd_fp8"] = mok::Capsule(MokMoeBwdFp8Cuda);
    targets["mok_quantize_weight"] = mok::Capsule(MokQuantizeWeightCuda);
    return targets;
  });

  // (handle, status, message): handle > 0 and status "ok", or 0 and what failed.
  m.def("workspace_create", [](const std::vector<int>& devices, int64_t bytes) {
    int64_t handle = 0;
    std::string message;
    const auto status = mok::cuda::WorkspaceCreate(devices, bytes, &handle, &message);
    return std::make_tuple(handle, std::string(StatusName(status)), message);
  });
  m.def("can_access_peer", [](int device, int peer) {
    int can = 0;
    if (const cudaError_t err = cudaDeviceCanAccessPeer(&can, device, peer); err != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("cudaDeviceCanAccessPeer(") + std::to_string(device) +
                               ", " + std::to_string(peer) + ") failed: " +
                               cudaGetErrorString(err));
    }
    return can != 0;
  }, nb::arg("device"), nb::arg("peer"),
  "Whether GPU `device` can map GPU `peer`'s memory (cudaDeviceCanAccessPeer).");
  // (handle, status, message, handles): this process's segments of a workspace across
  // processes (devices: an ordinal for each of this process's ranks, -1 for the others'),
  // allocated, zeroed and exported as `kind` ("ipc": CUDA IPC handles, "fabric": fabric
  // handles of memory pools); handles[s] is rank s's exported bytes, its first byte naming the
  // kind (b"" for the ranks of other processes).
  m.def("workspace_export", [](const std::vector<int>& devices, int64_t bytes,
                               const std::string& kind) {
    using K = mok::cuda::WorkspaceHandleKind;
    if (kind != "ipc" && kind != "fabric")
      throw std::invalid_argument("workspace_export: kind must be 'ipc' or 'fabric', got '" +
                                  kind + "'");
    int64_t handle = 0;
    std::string message;
    std::vector<std::string> exported;
    const auto status = mok::cuda::WorkspaceExport(devices, bytes,
                                                   kind == "ipc" ? K::kIpc : K::kFabric,
                                                   &handle, &exported, &message);
    nb::list handles;
    for (const std::string& h : exported) handles.append(nb::bytes(h.data(), h.size()));
    return std::make_tuple(handle, std::string(StatusName(status)), message, handles);
  });
  // (status, message): the other processes' segments mapped (handles[q]: rank q's, from its
  // process's workspace_export; ignored for this process's ranks) and the tables written.
  m.def("workspace_import", [](int64_t handle, const nb::list& handles) {
    std::vector<std::string> imported;
    for (nb::handle h : handles) {
      const nb::bytes b = nb::cast<nb::bytes>(h);
      imported.emplace_back(b.c_str(), b.size());
    }
    std::string message;
    const auto status = mok::cuda::WorkspaceImport(handle, imported, &message);
    return std::make_tuple(std::string(StatusName(status)), message);
  });
  // (supported, reason): whether GPU `device` exports memory pools as fabric handles (it tries
  // a small pool); reason: "" or what the driver reported and what to do.
  m.def("workspace_fabric_supported", [](int device) {
    const std::string problem = mok::cuda::WorkspaceFabricProblem(device);
    return std::make_tuple(problem.empty(), problem);
  }, nb::arg("device"));
  m.def("workspace_close", [](int64_t handle) { return mok::cuda::WorkspaceClose(handle); });
  m.def("workspace_free", [](int64_t handle) { return mok::cuda::WorkspaceFree(handle); });
  m.def("workspace_write", [](int64_t handle, int rank, int peer, int64_t offset,
                              const nb::bytes& data) {
    std::string host(data.c_str(), data.size());
    const std::string err = mok::cuda::WorkspaceCopy(handle, rank, peer, offset, host.data(),
                                                     static_cast<int64_t>(host.size()), true);
    if (!err.empty()) throw std::invalid_argument("workspace_write: " + err);
  }, nb::arg("handle"), nb::arg("rank"), nb::arg("peer"), nb::arg("offset"), nb::arg("data"),
  "Writes `data` at `offset` of rank `peer`'s segment through the address this process's rank "
  "`rank` maps it at (tests and debugging).");
  m.def("workspace_read", [](int64_t handle, int rank, int peer, int64_t offset, int64_t size) {
    std::string host(static_cast<size_t>(size < 0 ? 0 : size), '\0');
    const std::string err = mok::cuda::WorkspaceCopy(handle, rank, peer, offset, host.data(),
                                                     size, false);
    if (!err.empty()) throw std::invalid_argument("workspace_read: " + err);
    return nb::bytes(host.data(), host.size());
  }, nb::arg("handle"), nb::arg("rank"), nb::arg("peer"), nb::arg("offset"), nb::arg("size"),
  "`size` bytes at `offset` of rank `peer`'s segment, read through the address this process's "
  "rank `rank` maps it at (tests and debugging).");
  m.def("workspace_info", [](int64_t handle) {
    mok::cuda::WorkspaceInfo info;
    if (!mok::cuda::WorkspaceLookup(handle, &info))
      throw std::invalid_argument("no workspace has handle " + std::to_string(handle));
    std::vector<int> devices;
    std::vector<uintptr_t> bases, peers;
    for (const auto& r : info.ranks) {
      devices.push_back(r.device);
      bases.push_back(reinterpret_cast<uintptr_t>(r.base));
      peers.push_back(reinterpret_cast<uintptr_t>(r.peers));
    }
    nb::dict d;
    d["bytes"] = info.bytes, d["stride"] = info.stride, d["devices"] = devices;
    d["bases"] = bases, d["peers"] = peers;
    nb::list tables;
    for (const auto& t : info.tables) {
      std::vector<uintptr_t> row;
      for (void* p : t) row.push_back(reinterpret_cast<uintptr_t>(p));
      tables.append(nb::cast(row));
    }
    d["tables"] = tables;
    return d;
  });

  m.def("ep_transport_constants", []() {
    nb::dict d;
    d["stages"] = static_cast<int>(mok::cuda::kEpStages);
    d["layout_fields"] = mok::cuda::kEpLayoutFields;
    d["sync_bytes"] = mok::cuda::kEpSyncBytes;
    d["wait_bound_ns"] = mok::cuda::kEpWaitBoundNs;
    d["max_ranks"] = mok::cuda::kEpMaxRanks;
    d["max_local_experts"] = mok::cuda::kEpMaxLocalExperts;
    return d;
  });

  m.def(
      "ep_transport_selftest",
      [](int64_t handle, const nb::dict& layout, int64_t C, HostArray<uint16_t> x,
         HostArray<int32_t> experts, std::optional<HostArray<float>> weights,
         HostArray<float> scales, bool graph, int in_flight, int silent_rank,
         uint64_t wait_bound_ns) {
        if (x.ndim() != 4 || experts.ndim() != 4 || scales.ndim() != 1)
          throw std::invalid_argument(
              "ep_transport_selftest: x (R, P, T, H), experts (R, P, T, k), scales (E)");
        mok::cuda::EpSelftestArgs a;
        a.handle = handle, a.layout = LayoutOf(layout);
        const size_t R = x.shape(0), P = x.shape(1), T = x.shape(2), H = x.shape(3);
        const size_t k = experts.shape(3), E = scales.shape(0);
        CheckShape("experts", {R, P, T, k}, experts);
        if (weights) CheckShape("weights", {R, P, T, k}, *weights);
        mok::cuda::WorkspaceInfo info;
        if (!mok::cuda::WorkspaceLookup(handle, &info) || info.ranks.size() != P)
          throw std::invalid_argument(
              "ep_transport_selftest: x's second axis must be the workspace's ranks");
        a.T = static_cast<int64_t>(T), a.H = static_cast<int64_t>(H), a.C = C;
        a.k = static_cast<int>(k), a.E = static_cast<int>(E), a.rounds = static_cast<int>(R);
        a.graph = graph, a.in_flight = in_flight, a.silent_rank = silent_rank;
        a.wait_bound_ns = wait_bound_ns;
        a.x = x.data(), a.experts = experts.data(), a.scales = scales.data();
        a.weights = weights ? weights->data() : nullptr;
        mok::cuda::EpSelftestResult out;
        std::string error;
        {
          nb::gil_scoped_release release;
          error = mok::cuda::EpTransportSelftest(a, &out);
        }
        if (!error.empty()) throw std::runtime_error("ep_transport_selftest: " + error);
        const size_t rows = P * static_cast<size_t>(C), per = 1 + E / P;
        nb::dict d;
        d["x_recv"] = ToNumpy(std::move(out.x_recv), {R, P, rows, H});
        d["expert_recv"] = ToNumpy(std::move(out.expert_recv), {R, P, rows});
        d["weight_recv"] = ToNumpy(std::move(out.weight_recv), {R, P, rows});
        d["route_recv"] = ToNumpy(std::move(out.route_recv), {R, P, rows});
        d["counts"] = ToNumpy(std::move(out.counts), {R, P, P, per});
        d["route"] = ToNumpy(std::move(out.route), {R, P, rows});
        d["slot"] = ToNumpy(std::move(out.slot), {R, P, T, k});
        d["sent"] = ToNumpy(std::move(out.sent), {R, P, P});
        d["need"] = ToNumpy(std::move(out.need), {R, P, P});
        d["y"] = ToNumpy(std::move(out.y), {R, P, T, H});
        d["out_weights"] = ToNumpy(std::move(out.out_weights), {R, P, T, k});
        d["epochs"] = ToNumpy(std::move(out.epochs), {P, static_cast<size_t>(mok::cuda::kEpCalls)});
        return d;
      },
      nb::arg("handle"), nb::arg("layout"), nb::arg("capacity"), nb::arg("x"),
      nb::arg("experts"), nb::arg("weights").none(), nb::arg("scales"), nb::arg("graph") = false,
      nb::arg("in_flight") = 1, nb::arg("silent_rank") = -1,
      nb::arg("wait_bound_ns") = mok::cuda::kEpWaitBoundNs,
      "Runs the NVLink transport's P ranks of workspace `handle` for R rounds (see "
      "ffi/ep_transport_selftest.h); x is bf16 as uint16 bits. Returns each rank's results "
      "after each round, (R, P, ...).");
}
