// Filling an int array with all threads of a grid, inside a kernel that runs anyway: the layout
// kernels and the gathers clear what later launches count in and mark unused rows, so that a
// forward or backward calls no cudaMemsetAsync (layout.cuh says why).
#pragma once

#include <cstdint>

namespace mok::sm90 {

// p[0, n) = value; no-op for n <= 0.
__device__ __forceinline__ void GridFill(int32_t* p, int64_t n, int32_t value) {
  const int64_t threads = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += threads)
    p[i] = value;
}

}  // namespace mok::sm90
