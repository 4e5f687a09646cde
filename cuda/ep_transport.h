// Launchers of the NVLink transport of expert parallelism (sm90/ep_transport.cuh), callable from
// host code that sees neither XLA's nor CuTe's headers (docs/design.md: they never meet in one
// translation unit). docs/expert_parallel.md describes the protocol; mok_jax/workspace.py owns
// the workspace's byte layout, which reaches the kernels as EpLayout.
//
// Two calls, each a complete collective of the EP group (every rank runs the same calls in the
// same order, as with any collective), so that two calls in any order, or a call without its
// partner (a dispatch whose combine XLA removed as unused), never mix rounds:
//   LaunchEpDispatch  the send layout from experts, each sent row pushed into its owner's
//                     receive region, then copied out into the caller's buffers (x_recv, ...)
//   LaunchEpCombine   each received row's output pushed into its home slot t k + j, then the
//                     home sum of the k slots in j order into the caller's out
// Each call first waits until every peer has read what this rank wrote into it the call before.
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

// The stages that signal across ranks: one flag per (stage, peer) in every rank's workspace.
//   kEpDispatch      flags[d][dispatch][s]: rank s's rows and counts for d are in d's receive
//                    region (round r of s's dispatches)
//   kEpCombine       flags[s][combine][d]: owner d's outputs of s's routes are in s's slots
//   kEpDispatchRead  flags[s][dispatch_read][d]: rank d has copied out what s sent it in round r,
//                    so s may write its block of d's receive region again
//   kEpCombineRead   flags[d][combine_read][s]: rank s has summed its slots of round r, so d may
//                    write into them again
enum EpStage : int32_t {
  kEpDispatch = 0,
  kEpCombine = 1,
  kEpDispatchRead = 2,
  kEpCombineRead = 3,
  kEpStages = 4
};
// A stage's round is its call's epoch: dispatch (0) for kEpDispatch and kEpDispatchRead,
// combine (1) for the other two.
constexpr int kEpCalls = 2;
constexpr int EpCallOf(int stage) { return stage % kEpCalls; }

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
  int32_t epoch[kEpCalls];  // the round this rank last ran of each call (dispatch, combine)
  int32_t done[kEpStages];  // CTAs of the running kernel of each stage that have finished
  int32_t reported;         // 1 once this rank has printed a timeout
};
constexpr int64_t kEpSyncBytes = 128;  // mok_jax.workspace.SYNC_BYTES
static_assert(sizeof(EpSync) <= kEpSyncBytes, "EpSync must fit the sync region of the layout");

// Byte offsets of a rank's regions in its segment: mok_jax.Workspace.layout, the same on every
// rank. P ranks, C send slots a (source, destination) block, T tokens a rank, k routes a token.
struct EpLayout {
  int64_t recv_rows;       // (P C, H) bf16: block s = the rows rank s sent here, in its send order
  int64_t combine_slots;   // (T k, H) bf16: route t k + j's output, written by its owner
  int64_t recv_route;      // (P C) s32: the route t k + j (at its home) of each received row
  int64_t recv_expert;     // (P C) s32: the local expert of each received row
  int64_t recv_weight;     // (P C) f32: the route weight of each received row
  int64_t combine_weight;  // (T k) f32: route t k + j's value sent back with its row (dweights)
  int64_t counts;          // (P, 1 + E_local) s32: [s, 0] rows from rank s, [s, 1 + e] of them
                           // for local expert e
  int64_t flags;           // (kEpStages, P) s32: [stage, q] the round peer q last signalled here
  int64_t sync;            // EpSync
  int64_t bytes;           // the segment's size
};
constexpr int kEpLayoutFields = 10;  // the int64 fields of EpLayout, in order
static_assert(sizeof(EpLayout) == kEpLayoutFields * sizeof(int64_t), "EpLayout is int64 fields");

// One rank's view of one call. Device pointers; bf16 rows as void*. Buffers marked (dispatch)
// are the dispatch call's, (combine) the combine call's; the receive side's are both: the
// dispatch writes them, the combine of the same layer reads them.
struct EpTransportArgs {
  int64_t T, H, C;  // tokens of each rank, model width (a multiple of 8), send slots a block
  int k, E_local;   // routes a token, experts a rank (E = ranks E_local global experts)
  int ranks, rank;  // P, and this rank's index in the EP group
  EpLayout layout;
  void* const* peers;      // (P) device table: every rank's segment base, peers[rank] its own
  void* own;               // peers[rank], as the host knows it
  int ctas;                // the most CTAs of one transport kernel (EpTransportCtas)
  uint64_t wait_bound_ns;  // kEpWaitBoundNs

  // (dispatch) in: this rank's tokens and routes.
  const void* x;           // (T, H) bf16: the rows to send (x, or dy in the backward)
  const int32_t* experts;  // (T, k) s32 global ids; outside [0, E): no route
  const float* weights;    // (T, k) f32, or null: every route weighs 1 (also the home sum's)
  // (dispatch) out: the send layout of mok_jax.expert_parallel.plan, computed on the device.
  int32_t* route;      // (P C): the route t k + j in each send slot, -1 when empty
  int32_t* slot;       // (T k): the send slot of each route, -1 (invalid id or past C)
  int32_t* pos;        // (T k): t k + j where the route has a slot, else -1: the home sum's
                       // rows in the combine slots (CombineArgs::pos)
  int32_t* sent;       // (P): rows sent to each rank, at most C
  int32_t* need;       // (P): routes to each rank, all of them: more than C is an overflow
  int32_t* counts_to;  // (P, E_local): sent rows for each local expert of each rank
  // (dispatch) out, (combine) in: what this rank received, copied out of its receive region.
  void* x_recv;          // (P C, H) bf16: block s = rank s's rows for this rank in its send
                         // order; rows past counts_recv[s, 0] are not written
  int32_t* expert_recv;  // (P C): local expert of each received row, -1 past the counts
  float* weight_recv;    // (P C): its route weight, 0 past the counts
  int32_t* route_recv;   // (P C): its home route t k + j, -1 past the counts
  int32_t* counts_recv;  // (P, 1 + E_local): the counts region (rows from s, by expert)

  // (combine) in: the owner's outputs of the received rows, and the home sum's terms.
  const void* rows;          // (P C, H) bf16: the output of each received row
  const float* row_weights;  // (P C) f32 sent back with each row, or null
  const void* extra;         // (T, H) bf16 added after the routes (the shared expert), or null
  // (combine) out.
  void* out;            // (T, H): bf16, or f32 when out_f32
  bool out_f32;
  float* out_weights;   // (T k) f32: each route's row_weights value, 0 without a slot; or null
};

// Checks the dimensions, the layout against them and the segment size; nullptr or a message.
const char* EpCheckArgs(const EpTransportArgs& a);

// The most CTAs one transport kernel may take on `device` so that the kernels of
// `ranks_on_device` ranks sharing it are all resident at once (they wait on each other: a
// waiting CTA that kept a peer's kernel off the SMs would never see its flag).
const char* EpTransportCtas(int device, int ranks_on_device, int* ctas);

// Each launcher enqueues on `stream` and waits for nothing on the host; nullptr or a message.
//   LaunchEpDispatch: x, experts, weights -> the send layout and the receive side
//   LaunchEpCombine:  rows, row_weights, the receive side (route_recv, counts_recv), pos,
//                     weights, extra -> out, out_weights
const char* LaunchEpDispatch(const EpTransportArgs& a, cudaStream_t stream);
const char* LaunchEpCombine(const EpTransportArgs& a, cudaStream_t stream);

// The self-test's stand-in for the owner's experts, on the dispatch's receive side: for every
// received row r, rows_out[r] = bf16(f32(x_recv[r]) * scales[expert_recv[r]]) and
// row_weights[r] = weight_recv[r] * scales[expert_recv[r]] (f32); scales (E_local) f32.
const char* LaunchEpScaleRows(const EpTransportArgs& a, const float* scales, void* rows_out,
                              float* row_weights, cudaStream_t stream);

}  // namespace mok::cuda
