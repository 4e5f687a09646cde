// Opting kernels into more than 48 KB of dynamic shared memory.
#pragma once

#include <mutex>
#include <set>
#include <utility>

#include <cuda_runtime_api.h>

namespace mok::sm90 {

// cudaFuncSetAttribute acts on the current device's context, so the limit is raised once per
// (kernel, device), not once per process: a process may drive several GPUs. Keyed by the
// kernel's address, which also tells apart the copies of a template kernel that each
// translation unit instantiating it gets.
inline cudaError_t AllowSharedMemory(const void* kernel, int bytes) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({kernel, device})) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) done.insert({kernel, device});
  return e;
}

}  // namespace mok::sm90
