// Launchers of the NVLink transport of expert parallelism (sm90/ep_transport.cuh), callable from
// host code that sees neither XLA's nor CuTe's headers (docs/design.md: they never meet in one
// translation unit). docs/expert_parallel.md describes the protocol; mok_jax/workspace.py owns
// the workspace's byte layout, which reaches the kernels as EpLayout.
//
// How a failed wait reaches the user: a wait on a peer's flag that lasts longer than
// EpTransportArgs::wait_bound_ns (kEpWaitBoundNs unless a test shortens it) prints one line from
// the device, "mok_jax ep_transport timeout: rank R, stage S, peer Q: flag F, waited for W",
// then executes `trap`. The kernel ends with cudaErrorLaunchFailure, which is sticky: every
// later CUDA call of the process on that GPU fails with it, XLA raises it (an
// XlaRuntimeError naming the CUDA error) at the next operation that waits for the GPU, and the
// driver writes the device's printf buffer to the process's stdout. The process has to exit;
// it does not hang, and the line says which rank waited for whom in which stage.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mok::cuda {

// The stages that signal across ranks: one flag per (stage, source rank) in every rank's
// workspace, one epoch counter per stage in every rank's sync region.
enum EpStage : int32_t { kEpDispatch = 0, kEpCombine = 1, kEpStages = 2 };

// A cross-rank wait longer than this is a failure (a peer that never runs, a protocol bug): a
// healthy wait lasts microseconds to milliseconds, a slow peer (its GEMMs still running) well
// under a second; ten seconds also tolerate compute-sanitizer's slowdown.
constexpr uint64_t kEpWaitBoundNs = 10'000'000'000ull;

// Threads of every transport CTA (8 warps: a warp a row).
constexpr int kEpThreads = 256;
// The kernels keep per-rank prefix sums and per-expert histograms in shared memory.
constexpr int kEpMaxRanks = 256;
constexpr int kEpMaxLocalExperts = 1024;

// The sync region of a rank's segment (Workspace.layout's `sync`, SYNC_BYTES bytes), zeroed
// when the workspace is created and afterwards touched only by the transport kernels.
struct EpSync {
  int32_t epoch[kEpStages];  // the round this rank last ran of each stage
  int32_t done[kEpStages];   // CTAs of the running send kernel that have finished sending
  int32_t reported;          // 1 once this rank has printed a timeout
};
constexpr int64_t kEpSyncBytes = 128;  // mok_jax.workspace.SYNC_BYTES
static_assert(sizeof(EpSync) <= kEpSyncBytes, "EpSync must fit the sync region of the layout");

// Byte offsets of a rank's regions in its segment: mok_jax.Workspace.layout, the same on every
// rank. P ranks, C send slots a (source, destination) block, T tokens a rank, k routes a token.
struct EpLayout {
  int64_t recv_rows;      // (P C, H) bf16: block s = the rows rank s sent here, in its send order
  int64_t combine_slots;  // (T k, H) bf16: route t k + j's output, written by its owner
  int64_t recv_route;     // (P C) s32: the route t k + j (at its home) of each received row
  int64_t recv_expert;    // (P C) s32: the local expert of each received row
  int64_t counts;         // (P, 1 + E_local) s32: [s, 0] rows from rank s, [s, 1 + e] of them
                          // for local expert e
  int64_t flags;          // (kEpStages, P) s32: [stage, s] the round rank s last signalled here
  int64_t sync;           // EpSync
  int64_t bytes;          // the segment's size
};

// One rank's view of one round. Device pointers; bf16 rows as void*.
struct EpTransportArgs {
  int64_t T, H, C;  // tokens of each rank, model width (a multiple of 8), send slots a block
  int k, E_local;   // routes a token, experts a rank (E = ranks E_local global experts)
  int ranks, rank;  // P, and this rank's index in the EP group
  EpLayout layout;
  void* const* peers;      // (P) device table: every rank's segment base, peers[rank] its own
  void* own;               // peers[rank], as the host knows it
  int ctas;                // the most CTAs of one transport kernel (EpTransportCtas)
  uint64_t wait_bound_ns;  // kEpWaitBoundNs

  const void* x;           // (T, H) bf16: this rank's tokens
  const int32_t* experts;  // (T, k) s32 global ids; outside [0, E): no route
  const float* weights;    // (T, k) f32, or null: every route weighs 1
  const void* extra;       // (T, H) bf16 added after the routes (the shared expert), or null
  const void* rows_out;    // (P C, H) bf16: the owner's output of each received row, in the
                           // receive rows' order
  void* y;                 // (T, H) bf16: this rank's combined output

  // The send layout of mok_jax.expert_parallel.plan, computed on the device (LaunchEpPlan).
  int32_t* route;      // (P C): the route t k + j in each send slot, -1 when empty
  int32_t* slot;       // (T k): the send slot of each route, -1 (invalid id or past C)
  int32_t* pos;        // (T k): t k + j where the route has a slot, else -1: the home sum's
                       // rows in the combine slots (CombineArgs::pos)
  int32_t* sent;       // (P): rows sent to each rank, at most C
  int32_t* need;       // (P): routes to each rank, all of them: more than C is an overflow
  int32_t* counts_to;  // (P, E_local): sent rows for each local expert of each rank
};

// Checks the dimensions, the layout against them and the segment size; nullptr or a message.
const char* EpCheckArgs(const EpTransportArgs& a);

// The most CTAs one transport kernel may take on `device` so that the kernels of
// `ranks_on_device` ranks sharing it are all resident at once (they wait on each other: a
// waiting CTA that kept a peer's kernel off the SMs would never see its flag).
const char* EpTransportCtas(int device, int ranks_on_device, int* ctas);

// Each launcher enqueues on `stream` and waits for nothing on the host; nullptr or a message.
// Per round, every rank of the group runs, in this order:
//   LaunchEpPlan        the send layout (route, slot, sent, need, counts_to) from experts
//   LaunchEpDispatch    pushes each sent row with its route and local expert into its owner's
//                       receive rows, then its counts and the dispatch flag (the next round);
//                       returns on the device once every rank's rows for this one are here
//   (the owner's experts read the receive rows and write rows_out)
//   LaunchEpCombine     pushes each received row's output into its home slot t k + j, flags;
//                       then waits for every owner and sums the k slots of each token in j order
// A round's receive rows and counts stay valid until this rank's combine of that round.
const char* LaunchEpPlan(const EpTransportArgs& a, cudaStream_t stream);
const char* LaunchEpDispatch(const EpTransportArgs& a, cudaStream_t stream);
const char* LaunchEpCombine(const EpTransportArgs& a, cudaStream_t stream);

// The self-test's stand-in for the owner's experts: rows_out[r] = bf16(f32(recv[r]) *
// scales[recv_expert[r]]) for every received row, scales (E_local) f32.
const char* LaunchEpScaleRows(const EpTransportArgs& a, const float* scales, void* rows_out,
                              cudaStream_t stream);

}  // namespace mok::cuda
