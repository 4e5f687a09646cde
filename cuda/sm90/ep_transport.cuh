// The NVLink transport of expert parallelism: the routed-row layout of
// mok_jax.expert_parallel moved by the kernels themselves over a symmetric workspace
// (mok_jax/workspace.py), with unicast 16-byte stores and flags. docs/expert_parallel.md has the
// protocol; ../ep_transport.h the launch order and how a timeout reaches the user.
//
// Per round, on rank s (P ranks, C slots a block, T tokens, k routes a token):
//   EpPlanKernel          block d of the send slots = s's routes to rank d in ascending (t, j)
//   EpDispatchKernel      row i of block d -> rank d's receive row s C + i (with its route and
//                         local expert); the CTA that finishes last writes s's counts into every
//                         rank d, then the release store flags[d][dispatch][s] = round, then
//                         waits until every rank's flag here has reached the round
//   EpCombineSendKernel   received row s C + i -> rank s's home slot route (t k + j); the last
//                         CTA releases flags[s][combine][this rank] = round and waits, as above
//   CombineKernel         (combine.cuh) the home sum of the k slots in j order, f32, on rows
//                         that are all here: the same code and bits as the collective transport
//
// The round of each stage is the rank's epoch counter in its sync region plus one, read,
// signalled and stored back by the last CTA of that stage's send kernel: nothing comes from the
// host, so a CUDA graph replays correct rounds and back-to-back calls never mix them. Flags are
// compared by wrapping difference, so the counter may wrap.
//
// NOTES: only the last CTA of a send kernel waits, after its siblings have finished: a waiting
// CTA never keeps its own kernel's work off the SMs, and one resident CTA per rank is all the
// waits need. Peer memory is only written (push): plain 16-byte unicast stores of rows, 32-bit
// stores of routes and counts, st.release.sys of flags; every load is of this rank's own
// segment or buffers. System scope because the peers are other GPUs (or, in the loopback test,
// other streams of this one). No multimem (NVLink multicast) instruction anywhere.
#pragma once

#include <cstdint>
#include <cstdio>

#include <cuda_bf16.h>

#include "../ep_transport.h"
#include "ptx.cuh"

namespace mok::sm90 {

using cuda::EpLayout;
using cuda::EpStage;
using cuda::EpSync;
using cuda::EpTransportArgs;
using cuda::kEpCombine;
using cuda::kEpDispatch;
using cuda::kEpMaxLocalExperts;
using cuda::kEpMaxRanks;
using cuda::kEpStages;
using cuda::kEpThreads;

constexpr int kEpWarps = kEpThreads / 32;

template <class T>
__device__ __forceinline__ T* EpRegion(void* base, int64_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
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
  return stage == kEpDispatch ? "dispatch" : "combine";
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

// Waits until *flag has reached `round`; bounded by bound_ns of the global timer.
__device__ __forceinline__ void EpWaitRound(const int32_t* flag, int32_t round, int rank,
                                            int stage, int peer, uint64_t bound_ns,
                                            int32_t* reported) {
  int32_t seen = LoadAcquireSys(flag);
  if (EpReached(seen, round)) return;
  const uint64_t start = GlobalTimerNs();
  for (;;) {
    __nanosleep(64);
    seen = LoadAcquireSys(flag);
    if (EpReached(seen, round)) return;
    if (GlobalTimerNs() - start > bound_ns) EpTimeout(rank, stage, peer, seen, round, bound_ns,
                                                      reported);
  }
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

// The rows a rank received: counts[s][0] from each source s (written by dispatch before its
// flag), as a scan over sources. A dense index q < first[P] is receive row s C + (q - first[s]).
__device__ __forceinline__ void EpScanReceived(const EpTransportArgs& a, int32_t* first) {
  EpScanBlocks(EpRegion<int32_t>(a.peers[a.rank], a.layout.counts), 1 + a.E_local, a.ranks,
               first);
}

// This warp's first dense row index and the stride of the grid's warps over them.
__device__ __forceinline__ int64_t EpFirstWarp() {
  return int64_t{blockIdx.x} * kEpWarps + threadIdx.x / 32;
}
__device__ __forceinline__ int64_t EpGridWarps() { return int64_t{gridDim.x} * kEpWarps; }

// A warp copies one row of `chunks` 16-byte chunks.
__device__ __forceinline__ void EpCopyRow(const uint4* __restrict__ src, uint4* dst, int chunks) {
  for (int c = threadIdx.x % 32; c < chunks; c += 32) StoreGlobal128(dst + c, __ldg(src + c));
}

// The end of a send kernel, run by every CTA: publishes this CTA's stores and tells whether it
// is the last CTA to finish (then every sibling's stores are ordered before what it does next).
__device__ __forceinline__ bool EpLastToFinish(int32_t* done) {
  __shared__ int last;
  __threadfence_system();  // this thread's peer stores before the count, at system scope
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence_system();  // the siblings' stores, seen through the count, before the flags
  return true;
}

// The last CTA of stage `stage`'s send kernel: round = epoch + 1 to every rank's flag of this
// rank (peers' stores of this CTA, done before, are released with it), the epoch stored back,
// then the wait for every rank's flag of this stage here.
__device__ __forceinline__ void EpSignalAndWait(const EpTransportArgs& a, int stage) {
  const int P = a.ranks;
  EpSync* sync = EpRegion<EpSync>(a.peers[a.rank], a.layout.sync);
  const int32_t round = static_cast<int32_t>(static_cast<uint32_t>(sync->epoch[stage]) + 1u);
  __syncthreads();  // every thread has read the epoch before thread 0 stores the new one
  for (int d = threadIdx.x; d < P; d += kEpThreads) {
    int32_t* flags = EpRegion<int32_t>(a.peers[d], a.layout.flags);
    StoreReleaseSys(flags + int64_t{stage} * P + a.rank, round);
  }
  if (threadIdx.x == 0) sync->done[stage] = 0, sync->epoch[stage] = round;
  const int32_t* mine = EpRegion<int32_t>(a.peers[a.rank], a.layout.flags) + int64_t{stage} * P;
  for (int p = threadIdx.x; p < P; p += kEpThreads)
    EpWaitRound(mine + p, round, a.rank, stage, p, a.wait_bound_ns, &sync->reported);
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

// Rank s pushes row i of each block d into rank d's receive row s C + i, with its route and its
// local expert, a warp a row; then (last CTA) its counts into every rank, the flags, the wait.
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
    }
  }
  EpSync* sync = EpRegion<EpSync>(a.peers[s], a.layout.sync);
  if (!EpLastToFinish(&sync->done[kEpDispatch])) return;
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

// The owner returns the output of each received row to its home rank's slot t k + j, a warp a
// row; then (last CTA) the flags and the wait for every owner's rows here.
__global__ void __launch_bounds__(kEpThreads) EpCombineSendKernel(const EpTransportArgs a) {
  void* own = a.peers[a.rank];
  const int32_t* recv_route = EpRegion<int32_t>(own, a.layout.recv_route);
  const int chunks = static_cast<int>(a.H / 8);
  const int64_t routes = a.T * a.k;
  __shared__ int32_t first[kEpMaxRanks + 1];
  EpScanReceived(a, first);
  for (int64_t q = EpFirstWarp(); q < first[a.ranks]; q += EpGridWarps()) {
    const int source = EpBlockOf(first, a.ranks, q);
    const int64_t row = int64_t{source} * a.C + (q - first[source]);
    const int32_t r = recv_route[row];
    if (r < 0 || r >= routes) continue;  // written by dispatch, so never; never an address
    EpCopyRow(static_cast<const uint4*>(a.rows_out) + row * chunks,
              EpRegion<uint4>(a.peers[source], a.layout.combine_slots) + int64_t{r} * chunks,
              chunks);
  }
  EpSync* sync = EpRegion<EpSync>(own, a.layout.sync);
  if (!EpLastToFinish(&sync->done[kEpCombine])) return;
  EpSignalAndWait(a, kEpCombine);
}

// The self-test's stand-in for the owner's experts: each received row times its local expert's
// scale, rounded to bf16 (f32 product, round to nearest even: what NumPy computes).
__global__ void __launch_bounds__(kEpThreads) EpScaleRowsKernel(const EpTransportArgs a,
                                                                const float* scales,
                                                                __nv_bfloat16* out) {
  void* own = a.peers[a.rank];
  const auto* recv = EpRegion<const __nv_bfloat162>(own, a.layout.recv_rows);
  const int32_t* expert = EpRegion<int32_t>(own, a.layout.recv_expert);
  const int64_t pairs = a.H / 2;
  __shared__ int32_t first[kEpMaxRanks + 1];
  EpScanReceived(a, first);
  for (int64_t q = EpFirstWarp(); q < first[a.ranks]; q += EpGridWarps()) {
    const int source = EpBlockOf(first, a.ranks, q);
    const int64_t row = int64_t{source} * a.C + (q - first[source]);
    const float w = scales[expert[row]];
    auto* dst = reinterpret_cast<__nv_bfloat162*>(out) + row * pairs;
    for (int64_t c = threadIdx.x % 32; c < pairs; c += 32) {
      const float2 v = __bfloat1622float2(recv[row * pairs + c]);
      dst[c] = __floats2bfloat162_rn(v.x * w, v.y * w);
    }
  }
}

}  // namespace mok::sm90
