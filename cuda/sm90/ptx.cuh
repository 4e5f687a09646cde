// Thin wrappers over the Hopper PTX the kernels use: mbarriers, named barriers, TMA, register
// reallocation. Every mbarrier wait is bounded: a pipeline bug traps the kernel (an error the
// handler reports) instead of hanging the GPU.
#pragma once

#include <cstdint>

#include <cuda.h>

namespace mok::sm90 {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void BarrierInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count));
}

// Makes barrier initialisation visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void BarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar)) : "memory");
}

__device__ __forceinline__ void BarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// One test of whether the phase of `bar` with parity `parity` has completed.
__device__ __forceinline__ bool BarrierTryWait(uint32_t addr, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(addr), "r"(parity)
      : "memory");
  return done != 0;
}

// BarrierTryWait with acquire at cluster scope: for a phase that another CTA of the cluster
// completed after writing this CTA's shared memory (st.shared::cluster).
__device__ __forceinline__ bool BarrierTryWaitCluster(uint32_t addr, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n"
      " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(addr), "r"(parity)
      : "memory");
  return done != 0;
}

// A legitimate wait lasts microseconds (milliseconds under compute-sanitizer); one of
// four seconds is a pipeline bug, and trapping turns a hung GPU into an error that XLA reports.
constexpr uint64_t kWaitBoundNs = 4'000'000'000ull;

// Waits until the phase of `bar` with parity `parity` has completed; traps after kWaitBoundNs.
__device__ __forceinline__ void BarrierWait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = SmemAddr(bar);
  uint64_t start = 0;
  for (uint32_t spins = 1;; ++spins) {
    if (BarrierTryWait(addr, parity)) return;
    if (spins % 1024 == 0) {
      const uint64_t now = GlobalTimerNs();
      if (start == 0) start = now;
      else if (now - start > kWaitBoundNs) __trap();
    }
  }
}

// BarrierWait with BarrierTryWaitCluster, unbounded: the wait for the unit that the peer CTA
// took from the queue, which it hands over before any wait that can trap.
__device__ __forceinline__ void BarrierWaitCluster(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = SmemAddr(bar);
  while (!BarrierTryWaitCluster(addr, parity)) {
  }
}

// BarrierWait without the bound, for the consumers' wait on the tile ring: the bound's timer
// and trap, inlined in the persistent tile loop, make ptxas spill there. Sound because the
// producer publishes every tile before any wait that can trap.
__device__ __forceinline__ void BarrierWaitLean(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = SmemAddr(bar);
  while (!BarrierTryWait(addr, parity)) {
  }
}

// Global flags between CTAs: a release add by the CTA that finished some rows, an acquire load
// by the CTA that reads them.
__device__ __forceinline__ int32_t LoadAcquire(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void AddRelease(int32_t* p, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Orders this thread's generic-proxy global accesses with its async-proxy (TMA) ones: rows
// written with st.global and read by another CTA's TMA need one on each side.
__device__ __forceinline__ void FenceProxyAsyncGlobal() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Waits until *flag >= target; bounded like BarrierWait.
__device__ __forceinline__ void WaitAtLeast(const int32_t* flag, int32_t target) {
  if (LoadAcquire(flag) >= target) return;
  const uint64_t start = GlobalTimerNs();
  while (LoadAcquire(flag) < target) {
    __nanosleep(128);
    if (GlobalTimerNs() - start > kWaitBoundNs) __trap();
  }
}

// 2^x, subnormal inputs and results flushed to zero.
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Shared-memory accesses by 32-bit shared address. The GEMM's shared memory is reached through
// a pointer realigned by integer arithmetic, which loses its address space: plain C++ accesses
// through it compile to generic LD/ST.
__device__ __forceinline__ void StoreShared32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void StoreShared16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}

__device__ __forceinline__ uint32_t LoadShared32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void StoreShared128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// stmatrix: four 8 x 8 bf16 matrices from the warp, matrix i's rows at the addresses of lanes
// 8 i to 8 i + 7; this lane's row of each (two values) in r0..r3, as an m64nNk16 wgmma
// accumulator (rounded and packed in pairs) holds them.
__device__ __forceinline__ void StoreMatrixX4(uint32_t addr, uint32_t r0, uint32_t r1,
                                              uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ uint4 LoadShared128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// TMA store of one box from shared memory to (c0 = inner element index, c1 = row) of the
// tensor `map`, in the thread's current bulk group; rows and columns past the tensor's extent
// are not written.
__device__ __forceinline__ void TmaStore2d(const CUtensorMap* map, uint32_t src, int32_t c0,
                                           int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void BulkCommitGroup() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most kPending of the thread's bulk groups have not yet finished reading
// shared memory.
template <int kPending>
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Waits until all of the thread's bulk groups have completed.
__device__ __forceinline__ void BulkWaitAll() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Orders this thread's shared-memory writes before later async-proxy reads of them (a TMA
// store).
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// A 16-byte store to global memory (a generic pointer into it), without generic addressing.
__device__ __forceinline__ void StoreGlobal128(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(__cvta_generic_to_global(p)),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// A barrier of the whole CTA that its warps may reach at different instructions (the
// non-aligned barrier.sync; __syncthreads is the aligned form, which they may not).
__device__ __forceinline__ void CtaSync() { asm volatile("barrier.sync 0;" ::: "memory"); }

// bar.sync on a named barrier among `threads` threads (a multiple of 32).
__device__ __forceinline__ void NamedBarrierSync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// 2-D TMA load of one box at (c0 = inner element index, c1 = row) into shared memory,
// completing on `bar` with the box's bytes.
__device__ __forceinline__ void TmaLoad2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                          int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// TmaLoad2d through a 3D map (MakePanelMap: column in panel, row, panel).
__device__ __forceinline__ void TmaLoad3d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                          int32_t c0, int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// TmaLoad2d / TmaLoad3d into the same shared-memory offset of every CTA of the cluster in
// `ctas` (a bit mask of ranks), each completing on the barrier at `bar`'s offset in its own.
__device__ __forceinline__ void TmaLoad2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                          int32_t c0, int32_t c1, uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "h"(ctas)
      : "memory");
}

__device__ __forceinline__ void TmaLoad3d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                          int32_t c0, int32_t c1, int32_t c2, uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "r"(c2),
      "h"(ctas)
      : "memory");
}

// Clusters of CTAs (the paired row-grouped GEMMs): this CTA's rank; a barrier of every thread
// of every CTA of the cluster; the address in CTA `rank` of this CTA's shared address `addr`.
__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\n"
               "barrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ uint32_t MapShared(uint32_t addr, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}

// Arrives on `bar` of CTA `rank` (this one included) with no ordering beyond this CTA: a
// consumer's release of a stage, whose reads (wgmma, already waited for) are all that the
// peer's TMA must follow.
//
// The .release.cluster form would compile to MEMBAR.ALL.GPU, which waits for the thread's
// outstanding global stores: in every k-step, that makes the clusters 1.5x slower (H200).
__device__ __forceinline__ void BarrierArriveRemote(uint64_t* bar, uint32_t rank) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(
                   MapShared(SmemAddr(bar), rank))
               : "memory");
}

// Arrives on `bar` of CTA `rank`, ordering this thread's earlier shared-memory accesses (to
// either CTA) before it: once a tile, for the unit hand-over.
__device__ __forceinline__ void BarrierArriveRelease(uint64_t* bar, uint32_t rank) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(
                   MapShared(SmemAddr(bar), rank))
               : "memory");
}

__device__ __forceinline__ void StoreSharedCluster32(void* p, uint32_t rank, int32_t v) {
  asm volatile("st.shared::cluster.s32 [%0], %1;" ::"r"(MapShared(SmemAddr(p), rank)), "r"(v)
               : "memory");
}

__device__ __forceinline__ void PrefetchTmaDescriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// v, unknown to the compiler from here on: what is computed from it is computed after this
// point, not hoisted out of the loop around it (where it would hold registers across the k-loops).
__device__ __forceinline__ int Opaque(int v) {
  asm volatile("" : "+r"(v));
  return v;
}

template <uint32_t kRegs>
__device__ __forceinline__ void SetMaxRegistersDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <uint32_t kRegs>
__device__ __forceinline__ void SetMaxRegistersInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

}  // namespace mok::sm90
