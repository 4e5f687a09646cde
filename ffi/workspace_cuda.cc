// The workspace registry of workspace_cuda.h.
#include "workspace_cuda.h"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace mok::cuda {
namespace {

// Segments of ranks that share a GPU start this far apart (a multiple of any alignment a
// region asks for).
constexpr int64_t kSegmentAlign = int64_t{1} << 16;

struct Entry {
  WorkspaceInfo info;
  std::vector<std::pair<int, void*>> allocations;  // (device, pointer), for cudaFree
};

std::mutex& RegistryMutex() {
  static std::mutex mutex;
  return mutex;
}

// Never destroyed: a static destructor would call CUDA while the runtime shuts down. Python
// frees every workspace at exit (mok_jax/workspace.py).
std::map<int64_t, Entry>& Registry() {
  static auto* registry = new std::map<int64_t, Entry>();
  return *registry;
}

int64_t next_handle = 1;

// Restores the calling thread's current device (XLA's threads keep their own).
class CurrentDevice {
 public:
  CurrentDevice() { cudaGetDevice(&previous_); }
  ~CurrentDevice() { cudaSetDevice(previous_); }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = 0;
};

void FreeAllocations(const std::vector<std::pair<int, void*>>& allocations) {
  for (const auto& [device, pointer] : allocations) {
    cudaSetDevice(device);
    cudaFree(pointer);
  }
  cudaGetLastError();  // a failure while freeing leaves nothing to report to the caller
}

std::string CudaText(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// A cudaMalloc on the current device `device`, with the message of an out-of-memory failure.
WorkspaceStatus Allocate(int device, int64_t bytes, void** pointer, std::string* message) {
  const cudaError_t err = cudaMalloc(pointer, static_cast<size_t>(bytes));
  if (err == cudaSuccess) return WorkspaceStatus::kOk;
  cudaGetLastError();  // an allocation failure is not sticky: clear it
  if (err != cudaErrorMemoryAllocation) {
    *message = "cudaMalloc of " + std::to_string(bytes) + " bytes on GPU " +
               std::to_string(device) + " failed (" + CudaText(err) + ")";
    return WorkspaceStatus::kCudaError;
  }
  size_t free = 0, total = 0;
  cudaMemGetInfo(&free, &total);
  cudaGetLastError();
  *message = "cudaMalloc of " + std::to_string(bytes) + " bytes on GPU " +
             std::to_string(device) + " failed: out of memory (" + std::to_string(free) +
             " of " + std::to_string(total) + " bytes free)";
  return WorkspaceStatus::kOutOfMemory;
}

WorkspaceStatus EnablePeers(const std::vector<int>& devices, std::string* message) {
  for (int a : devices) {
    for (int b : devices) {
      if (a == b) continue;
      int can = 0;
      cudaError_t err = cudaDeviceCanAccessPeer(&can, a, b);
      if (err != cudaSuccess) {
        *message = "cudaDeviceCanAccessPeer(" + std::to_string(a) + ", " + std::to_string(b) +
                   ") failed (" + CudaText(err) + ")";
        return WorkspaceStatus::kCudaError;
      }
      if (!can) {
        *message = "GPU " + std::to_string(a) + " cannot access the memory of GPU " +
                   std::to_string(b) + " (cudaDeviceCanAccessPeer = 0): the ranks of a "
                   "workspace need peer-to-peer access (NVLink or PCIe P2P) between every pair";
        return WorkspaceStatus::kNoPeerAccess;
      }
      if ((err = cudaSetDevice(a)) == cudaSuccess) err = cudaDeviceEnablePeerAccess(b, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // XLA, or an earlier workspace, enabled it already
      } else if (err != cudaSuccess) {
        *message = "cudaDeviceEnablePeerAccess from GPU " + std::to_string(a) + " to GPU " +
                   std::to_string(b) + " failed (" + CudaText(err) + ")";
        return WorkspaceStatus::kCudaError;
      }
    }
  }
  return WorkspaceStatus::kOk;
}

// Segments, zeroed, and each rank's device table of segment bases.
WorkspaceStatus Build(const std::vector<int>& devices, int64_t bytes, Entry* entry,
                      std::string* message) {
  const size_t P = devices.size();
  const bool shared = devices.front() == devices.back();  // all one GPU (checked by the caller)
  WorkspaceInfo& info = entry->info;
  info.bytes = bytes;
  info.stride = shared ? (bytes + kSegmentAlign - 1) / kSegmentAlign * kSegmentAlign : 0;
  info.ranks.assign(P, WorkspaceRank{});
  for (size_t s = 0; s < P; ++s) info.ranks[s].device = devices[s];
  if (!shared) {
    if (const auto status = EnablePeers(devices, message); status != WorkspaceStatus::kOk)
      return status;
  }
  auto fail = [&](cudaError_t err, const std::string& what) {
    *message = what + " failed (" + CudaText(err) + ")";
    return WorkspaceStatus::kCudaError;
  };
  for (size_t s = 0; s < P; ++s) {
    if (shared && s > 0) {
      info.ranks[s].base = static_cast<char*>(info.ranks[0].base) + s * info.stride;
      continue;
    }
    const int64_t size = shared ? info.stride * static_cast<int64_t>(P) : bytes;
    if (const cudaError_t err = cudaSetDevice(devices[s]); err != cudaSuccess)
      return fail(err, "cudaSetDevice(" + std::to_string(devices[s]) + ")");
    void* pointer = nullptr;
    if (const auto status = Allocate(devices[s], size, &pointer, message);
        status != WorkspaceStatus::kOk)
      return status;
    entry->allocations.emplace_back(devices[s], pointer);
    if (const cudaError_t err = cudaMemset(pointer, 0, static_cast<size_t>(size));
        err != cudaSuccess)
      return fail(err, "cudaMemset of the workspace");
    info.ranks[s].base = pointer;
  }
  std::vector<void*> bases(P);
  for (size_t s = 0; s < P; ++s) bases[s] = info.ranks[s].base;
  for (size_t s = 0; s < P; ++s) {
    cudaSetDevice(devices[s]);
    void* table = nullptr;
    if (const auto status = Allocate(devices[s], static_cast<int64_t>(P * sizeof(void*)), &table,
                                     message);
        status != WorkspaceStatus::kOk)
      return status;
    entry->allocations.emplace_back(devices[s], table);
    if (const cudaError_t err =
            cudaMemcpy(table, bases.data(), P * sizeof(void*), cudaMemcpyHostToDevice);
        err != cudaSuccess)
      return fail(err, "cudaMemcpy of the peers table");
    info.ranks[s].peers = static_cast<void**>(table);
  }
  // The zeroing runs on the legacy stream, which XLA's streams do not wait for: finish it here.
  for (int device : std::set<int>(devices.begin(), devices.end())) {
    cudaSetDevice(device);
    if (const cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess)
      return fail(err, "cudaDeviceSynchronize after zeroing the workspace");
  }
  return WorkspaceStatus::kOk;
}

}  // namespace

WorkspaceStatus WorkspaceCreate(const std::vector<int>& devices, int64_t bytes, int64_t* handle,
                                std::string* message) {
  *handle = 0;
  if (devices.empty()) {
    *message = "a workspace needs at least one rank";
    return WorkspaceStatus::kBadArgument;
  }
  if (bytes < 1) {
    *message = "a workspace needs at least one byte a rank, got " + std::to_string(bytes);
    return WorkspaceStatus::kBadArgument;
  }
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    cudaGetLastError();
    *message = "cudaGetDeviceCount failed (" + CudaText(err) + ")";
    return WorkspaceStatus::kCudaError;
  }
  const std::set<int> distinct(devices.begin(), devices.end());
  for (int d : devices) {
    if (d < 0 || d >= count) {
      *message = "GPU " + std::to_string(d) + " does not exist (" + std::to_string(count) +
                 " CUDA GPU(s) visible)";
      return WorkspaceStatus::kBadArgument;
    }
  }
  if (distinct.size() != 1 && distinct.size() != devices.size()) {
    *message = "the ranks must be on distinct GPUs (one a GPU) or all on one GPU (segments of "
               "one allocation)";
    return WorkspaceStatus::kBadArgument;
  }
  CurrentDevice keep;
  Entry entry;
  const WorkspaceStatus status = Build(devices, bytes, &entry, message);
  if (status != WorkspaceStatus::kOk) {
    FreeAllocations(entry.allocations);
    return status;
  }
  std::lock_guard<std::mutex> lock(RegistryMutex());
  *handle = next_handle++;
  Registry().emplace(*handle, std::move(entry));
  return WorkspaceStatus::kOk;
}

bool WorkspaceFree(int64_t handle) {
  Entry entry;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto it = Registry().find(handle);
    if (it == Registry().end()) return false;
    entry = std::move(it->second);
    Registry().erase(it);
  }
  CurrentDevice keep;
  FreeAllocations(entry.allocations);
  return true;
}

bool WorkspaceLookup(int64_t handle, WorkspaceInfo* info) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(handle);
  if (it == Registry().end()) return false;
  *info = it->second.info;
  return true;
}

}  // namespace mok::cuda
