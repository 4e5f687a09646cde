// What the standalone probes of tools/ab (write_probe.cu, l2_side_probe.cu, l2_side_stream.cu)
// share: a CUDA call's check, a median, the SM a thread runs on, a timed dependent load, and a
// read of a buffer larger than L2 so that lines read before miss again.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CHECK(x)                                                   \
  do {                                                             \
    cudaError_t e = (x);                                           \
    if (e != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

namespace probe {

inline float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

__device__ __forceinline__ int SmId() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return static_cast<int>(id);
}

// The clocks a load of *p takes (ld.global.cg, so through L2 only; saturated at 65535). Its
// value goes to `carry`, which the caller adds to the next address, so that each load waits for
// the one before (the probes' buffers hold zeros); the store of it to `sink` (shared memory)
// waits for the line, and the warp issues in order, so the second clock is read after it came.
__device__ __forceinline__ uint16_t TimedLoad(const uint64_t* p, uint64_t& carry,
                                              volatile uint64_t* sink) {
  const int64_t t0 = clock64();
  uint64_t v;
  asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  *sink = v;
  const int64_t d = clock64() - t0;
  carry = v;
  return static_cast<uint16_t>(d > 65535 ? 65535 : d);
}

// Reads buf[0, n) once (L2-allocating loads); `sink` keeps the loads from being dropped.
__global__ void FlushKernel(const uint4* buf, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcg(buf + i);
    acc ^= v.x ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

// 256 MB to read between two passes over lines that must miss L2 again (H200: 50 MB of L2).
struct L2Flush {
  static constexpr int64_t kBytes = int64_t{256} << 20;
  uint4* buf = nullptr;
  uint32_t* sink = nullptr;
  L2Flush() {
    CHECK(cudaMalloc(&buf, kBytes));
    CHECK(cudaMemset(buf, 1, kBytes));
    CHECK(cudaMalloc(&sink, 4));
  }
  void Run(int sms) const { FlushKernel<<<sms * 8, 256>>>(buf, kBytes / 16, sink); }
};

}  // namespace probe
