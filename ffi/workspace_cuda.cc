// The workspace registry of workspace_cuda.h.
#include "workspace_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
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
  std::vector<std::pair<int, void*>> opened;       // (device, mapping), for cudaIpcCloseMemHandle
  bool ready = false;                              // WorkspaceLookup returns it
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

// Waits for the work on `devices` (kernels that may still read a mapping or a segment).
void Synchronize(const std::set<int>& devices) {
  for (int device : devices) {
    cudaSetDevice(device);
    cudaDeviceSynchronize();
  }
  cudaGetLastError();  // a failure here leaves nothing to report to the caller
}

std::set<int> LocalDevices(const WorkspaceInfo& info) {
  std::set<int> devices;
  for (const WorkspaceRank& r : info.ranks) {
    if (r.device >= 0) devices.insert(r.device);
  }
  return devices;
}

// Unmaps the other processes' segments (after the work on this process's GPUs).
void CloseMappings(Entry* entry) {
  if (entry->opened.empty()) return;
  Synchronize(LocalDevices(entry->info));
  for (const auto& [device, pointer] : entry->opened) {
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(pointer);
  }
  entry->opened.clear();
  cudaGetLastError();
}

void Release(Entry* entry) {
  CloseMappings(entry);
  for (const auto& [device, pointer] : entry->allocations) {
    cudaSetDevice(device);
    cudaFree(pointer);
  }
  entry->allocations.clear();
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

WorkspaceStatus Fail(cudaError_t err, const std::string& what, std::string* message) {
  cudaGetLastError();
  *message = what + " failed (" + CudaText(err) + ")";
  return WorkspaceStatus::kCudaError;
}

// This process's segments (the ranks with devices[s] >= 0), zeroed on the legacy stream: one
// allocation cut into P segments when `shared`, else a cudaMalloc a rank.
WorkspaceStatus AllocateSegments(const std::vector<int>& devices, int64_t bytes, bool shared,
                                 Entry* entry, std::string* message) {
  const size_t P = devices.size();
  WorkspaceInfo& info = entry->info;
  info.bytes = bytes;
  info.stride = shared ? (bytes + kSegmentAlign - 1) / kSegmentAlign * kSegmentAlign : 0;
  info.ranks.assign(P, WorkspaceRank{-1, nullptr, nullptr});
  info.tables.assign(P, {});
  for (size_t s = 0; s < P; ++s) {
    info.ranks[s].device = devices[s];
    if (devices[s] < 0) continue;
    if (shared && s > 0) {
      info.ranks[s].base = static_cast<char*>(info.ranks[0].base) + s * info.stride;
      continue;
    }
    const int64_t size = shared ? info.stride * static_cast<int64_t>(P) : bytes;
    if (const cudaError_t err = cudaSetDevice(devices[s]); err != cudaSuccess)
      return Fail(err, "cudaSetDevice(" + std::to_string(devices[s]) + ")", message);
    void* pointer = nullptr;
    if (const auto status = Allocate(devices[s], size, &pointer, message);
        status != WorkspaceStatus::kOk)
      return status;
    entry->allocations.emplace_back(devices[s], pointer);
    if (const cudaError_t err = cudaMemset(pointer, 0, static_cast<size_t>(size));
        err != cudaSuccess)
      return Fail(err, "cudaMemset of the workspace", message);
    info.ranks[s].base = pointer;
  }
  return WorkspaceStatus::kOk;
}

// The device table of each of this process's ranks, from `tables` (the host copies).
WorkspaceStatus WriteTables(std::vector<std::vector<void*>> tables, Entry* entry,
                            std::string* message) {
  WorkspaceInfo& info = entry->info;
  const size_t P = info.ranks.size();
  for (size_t s = 0; s < P; ++s) {
    const int device = info.ranks[s].device;
    if (device < 0) continue;
    cudaSetDevice(device);
    void* table = nullptr;
    if (const auto status =
            Allocate(device, static_cast<int64_t>(P * sizeof(void*)), &table, message);
        status != WorkspaceStatus::kOk)
      return status;
    entry->allocations.emplace_back(device, table);
    if (const cudaError_t err =
            cudaMemcpy(table, tables[s].data(), P * sizeof(void*), cudaMemcpyHostToDevice);
        err != cudaSuccess)
      return Fail(err, "cudaMemcpy of the peers table", message);
    info.ranks[s].peers = static_cast<void**>(table);
  }
  info.tables = std::move(tables);
  return WorkspaceStatus::kOk;
}

// The zeroing runs on the legacy stream, which XLA's streams do not wait for, and a peer may
// map a segment as soon as its handle is published: finish it here.
WorkspaceStatus Finish(const WorkspaceInfo& info, std::string* message) {
  for (int device : LocalDevices(info)) {
    cudaSetDevice(device);
    if (const cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess)
      return Fail(err, "cudaDeviceSynchronize after zeroing the workspace", message);
  }
  return WorkspaceStatus::kOk;
}

// Segments, zeroed, and each rank's device table of segment bases (all ranks this process's).
WorkspaceStatus Build(const std::vector<int>& devices, int64_t bytes, Entry* entry,
                      std::string* message) {
  const bool shared = devices.front() == devices.back();  // all one GPU (checked by the caller)
  if (!shared) {
    if (const auto status = EnablePeers(devices, message); status != WorkspaceStatus::kOk)
      return status;
  }
  if (const auto status = AllocateSegments(devices, bytes, shared, entry, message);
      status != WorkspaceStatus::kOk)
    return status;
  std::vector<void*> bases;
  for (const WorkspaceRank& r : entry->info.ranks) bases.push_back(r.base);
  if (const auto status = WriteTables(std::vector<std::vector<void*>>(devices.size(), bases),
                                      entry, message);
      status != WorkspaceStatus::kOk)
    return status;
  return Finish(entry->info, message);
}

int64_t Register(Entry&& entry) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  const int64_t handle = next_handle++;
  Registry().emplace(handle, std::move(entry));
  return handle;
}

// Takes the entry of `handle` out of the registry (its CUDA work runs without the lock); false
// when there is none.
bool Take(int64_t handle, Entry* entry) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(handle);
  if (it == Registry().end()) return false;
  *entry = std::move(it->second);
  Registry().erase(it);
  return true;
}

void Put(int64_t handle, Entry&& entry) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry().emplace(handle, std::move(entry));
}

// Checks of WorkspaceCreate and WorkspaceExport: `devices` holds ordinals of visible GPUs or,
// where `remote`, -1 for ranks of other processes.
WorkspaceStatus CheckDevices(const std::vector<int>& devices, int64_t bytes, bool remote,
                             std::string* message) {
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
  for (int d : devices) {
    if ((d < 0 && !(remote && d == -1)) || d >= count) {
      *message = "GPU " + std::to_string(d) + " does not exist (" + std::to_string(count) +
                 " CUDA GPU(s) visible)";
      return WorkspaceStatus::kBadArgument;
    }
  }
  return WorkspaceStatus::kOk;
}

}  // namespace

WorkspaceStatus WorkspaceCreate(const std::vector<int>& devices, int64_t bytes, int64_t* handle,
                                std::string* message) {
  *handle = 0;
  if (const auto status = CheckDevices(devices, bytes, false, message);
      status != WorkspaceStatus::kOk)
    return status;
  const std::set<int> distinct(devices.begin(), devices.end());
  if (distinct.size() != 1 && distinct.size() != devices.size()) {
    *message = "the ranks must be on distinct GPUs (one a GPU) or all on one GPU (segments of "
               "one allocation)";
    return WorkspaceStatus::kBadArgument;
  }
  CurrentDevice keep;
  Entry entry;
  const WorkspaceStatus status = Build(devices, bytes, &entry, message);
  if (status != WorkspaceStatus::kOk) {
    Release(&entry);
    return status;
  }
  entry.ready = true;
  *handle = Register(std::move(entry));
  return WorkspaceStatus::kOk;
}

WorkspaceStatus WorkspaceExport(const std::vector<int>& devices, int64_t bytes, int64_t* handle,
                                std::vector<std::string>* exported, std::string* message) {
  *handle = 0;
  exported->assign(devices.size(), std::string());
  if (const auto status = CheckDevices(devices, bytes, true, message);
      status != WorkspaceStatus::kOk)
    return status;
  std::vector<int> local;
  for (int d : devices) {
    if (d >= 0) local.push_back(d);
  }
  const std::set<int> distinct(local.begin(), local.end());
  if (local.empty() || local.size() == devices.size() || distinct.size() != local.size()) {
    *message = "a workspace across processes needs at least one rank of this process and one of "
               "another, and this process's ranks on distinct GPUs (one a GPU)";
    return WorkspaceStatus::kBadArgument;
  }
  CurrentDevice keep;
  Entry entry;
  WorkspaceStatus status = WorkspaceStatus::kOk;
  if (local.size() > 1) status = EnablePeers(local, message);
  if (status == WorkspaceStatus::kOk)
    status = AllocateSegments(devices, bytes, false, &entry, message);
  if (status == WorkspaceStatus::kOk) status = Finish(entry.info, message);
  for (size_t s = 0; s < devices.size() && status == WorkspaceStatus::kOk; ++s) {
    if (devices[s] < 0) continue;
    cudaSetDevice(devices[s]);
    cudaIpcMemHandle_t ipc;
    if (const cudaError_t err = cudaIpcGetMemHandle(&ipc, entry.info.ranks[s].base);
        err != cudaSuccess) {
      status = Fail(err, "cudaIpcGetMemHandle of rank " + std::to_string(s) + "'s segment on GPU " +
                             std::to_string(devices[s]), message);
      break;
    }
    static_assert(sizeof(ipc) == kWorkspaceIpcHandleBytes);
    (*exported)[s].assign(reinterpret_cast<const char*>(&ipc), sizeof(ipc));
  }
  if (status != WorkspaceStatus::kOk) {
    Release(&entry);
    exported->assign(devices.size(), std::string());
    return status;
  }
  *handle = Register(std::move(entry));
  return WorkspaceStatus::kOk;
}

WorkspaceStatus WorkspaceImport(int64_t handle, const std::vector<std::string>& imported,
                                std::string* message) {
  Entry entry;
  if (!Take(handle, &entry)) {
    *message = "no workspace has handle " + std::to_string(handle);
    return WorkspaceStatus::kBadArgument;
  }
  CurrentDevice keep;
  WorkspaceInfo& info = entry.info;
  const size_t P = info.ranks.size();
  auto status = [&]() -> WorkspaceStatus {
    if (entry.ready || !entry.opened.empty()) {
      *message = "workspace " + std::to_string(handle) + " has imported its peers already";
      return WorkspaceStatus::kBadArgument;
    }
    if (imported.size() != P) {
      *message = "the workspace has " + std::to_string(P) + " ranks, got " +
                 std::to_string(imported.size()) + " handles";
      return WorkspaceStatus::kBadArgument;
    }
    std::vector<std::vector<void*>> tables(P);
    for (size_t s = 0; s < P; ++s) {
      const int device = info.ranks[s].device;
      if (device < 0) continue;
      tables[s].assign(P, nullptr);
      for (size_t q = 0; q < P; ++q) {
        if (info.ranks[q].device >= 0) {
          tables[s][q] = info.ranks[q].base;  // this process's: peer access
          continue;
        }
        if (imported[q].size() != sizeof(cudaIpcMemHandle_t)) {
          *message = "rank " + std::to_string(q) + "'s handle has " +
                     std::to_string(imported[q].size()) + " bytes, a CUDA IPC handle " +
                     std::to_string(sizeof(cudaIpcMemHandle_t));
          return WorkspaceStatus::kBadArgument;
        }
        // A GPU of this process that holds several ranks maps each peer once.
        void* mapped = nullptr;
        for (size_t r = 0; r < s && !mapped; ++r) {
          if (info.ranks[r].device == device) mapped = tables[r][q];
        }
        if (!mapped) {
          cudaIpcMemHandle_t ipc;
          std::copy(imported[q].begin(), imported[q].end(), reinterpret_cast<char*>(&ipc));
          if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess)
            return Fail(err, "cudaSetDevice(" + std::to_string(device) + ")", message);
          if (const cudaError_t err =
                  cudaIpcOpenMemHandle(&mapped, ipc, cudaIpcMemLazyEnablePeerAccess);
              err != cudaSuccess)
            return Fail(err, "cudaIpcOpenMemHandle of rank " + std::to_string(q) +
                                 "'s segment on GPU " + std::to_string(device) +
                                 " (a CUDA IPC handle maps between processes of one host whose "
                                 "GPUs reach each other: NVLink or PCIe P2P)",
                        message);
          entry.opened.emplace_back(device, mapped);
        }
        tables[s][q] = mapped;
      }
    }
    if (const auto st = WriteTables(std::move(tables), &entry, message);
        st != WorkspaceStatus::kOk)
      return st;
    return Finish(info, message);
  }();
  entry.ready = status == WorkspaceStatus::kOk;
  Put(handle, std::move(entry));
  return status;
}

bool WorkspaceClose(int64_t handle) {
  Entry entry;
  if (!Take(handle, &entry)) return false;
  {
    CurrentDevice keep;
    entry.ready = false;
    CloseMappings(&entry);
  }
  Put(handle, std::move(entry));
  return true;
}

bool WorkspaceFree(int64_t handle) {
  Entry entry;
  if (!Take(handle, &entry)) return false;
  CurrentDevice keep;
  Release(&entry);
  return true;
}

bool WorkspaceLookup(int64_t handle, WorkspaceInfo* info) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(handle);
  if (it == Registry().end() || !it->second.ready) return false;
  *info = it->second.info;
  return true;
}

std::string WorkspaceCopy(int64_t handle, int rank, int peer, int64_t offset, void* host,
                          int64_t size, bool to_device) {
  WorkspaceInfo info;
  if (!WorkspaceLookup(handle, &info)) return "no workspace has handle " + std::to_string(handle);
  const int P = static_cast<int>(info.ranks.size());
  if (rank < 0 || rank >= P || info.ranks[rank].device < 0)
    return "rank " + std::to_string(rank) + " is not a rank of this process";
  if (peer < 0 || peer >= P) return "peer " + std::to_string(peer) + " is not a rank";
  if (offset < 0 || size < 0 || offset + size > info.bytes)
    return "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + size) +
           ") are outside a segment of " + std::to_string(info.bytes);
  CurrentDevice keep;
  cudaSetDevice(info.ranks[rank].device);
  char* at = static_cast<char*>(info.tables[rank][peer]) + offset;
  const cudaError_t err =
      to_device ? cudaMemcpy(at, host, static_cast<size_t>(size), cudaMemcpyHostToDevice)
                : cudaMemcpy(host, at, static_cast<size_t>(size), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("cudaMemcpy failed (") + CudaText(err) + ")";
  }
  return "";
}

}  // namespace mok::cuda
