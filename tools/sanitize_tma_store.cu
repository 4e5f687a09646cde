// Does this compute-sanitizer's initcheck see the bytes that a TMA tensor store writes?
// tools/sanitize.sh runs it under initcheck before the kernels: one kernel writes a 64 x 64
// bf16 matrix, by a TMA store (the kernels' TmaStore2d, ptx.cuh) or by plain 16-byte stores
// (`plain`), and a second kernel reads it back with plain loads, as the combine reads the
// GEMMs' rows. A report on the TMA case and none on the plain one: the tool takes bytes that
// only a TMA store wrote for uninitialized.
//
// Build: nvcc -std=c++17 -arch=sm_90a -Icuda/sm90 tools/sanitize_tma_store.cu
//        cuda/sm90/tensor_map.cc -o sanitize_tma_store
// Usage: sanitize_tma_store tma|plain   (exit 0 if the matrix reads back as written)
#include <cstdio>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ptx.cuh"
#include "tensor_map.h"

namespace {

constexpr int kRows = 64, kCols = 64;  // one TMA box: 128-byte rows, the 128-byte swizzle span

__global__ void WriteByTma(const __grid_constant__ CUtensorMap map) {
  __shared__ __align__(1024) __nv_bfloat16 box[kRows * kCols];
  for (int i = threadIdx.x; i < kRows * kCols; i += blockDim.x) box[i] = __float2bfloat16(1.0f);
  mok::sm90::FenceProxyAsyncShared();
  __syncthreads();
  if (threadIdx.x == 0) {
    mok::sm90::TmaStore2d(&map, mok::sm90::SmemAddr(box), 0, 0);
    mok::sm90::BulkCommitGroup();
    mok::sm90::BulkWaitAll();
  }
}

__global__ void WritePlain(__nv_bfloat16* out) {
  uint4 v;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
  for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(1.0f, 1.0f);
  for (int c = threadIdx.x; c < kRows * kCols / 8; c += blockDim.x)
    mok::sm90::StoreGlobal128(out + c * 8, v);
}

__global__ void ReadBack(const __nv_bfloat16* in, float* sum) {
  float s = 0.0f;
  for (int c = threadIdx.x; c < kRows * kCols / 8; c += blockDim.x) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(in) + c);
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
    for (int i = 0; i < 4; ++i) s += __low2float(p[i]) + __high2float(p[i]);
  }
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x == 0) *sum = s;
}

}  // namespace

int main(int argc, char** argv) {
  const bool tma = argc > 1 && std::strcmp(argv[1], "tma") == 0;
  __nv_bfloat16* m = nullptr;
  float* sum = nullptr;
  if (cudaMalloc(&m, kRows * kCols * sizeof(__nv_bfloat16)) != cudaSuccess ||
      cudaMalloc(&sum, sizeof(float)) != cudaSuccess) {
    std::fprintf(stderr, "cudaMalloc failed\n");
    return 2;
  }
  if (tma) {
    CUtensorMap map;
    if (!mok::sm90::MakeTensorMap(&map, m, kCols, kRows, kCols, kRows)) {
      std::fprintf(stderr, "cuTensorMapEncodeTiled refused the map\n");
      return 2;
    }
    WriteByTma<<<1, 128>>>(map);
  } else {
    WritePlain<<<1, 128>>>(m);
  }
  ReadBack<<<1, 32>>>(m, sum);
  float got = 0.0f;
  if (cudaMemcpy(&got, sum, sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
    std::fprintf(stderr, "%s\n", cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  std::printf("%s stores: read back %.0f of %d\n", tma ? "TMA" : "plain", got, kRows * kCols);
  return got == kRows * kCols ? 0 : 1;
}
