// The NVLink transport of expert parallelism: the routed-row layout of
// mok_jax.expert_parallel moved by the kernels themselves over a symmetric workspace
// (mok_jax/workspace.py), with unicast 16-byte stores and flags. docs/expert_parallel.md has the
// protocol; ../ep_transport.h the two calls and how a timeout reaches the user.
//
// The dispatch call, on rank s (P ranks, C slots a block, T tokens, k routes a token):
//   EpPlanKernel        block d of the send slots = s's routes to rank d in ascending (t, j)
//   EpAwaitKernel       until every rank d has copied out what s sent it the dispatch before
//   EpDispatchKernel    row i of block d -> rank d's receive row s C + i (with its route, local
//                       expert and weight); the CTA that finishes last writes s's counts into
//                       every rank d, releases flags[d][dispatch][s] = round, then waits until
//                       every rank's flag here has reached the round
//   EpReceiveKernel     the receive region -> the caller's buffers; the last CTA releases
//                       flags[q][dispatch_read][s] = round to every source q
// The combine call, on the owner d of the received rows:
//   EpAwaitKernel       until every home rank has summed what d sent it the combine before
//   EpCombineSendKernel received row q C + i -> rank q's home slot route (t k + j), with its
//                       row weight; the last CTA releases flags[q][combine][d] = round and waits
//   CombineKernel       (combine.cuh) the home sum of the k slots in j order, f32: the same code
//                       and bits as the collective transport
//   EpCombineEndKernel  each route's row weight out of its slot; the last CTA releases
//                       flags[q][combine_read][d] = round to every owner q
//
// The round of each call is the rank's epoch counter of it in its sync region plus one, read,
// signalled and stored back by the last CTA of the call's send kernel: nothing comes from the
// host, so a CUDA graph replays correct rounds and back-to-back calls never mix them. Flags are
// compared by wrapping difference, so the counter may wrap.
//
// NOTES: only one CTA of a kernel waits (the await kernel's only CTA, the send kernel's last
// one after its siblings have finished): a waiting CTA never keeps its own kernel's work off the
// SMs, and one resident CTA per rank is all the waits need. Peer memory is only written
// (push): plain 16-byte unicast stores of rows, 32-bit stores of routes, weights and counts,
// st.release.sys of flags; every load is of this rank's own segment or buffers. System scope
// because the peers are other GPUs (or, in the loopback test, other streams of this one). No
// multimem (NVLink multicast) instruction anywhere.
#pragma once

#include <cstdint>
#include <cstdio>

#include <cuda_bf16.h>

#include "../ep_transport.h"
#include "ptx.cuh"

namespace mok::sm90 {

using cuda::EpCallOf;
using cuda::EpLayout;
using cuda::EpStage;
using cuda::EpSync;
using cuda::EpTransportArgs;
using cuda::kEpCombine;
using cuda::kEpCombineRead;
using cuda::kEpDispatch;
using cuda::kEpDispatchRead;
using cuda::kEpMaxLocalExperts;
using cuda::kEpMaxRanks;
using cuda::kEpStages;
using cuda::kEpThreads;

constexpr int kEpWarps = kEpThreads / 32;

template <class T>
__device__ __forceinline__ T* EpRegion(void* base, int64_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

__device__ __forceinline__ EpSync* EpOwnSync(const EpTransportArgs& a) {
  return EpRegion<EpSync>(a.peers[a.rank], a.layout.sync);
}

// Peer q's flag of `stage` in rank `at`'s segment.
__device__ __forceinline__ int32_t* EpFlag(const EpTransportArgs& a, int at, int stage, int q) {
  return EpRegion<int32_t>(a.peers[at], a.layout.flags) + int64_t{stage} * a.ranks + q;
}

// Flags across GPUs: system scope, so that a peer GPU's stores before its release are visible
// after the acquire that reads the flag.
__device__ __forceinline__ int32_t LoadAcquireSys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];"
               : "=r"(v)
               : "l"(__cvta_generic_to_global(p))
               : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(int32_t* p, int32_t v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(__cvta_generic_to_global(p)), "r"(v)
               : "memory");
}

// Whether flag value `seen` has reached `round` (wrapping: rounds are counted modulo 2^32).
__device__ __forceinline__ bool EpReached(int32_t seen, int32_t round) {
  return static_cast<int32_t>(static_cast<uint32_t>(seen) - static_cast<uint32_t>(round)) >= 0;
}

__device__ __forceinline__ const char* EpStageName(int stage) {
  switch (stage) {
    case kEpDispatch: return "dispatch";
    case kEpCombine: return "combine";
    case kEpDispatchRead: return "dispatch_read";
    default: return "combine_read";
  }
}

// The end of a wait that outlived its bound: one line (the first thread of the rank to time
// out prints it), then trap, which fails the kernel with a sticky launch failure.
__device__ __noinline__ void EpTimeout(int rank, int stage, int peer, int32_t seen, int32_t round,
                                       uint64_t bound_ns, int32_t* reported) {
  if (atomicExch(reported, 1) == 0) {
    printf("mok_jax ep_transport timeout: rank %d, stage %s, peer %d: flag %d, waited for %d "
           "(bound %.1f s); trapping\n",
           rank, EpStageName(stage), peer, seen, round, static_cast<double>(bound_ns) * 1e-9);
  }
  __trap();
}

// Waits until every peer's flag of `stage` here has reached `round`, a thread a peer; bounded
// by wait_bound_ns of the global timer. Every thread returns once all flags are there.
__device__ __forceinline__ void EpWaitAll(const EpTransportArgs& a, int stage, int32_t round) {
  for (int p = threadIdx.x; p < a.ranks; p += kEpThreads) {
    const int32_t* flag = EpFlag(a, a.rank, stage, p);
    int32_t seen = LoadAcquireSys(flag);
    if (EpReached(seen, round)) continue;
    const uint64_t start = GlobalTimerNs();
    for (;;) {
      __nanosleep(64);
      seen = LoadAcquireSys(flag);
      if (EpReached(seen, round)) break;
      if (GlobalTimerNs() - start > a.wait_bound_ns)
        EpTimeout(a.rank, stage, p, seen, round, a.wait_bound_ns, &EpOwnSync(a)->reported);
    }
  }
  __syncthreads();
}

// Releases this rank's flag of `stage` in every rank's segment: round (what this CTA's and,
// through EpLastToFinish, its siblings' stores wrote is visible to whoever acquires it).
__device__ __forceinline__ void EpSignalAll(const EpTransportArgs& a, int stage, int32_t round) {
  for (int d = threadIdx.x; d < a.ranks; d += kEpThreads)
    StoreReleaseSys(EpFlag(a, d, stage, a.rank), round);
}

// The block of dense row index q: the largest d with first[d] <= q (first[P] > q; empty blocks
// repeat a value, and the largest such d is the one that holds q).
__device__ __forceinline__ int EpBlockOf(const int32_t* first, int P, int64_t q) {
  int lo = 0, hi = P;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first[mid] <= q) lo = mid;
    else hi = mid;
  }
  return lo;
}

// first[b] = the exclusive scan of counts[b * stride] over blocks b < P, first[P] the total;
// thread 0 computes it and every thread returns once it is there.
__device__ __forceinline__ void EpScanBlocks(const int32_t* counts, int64_t stride, int P,
                                             int32_t* first) {
  if (threadIdx.x == 0) {
    int32_t acc = 0;
    for (int b = 0; b < P; ++b) first[b] = acc, acc += counts[b * stride];
    first[P] = acc;
  }
  __syncthreads();
}

// This warp's first dense row index and the stride of the grid's warps over them.
__device__ __forceinline__ int64_t EpFirstWarp() {
  return int64_t{blockIdx.x} * kEpWarps + threadIdx.x / 32;
}
__device__ __forceinline__ int64_t EpGridWarps() { return int64_t{gridDim.x} * kEpWarps; }

// A warp copies one row of `chunks` 16-byte chunks. src is never written while the kernel runs
// (a buffer of XLA's, or the receive region, which its peers wrote before this kernel began).
__device__ __forceinline__ void EpCopyRow(const uint4* src, uint4* dst, int chunks) {
  for (int c = threadIdx.x % 32; c < chunks; c += 32) StoreGlobal128(dst + c, __ldg(src + c));
}

// The end of a kernel, run by every CTA: publishes this CTA's stores and tells whether it is
// the last CTA to finish (then every sibling's loads and stores are ordered before what it does
// next, and it resets the count for the next call).
__device__ __forceinline__ bool EpLastToFinish(int32_t* done) {
  __shared__ int last;
  __threadfence_system();  // this thread's peer stores before the count, at system scope
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence_system();  // the siblings' stores, seen through the count, before the flags
  if (threadIdx.x == 0) *done = 0;
  return true;
}

// The last CTA of a call's send kernel: round = epoch + 1 to every rank's flag of this rank
// (peers' stores of this CTA and its siblings, done before, are released with it), the epoch
// stored back, then the wait for every rank's flag of this stage here.
__device__ __forceinline__ void EpSignalAndWait(const EpTransportArgs& a, int stage) {
  EpSync* sync = EpOwnSync(a);
  int32_t* epoch = &sync->epoch[EpCallOf(stage)];
  const int32_t round = static_cast<int32_t>(static_cast<uint32_t>(*epoch) + 1u);
  __syncthreads();  // every thread has read the epoch before thread 0 stores the new one
  EpSignalAll(a, stage, round);
  if (threadIdx.x == 0) *epoch = round;
  EpWaitAll(a, stage, round);
}

// One CTA: waits until every peer has read what this rank wrote into it the call before
// (`stage` kEpDispatchRead or kEpCombineRead, whose flags reach this rank's current epoch of
// the call then). The first call waits for round 0, which every zeroed flag has reached.
__global__ void __launch_bounds__(kEpThreads) EpAwaitKernel(const EpTransportArgs a, int stage) {
  EpWaitAll(a, stage, EpOwnSync(a)->epoch[EpCallOf(stage)]);
}

// One CTA a destination d (grid P): the routes to rank d in ascending (t, j), the first C of
// them in block d (mok_jax.expert_parallel.plan); pos[t k + j] = t k + j for a route that has a
// slot, else -1 (the home sum's rows are the slots themselves). Routes past C get no slot:
// need[d] > C tells the caller. Integer scans only: the same layout on every run.
__global__ void __launch_bounds__(kEpThreads) EpPlanKernel(const EpTransportArgs a) {
  __shared__ int32_t warp_total[kEpWarps];
  __shared__ int32_t hist[kEpMaxLocalExperts];
  const int d = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t routes = a.T * a.k, C = a.C;
  const int64_t E = int64_t{a.E_local} * a.ranks;
  for (int e = threadIdx.x; e < a.E_local; e += kEpThreads) hist[e] = 0;
  int64_t base = 0;
  for (int64_t chunk = 0; chunk < routes; chunk += kEpThreads) {
    const int64_t r = chunk + threadIdx.x;
    const int32_t id = r < routes ? a.experts[r] : -1;
    const bool valid = r < routes && id >= 0 && id < E;  // compared before any division
    const bool mine = valid && id / a.E_local == d;
    if (d == 0 && r < routes && !valid) a.slot[r] = -1, a.pos[r] = -1;
    const uint32_t ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_total[warp] = __popc(ballot);
    __syncthreads();
    int32_t before = 0, total = 0;
    for (int w = 0; w < kEpWarps; ++w) {
      before += w < warp ? warp_total[w] : 0;
      total += warp_total[w];
    }
    if (mine) {
      const int64_t at = base + before + __popc(ballot & ((1u << lane) - 1u));
      const bool fits = at < C;
      a.slot[r] = fits ? static_cast<int32_t>(d * C + at) : -1;
      a.pos[r] = fits ? static_cast<int32_t>(r) : -1;
      if (fits) {
        a.route[d * C + at] = static_cast<int32_t>(r);
        atomicAdd(&hist[id % a.E_local], 1);  // an integer count: its order cannot matter
      }
    }
    base += total;
    __syncthreads();  // warp_total is rewritten by the next chunk
  }
  const int64_t sent = base < C ? base : C;
  for (int64_t i = sent + threadIdx.x; i < C; i += kEpThreads) a.route[d * C + i] = -1;
  if (threadIdx.x == 0) a.sent[d] = static_cast<int32_t>(sent), a.need[d] = static_cast<int32_t>(base);
  for (int e = threadIdx.x; e < a.E_local; e += kEpThreads)
    a.counts_to[int64_t{d} * a.E_local + e] = hist[e];
}

// Rank s pushes row i of each block d into rank d's receive row s C + i, with its route, local
// expert and weight, a warp a row; then (last CTA) its counts into every rank, the flags, the
// wait.
__global__ void __launch_bounds__(kEpThreads) EpDispatchKernel(const EpTransportArgs a) {
  __shared__ int32_t first[kEpMaxRanks + 1];  // exclusive scan of sent over destinations
  const int P = a.ranks, s = a.rank;
  EpScanBlocks(a.sent, 1, P, first);
  const int chunks = static_cast<int>(a.H / 8);  // bf16: 8 values a chunk
  for (int64_t q = EpFirstWarp(); q < first[P]; q += EpGridWarps()) {
    const int d = EpBlockOf(first, P, q);
    const int64_t i = q - first[d], row = int64_t{s} * a.C + i;
    const int32_t r = a.route[d * a.C + i];
    void* peer = a.peers[d];
    EpCopyRow(static_cast<const uint4*>(a.x) + int64_t{r / a.k} * chunks,
              EpRegion<uint4>(peer, a.layout.recv_rows) + row * chunks, chunks);
    if (threadIdx.x % 32 == 0) {
      EpRegion<int32_t>(peer, a.layout.recv_route)[row] = r;
      EpRegion<int32_t>(peer, a.layout.recv_expert)[row] = a.experts[r] % a.E_local;
      EpRegion<float>(peer, a.layout.recv_weight)[row] = a.weights ? a.weights[r] : 1.0f;
    }
  }
  if (!EpLastToFinish(&EpOwnSync(a)->done[kEpDispatch])) return;
  const int per = 1 + a.E_local;
  for (int64_t q = threadIdx.x; q < int64_t{P} * per; q += kEpThreads) {
    const int d = static_cast<int>(q / per), e = static_cast<int>(q % per);
    EpRegion<int32_t>(a.peers[d], a.layout.counts)[int64_t{s} * per + e] =
        e == 0 ? a.sent[d] : a.counts_to[int64_t{d} * a.E_local + e - 1];
  }
  __threadfence_system();
  __syncthreads();  // every thread's counts before any thread's release of the flags
  EpSignalAndWait(a, kEpDispatch);
}

// The receive region, complete after the dispatch kernel's wait, into the caller's buffers:
// the rows a warp a row (only those that arrived), routes, experts and weights of every slot
// (-1, -1 and 0 past each block's count), the counts; then (last CTA) flags[q][dispatch_read]
// [this rank] = round for every source q, which may then write its block here again.
__global__ void __launch_bounds__(kEpThreads) EpReceiveKernel(const EpTransportArgs a) {
  void* own = a.peers[a.rank];
  const int P = a.ranks, per = 1 + a.E_local;
  const int32_t* counts = EpRegion<int32_t>(own, a.layout.counts);
  __shared__ int32_t first[kEpMaxRanks + 1];
  EpScanBlocks(counts, per, P, first);
  const int chunks = static_cast<int>(a.H / 8);
  for (int64_t q = EpFirstWarp(); q < first[P]; q += EpGridWarps()) {
    const int source = EpBlockOf(first, P, q);
    const int64_t row = int64_t{source} * a.C + (q - first[source]);
    EpCopyRow(EpRegion<const uint4>(own, a.layout.recv_rows) + row * chunks,
              static_cast<uint4*>(a.x_recv) + row * chunks, chunks);
  }
  const int32_t* route = EpRegion<int32_t>(own, a.layout.recv_route);
  const int32_t* expert = EpRegion<int32_t>(own, a.layout.recv_expert);
  const float* weight = EpRegion<float>(own, a.layout.recv_weight);
  const int64_t stride = int64_t{gridDim.x} * kEpThreads;
  for (int64_t i = int64_t{blockIdx.x} * kEpThreads + threadIdx.x; i < P * a.C; i += stride) {
    const int source = static_cast<int>(i / a.C);
    const bool arrived = i - source * a.C < first[source + 1] - first[source];
    a.route_recv[i] = arrived ? route[i] : -1;
    a.expert_recv[i] = arrived ? expert[i] : -1;
    a.weight_recv[i] = arrived ? weight[i] : 0.0f;
  }
  for (int64_t i = int64_t{blockIdx.x} * kEpThreads + threadIdx.x; i < int64_t{P} * per;
       i += stride)
    a.counts_recv[i] = counts[i];
  EpSync* sync = EpOwnSync(a);
  if (!EpLastToFinish(&sync->done[kEpDispatchRead])) return;
  EpSignalAll(a, kEpDispatchRead, sync->epoch[EpCallOf(kEpDispatch)]);
}

// The owner returns the output of each received row (and its row weight) to its home rank's
// slot t k + j, a warp a row; then (last CTA) the flags and the wait for every owner's rows
// here.
__global__ void __launch_bounds__(kEpThreads) EpCombineSendKernel(const EpTransportArgs a) {
  const int chunks = static_cast<int>(a.H / 8);
  const int64_t routes = a.T * a.k;
  __shared__ int32_t first[kEpMaxRanks + 1];
  EpScanBlocks(a.counts_recv, 1 + a.E_local, a.ranks, first);
  for (int64_t q = EpFirstWarp(); q < first[a.ranks]; q += EpGridWarps()) {
    const int source = EpBlockOf(first, a.ranks, q);
    const int64_t row = int64_t{source} * a.C + (q - first[source]);
    const int32_t r = a.route_recv[row];
    if (r < 0 || r >= routes) continue;  // written by the dispatch, so never; never an address
    void* home = a.peers[source];
    EpCopyRow(static_cast<const uint4*>(a.rows) + row * chunks,
              EpRegion<uint4>(home, a.layout.combine_slots) + int64_t{r} * chunks, chunks);
    if (a.row_weights && threadIdx.x % 32 == 0)
      EpRegion<float>(home, a.layout.combine_weight)[r] = a.row_weights[row];
  }
  if (!EpLastToFinish(&EpOwnSync(a)->done[kEpCombine])) return;
  EpSignalAndWait(a, kEpCombine);
}

// After the home sum: out_weights[t k + j] = the row weight in slot t k + j (0 without a slot),
// then (last CTA) flags[q][combine_read][this rank] = round for every owner q, which may then
// write the slots again.
__global__ void __launch_bounds__(kEpThreads) EpCombineEndKernel(const EpTransportArgs a) {
  const float* slot_weight = EpRegion<float>(a.peers[a.rank], a.layout.combine_weight);
  const int64_t stride = int64_t{gridDim.x} * kEpThreads;
  for (int64_t r = int64_t{blockIdx.x} * kEpThreads + threadIdx.x;
       a.out_weights && r < a.T * a.k; r += stride)
    a.out_weights[r] = a.pos[r] >= 0 ? slot_weight[r] : 0.0f;
  EpSync* sync = EpOwnSync(a);
  if (!EpLastToFinish(&sync->done[kEpCombineRead])) return;
  EpSignalAll(a, kEpCombineRead, sync->epoch[EpCallOf(kEpCombine)]);
}

// The self-test's stand-in for the owner's experts: each received row times its local expert's
// scale, rounded to bf16 (f32 product, round to nearest even: what NumPy computes), and its
// weight times the same scale.
__global__ void __launch_bounds__(kEpThreads) EpScaleRowsKernel(const EpTransportArgs a,
                                                                const float* scales,
                                                                __nv_bfloat16* out,
                                                                float* row_weights) {
  const auto* recv = static_cast<const __nv_bfloat162*>(a.x_recv);
  const int64_t pairs = a.H / 2;
  __shared__ int32_t first[kEpMaxRanks + 1];
  EpScanBlocks(a.counts_recv, 1 + a.E_local, a.ranks, first);
  for (int64_t q = EpFirstWarp(); q < first[a.ranks]; q += EpGridWarps()) {
    const int source = EpBlockOf(first, a.ranks, q);
    const int64_t row = int64_t{source} * a.C + (q - first[source]);
    const float w = scales[a.expert_recv[row]];
    if (threadIdx.x % 32 == 0) row_weights[row] = a.weight_recv[row] * w;
    auto* dst = reinterpret_cast<__nv_bfloat162*>(out) + row * pairs;
    for (int64_t c = threadIdx.x % 32; c < pairs; c += 32) {
      const float2 v = __bfloat1622float2(recv[row * pairs + c]);
      dst[c] = __floats2bfloat162_rn(v.x * w, v.y * w);
    }
  }
}

}  // namespace mok::sm90
