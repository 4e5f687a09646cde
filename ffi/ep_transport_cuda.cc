// The NVLink transport's custom calls (platform "CUDA" only; Config.ep_transport="nvlink"):
//   mok_ep_dispatch  this rank's routed rows into their owners' receive regions, and what this
//                    rank received out of its own (LaunchEpDispatch)
//   mok_ep_combine   each received row's output into its home slot, and the home sum of this
//                    rank's slots (LaunchEpCombine)
// Both take the workspaces of the layer's EP groups as handles (attribute `workspaces`, one a
// group) and the byte layout of a segment (attribute `layout`, EpLayout's fields in order,
// from mok_jax.Workspace.layout). A call's rank is the place of its GPU (the FFI context's
// device ordinal) among this process's ranks of the workspace that holds that GPU; every
// other size comes from the buffers' shapes. Kernels only, on XLA's stream, with the rounds counted on the device: the handlers
// carry kCmdBufferCompatible.
#include <cuda_runtime_api.h>

#include <array>
#include <mutex>
#include <string>
#include <utility>

#include "../cuda/ep_transport.h"
#include "moe_args.h"
#include "moe_cuda.h"
#include "workspace_cuda.h"

namespace mok {
namespace {

using ffi::DataType;

ffi::Error Invalid(const char* target, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + what);
}

// EpTransportCtas of a GPU with one rank, once a GPU (an occupancy query needs no sync, but
// costs microseconds a call).
ffi::ErrorOr<int> CtasOf(int device) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static std::array<int, kMaxDevices> ctas{};
  if (device < 0 || device >= kMaxDevices)
    return ffi::Unexpected(ffi::Error::Internal(
        "GPU " + std::to_string(device) + " is past the 64 this handler keeps launch sizes for"));
  std::lock_guard<std::mutex> lock(mutex);
  if (ctas[device] == 0) {
    if (const char* err = cuda::EpTransportCtas(device, 1, &ctas[device]))
      return ffi::Unexpected(ffi::Error::Internal(std::string("EpTransportCtas: ") + err));
  }
  return ctas[device];
}

// The workspace of GPU `device` (XLA's device ordinal of the call, the CUDA device ordinal
// that Workspace.get records: local_hardware_id) among `handles` and its rank there, into a's
// ranks, rank, peers, own, ctas, layout and wait bound. The ordinal comes from the FFI
// context, not from the stream: under XLA's command buffers the handler runs while the stream
// is capturing, where cudaStreamGetDevice is not permitted. A rank is named by (process,
// GPU): this process's registry records the ordinal of each of its own ranks and -1 for the
// ranks of other processes (a workspace across processes), so the ordinal finds this
// process's rank even where another process's rank is on a GPU of the same ordinal.
ffi::Error BindWorkspace(const char* target, int32_t device,
                         ffi::Span<const int64_t> handles, ffi::Span<const int64_t> layout,
                         cuda::EpTransportArgs* a) {
  if (layout.size() != cuda::kEpLayoutFields)
    return Invalid(target, "layout must hold the " + std::to_string(cuda::kEpLayoutFields) +
                               " fields of EpLayout (Workspace.layout), got " +
                               std::to_string(layout.size()));
  int64_t* fields = reinterpret_cast<int64_t*>(&a->layout);
  for (int i = 0; i < cuda::kEpLayoutFields; ++i) fields[i] = layout.begin()[i];
  cuda::WorkspaceInfo ws;
  int rank = -1;
  for (int64_t handle : handles) {
    cuda::WorkspaceInfo candidate;
    if (!cuda::WorkspaceLookup(handle, &candidate)) continue;
    for (size_t s = 0; s < candidate.ranks.size() && rank < 0; ++s) {
      if (candidate.ranks[s].device == device) rank = static_cast<int>(s), ws = candidate;
    }
    if (rank >= 0) break;
  }
  if (rank < 0)
    return Invalid(target, "no workspace of this call (handles of the EP groups, " +
                               std::to_string(handles.size()) + ") holds GPU " +
                               std::to_string(device) +
                               ": the program was lowered without the GPUs of its EP groups "
                               "(shard_map over an AbstractMesh, jax.export, or a workspace "
                               "freed since); ep_transport='nvlink' needs shard_map over a "
                               "jax.sharding.Mesh of this process's GPUs when it is lowered");
  const int P = static_cast<int>(ws.ranks.size());
  if (P > 1 && ws.stride != 0)
    return Invalid(target, "the workspace puts all " + std::to_string(P) + " ranks on GPU " +
                               std::to_string(device) + ": XLA runs one rank a GPU (several "
                               "ranks on one GPU are the self-test's)");
  if (P != a->ranks)
    return Invalid(target, "the buffers are for " + std::to_string(a->ranks) + " ranks, the "
                               "workspace of GPU " + std::to_string(device) + " has " +
                               std::to_string(P));
  if (a->layout.bytes > ws.bytes)
    return Invalid(target, "the layout needs " + std::to_string(a->layout.bytes) + " bytes a "
                               "rank, the workspace has " + std::to_string(ws.bytes));
  auto ctas = CtasOf(device);
  if (ctas.has_error()) return ctas.error();
  a->rank = rank;
  a->peers = ws.ranks[rank].peers, a->own = ws.ranks[rank].base;
  a->ctas = *ctas;
  a->wait_bound_ns = cuda::kEpWaitBoundNs;
  return ffi::Error::Success();
}

// The sizes that the receive side's shapes give: P from counts_recv (P, 1 + E_local), C from
// its P C rows.
ffi::Error ReceiveDims(const char* target, ffi::AnyBuffer counts_recv, int64_t rows,
                       cuda::EpTransportArgs* a) {
  const auto c = counts_recv.dimensions();
  if (counts_recv.element_type() != DataType::S32 || c.size() != 2 || c[0] < 1 || c[1] < 2)
    return Invalid(target, "counts_recv must be s32[P, 1 + E_local] with P >= 1 and "
                           "E_local >= 1, got " +
                               DescribeBuffer(counts_recv.element_type(), c));
  if (rows % c[0] != 0)
    return Invalid(target, "the received rows (" + std::to_string(rows) + ") are not P C for P = " +
                               std::to_string(c[0]));
  a->ranks = static_cast<int>(c[0]), a->E_local = static_cast<int>(c[1] - 1);
  a->C = rows / c[0];
  return ffi::Error::Success();
}

ffi::Error EpDispatchCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                          ffi::AnyBuffer experts, ffi::AnyBuffer weights,
                          ffi::Result<ffi::AnyBuffer> x_recv,
                          ffi::Result<ffi::AnyBuffer> expert_recv,
                          ffi::Result<ffi::AnyBuffer> weight_recv,
                          ffi::Result<ffi::AnyBuffer> route_recv,
                          ffi::Result<ffi::AnyBuffer> counts_recv,
                          ffi::Result<ffi::AnyBuffer> pos, ffi::Result<ffi::AnyBuffer> need,
                          ffi::Result<ffi::AnyBuffer> route, ffi::Result<ffi::AnyBuffer> slot,
                          ffi::Result<ffi::AnyBuffer> sent,
                          ffi::Result<ffi::AnyBuffer> counts_to,
                          ffi::Span<const int64_t> workspaces, ffi::Span<const int64_t> layout) {
  constexpr const char* kTarget = "mok_ep_dispatch";
  const auto xd = x.dimensions(), ed = experts.dimensions(), rd = x_recv->dimensions();
  if (x.element_type() != DataType::BF16 || xd.size() != 2)
    return Invalid(kTarget, "x must be bf16[T, H], got " + DescribeBuffer(x.element_type(), xd));
  if (ed.size() != 2 || ed[0] != xd[0])
    return Invalid(kTarget, "experts must be s32[T, k] with T = " + std::to_string(xd[0]) +
                                ", got " + DescribeBuffer(experts.element_type(), ed));
  if (rd.size() != 2)
    return Invalid(kTarget, "x_recv must be bf16[P C, H], got " +
                                DescribeBuffer(x_recv->element_type(), rd));
  cuda::EpTransportArgs a{};
  a.T = xd[0], a.H = xd[1], a.k = static_cast<int>(ed[1]);
  if (auto err = ReceiveDims(kTarget, *counts_recv, rd[0], &a); err.failure()) return err;
  const int64_t P = a.ranks, rows = P * a.C, E_local = a.E_local;
  const bool weighted = weights.dimensions().size() == 2 && weights.dimensions()[0] != 0;
  for (auto err :
       {CheckBuffer(kTarget, "experts", experts, DataType::S32, {a.T, a.k}),
        CheckBuffer(kTarget, "weights", weights, DataType::F32, {weighted ? a.T : 0, a.k}),
        CheckBuffer(kTarget, "x_recv", *x_recv, DataType::BF16, {rows, a.H}),
        CheckBuffer(kTarget, "expert_recv", *expert_recv, DataType::S32, {rows}),
        CheckBuffer(kTarget, "weight_recv", *weight_recv, DataType::F32, {rows}),
        CheckBuffer(kTarget, "route_recv", *route_recv, DataType::S32, {rows}),
        CheckBuffer(kTarget, "pos", *pos, DataType::S32, {a.T, a.k}),
        CheckBuffer(kTarget, "need", *need, DataType::S32, {P}),
        CheckBuffer(kTarget, "route", *route, DataType::S32, {rows}),
        CheckBuffer(kTarget, "slot", *slot, DataType::S32, {a.T, a.k}),
        CheckBuffer(kTarget, "sent", *sent, DataType::S32, {P}),
        CheckBuffer(kTarget, "counts_to", *counts_to, DataType::S32, {P, E_local})}) {
    if (err.failure()) return err;
  }
  if (auto err = BindWorkspace(kTarget, device, workspaces, layout, &a); err.failure())
    return err;
  a.x = x.untyped_data(), a.experts = experts.reinterpret_data<int32_t>();
  a.weights = weighted ? weights.reinterpret_data<float>() : nullptr;
  a.route = route->reinterpret_data<int32_t>(), a.slot = slot->reinterpret_data<int32_t>();
  a.pos = pos->reinterpret_data<int32_t>(), a.sent = sent->reinterpret_data<int32_t>();
  a.need = need->reinterpret_data<int32_t>(), a.counts_to = counts_to->reinterpret_data<int32_t>();
  a.x_recv = x_recv->untyped_data(), a.expert_recv = expert_recv->reinterpret_data<int32_t>();
  a.weight_recv = weight_recv->reinterpret_data<float>();
  a.route_recv = route_recv->reinterpret_data<int32_t>();
  a.counts_recv = counts_recv->reinterpret_data<int32_t>();
  if (const char* err = cuda::LaunchEpDispatch(a, stream))
    return Invalid(kTarget, err);
  return ffi::Error::Success();
}

ffi::Error EpCombineCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer rows,
                         ffi::AnyBuffer row_weights, ffi::AnyBuffer route_recv,
                         ffi::AnyBuffer counts_recv,
                         ffi::AnyBuffer pos, ffi::AnyBuffer weights, ffi::AnyBuffer extra,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_weights,
                         ffi::Span<const int64_t> workspaces, ffi::Span<const int64_t> layout) {
  constexpr const char* kTarget = "mok_ep_combine";
  const auto rd = rows.dimensions(), pd = pos.dimensions(), od = out->dimensions();
  if (rows.element_type() != DataType::BF16 || rd.size() != 2)
    return Invalid(kTarget, "rows must be bf16[P C, H], got " +
                                DescribeBuffer(rows.element_type(), rd));
  if (pd.size() != 2)
    return Invalid(kTarget, "pos must be s32[T, k], got " + DescribeBuffer(pos.element_type(), pd));
  cuda::EpTransportArgs a{};
  a.T = pd[0], a.k = static_cast<int>(pd[1]), a.H = rd[1];
  if (auto err = ReceiveDims(kTarget, counts_recv, rd[0], &a); err.failure()) return err;
  const int64_t n = rd[0];
  const bool returned = row_weights.dimensions().size() == 1 && row_weights.dimensions()[0] != 0;
  const bool weighted = weights.dimensions().size() == 2 && weights.dimensions()[0] != 0;
  const bool with_extra = extra.dimensions().size() == 2 && extra.dimensions()[0] != 0;
  a.out_f32 = out->element_type() == DataType::F32;
  for (auto err :
       {CheckBuffer(kTarget, "row_weights", row_weights, DataType::F32, {returned ? n : 0}),
        CheckBuffer(kTarget, "route_recv", route_recv, DataType::S32, {n}),
        CheckBuffer(kTarget, "pos", pos, DataType::S32, {a.T, a.k}),
        CheckBuffer(kTarget, "weights", weights, DataType::F32, {weighted ? a.T : 0, a.k}),
        CheckBuffer(kTarget, "extra", extra, DataType::BF16, {with_extra ? a.T : 0, a.H}),
        CheckBuffer(kTarget, "out", *out, a.out_f32 ? DataType::F32 : DataType::BF16,
                    {a.T, a.H}),
        CheckBuffer(kTarget, "out_weights", *out_weights, DataType::F32,
                    {returned ? a.T : 0, a.k})}) {
    if (err.failure()) return err;
  }
  if (auto err = BindWorkspace(kTarget, device, workspaces, layout, &a); err.failure())
    return err;
  a.rows = rows.untyped_data();
  a.row_weights = returned ? row_weights.reinterpret_data<float>() : nullptr;
  a.route_recv = route_recv.reinterpret_data<int32_t>();
  a.counts_recv = counts_recv.reinterpret_data<int32_t>();
  a.pos = pos.reinterpret_data<int32_t>();
  a.weights = weighted ? weights.reinterpret_data<float>() : nullptr;
  a.extra = with_extra ? extra.untyped_data() : nullptr;
  a.out = out->untyped_data();
  a.out_weights = returned ? out_weights->reinterpret_data<float>() : nullptr;
  if (const char* err = cuda::LaunchEpCombine(a, stream))
    return Invalid(kTarget, err);
  return ffi::Error::Success();
}

// The argument lists, one comment a buffer (tests/test_buffer_table.py reads them against
// mok_jax.ep_transport's DISPATCH_* and COMBINE_* tables).
template <class Binding>
auto BindEpDispatch(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x (T, H) bf16
      .template Arg<ffi::AnyBuffer>()            // experts (T, k) s32 global ids
      .template Arg<ffi::AnyBuffer>()            // weights (T, k) f32, or (0, k): weight 1
      .template Ret<ffi::AnyBuffer>()            // x_recv (P C, H) bf16
      .template Ret<ffi::AnyBuffer>()            // expert_recv (P C) s32
      .template Ret<ffi::AnyBuffer>()            // weight_recv (P C) f32
      .template Ret<ffi::AnyBuffer>()            // route_recv (P C) s32
      .template Ret<ffi::AnyBuffer>()            // counts_recv (P, 1 + E_local) s32
      .template Ret<ffi::AnyBuffer>()            // pos (T, k) s32
      .template Ret<ffi::AnyBuffer>()            // need (P) s32
      .template Ret<ffi::AnyBuffer>()            // scratch route (P C) s32
      .template Ret<ffi::AnyBuffer>()            // scratch slot (T, k) s32
      .template Ret<ffi::AnyBuffer>()            // scratch sent (P) s32
      .template Ret<ffi::AnyBuffer>()            // scratch counts_to (P, E_local) s32
      .template Attr<ffi::Span<const int64_t>>("workspaces")
      .template Attr<ffi::Span<const int64_t>>("layout");
}

template <class Binding>
auto BindEpCombine(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // rows (P C, H) bf16
      .template Arg<ffi::AnyBuffer>()            // row_weights (P C) f32, or (0)
      .template Arg<ffi::AnyBuffer>()            // route_recv (P C) s32
      .template Arg<ffi::AnyBuffer>()            // counts_recv (P, 1 + E_local) s32
      .template Arg<ffi::AnyBuffer>()            // pos (T, k) s32
      .template Arg<ffi::AnyBuffer>()            // weights (T, k) f32, or (0, k): weight 1
      .template Arg<ffi::AnyBuffer>()            // extra (T, H) bf16, or (0, H)
      .template Ret<ffi::AnyBuffer>()            // out (T, H) bf16|f32
      .template Ret<ffi::AnyBuffer>()            // out_weights (T, k) f32, or (0, k)
      .template Attr<ffi::Span<const int64_t>>("workspaces")
      .template Attr<ffi::Span<const int64_t>>("layout");
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokEpDispatchCuda, mok::EpDispatchCuda,
    mok::BindEpDispatch(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                         .Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokEpCombineCuda, mok::EpCombineCuda,
    mok::BindEpCombine(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                         .Ctx<xla::ffi::DeviceOrdinal>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
