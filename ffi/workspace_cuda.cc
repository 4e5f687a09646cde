// The workspace registry of workspace_cuda.h.
#include "workspace_cuda.h"

#include <cuda_runtime_api.h>
#include <dirent.h>

#include <cstdio>
#include <cstring>
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
  std::vector<std::pair<int, void*>> allocations;  // (device, pointer), for cudaFree: segments
                                                   // (a fabric pool's too) and device tables
  std::vector<cudaMemPool_t> pools;                // (P) rank s's fabric pool, or null; each
                                                   // destroyed once its segment is freed
  std::vector<std::pair<int, void*>> opened;       // (device, mapping), for cudaIpcCloseMemHandle
  std::vector<void*> imported;                     // other processes' fabric segments, cudaFree
  std::vector<cudaMemPool_t> imported_pools;       // their pools, destroyed after them
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
  if (entry->opened.empty() && entry->imported.empty() && entry->imported_pools.empty()) return;
  const std::set<int> devices = LocalDevices(entry->info);
  Synchronize(devices);
  for (const auto& [device, pointer] : entry->opened) {
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(pointer);
  }
  // An imported pool pointer is one address for all of this process's GPUs: freed once.
  if (!devices.empty()) cudaSetDevice(*devices.begin());
  for (void* pointer : entry->imported) cudaFree(pointer);
  for (cudaMemPool_t pool : entry->imported_pools) cudaMemPoolDestroy(pool);
  entry->opened.clear();
  entry->imported.clear();
  entry->imported_pools.clear();
  cudaGetLastError();
}

void Release(Entry* entry) {
  CloseMappings(entry);
  for (const auto& [device, pointer] : entry->allocations) {
    cudaSetDevice(device);
    cudaFree(pointer);
  }
  for (cudaMemPool_t pool : entry->pools) {
    if (pool) cudaMemPoolDestroy(pool);
  }
  entry->allocations.clear();
  entry->pools.clear();
  cudaGetLastError();  // a failure while freeing leaves nothing to report to the caller
}

std::string CudaText(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// The failure of `what` (an allocation of `bytes` on the current device `device`) with error
// `err`: an out-of-memory one says what was free.
WorkspaceStatus AllocationFailed(cudaError_t err, const std::string& what, int device,
                                 int64_t bytes, std::string* message) {
  cudaGetLastError();  // an allocation failure is not sticky: clear it
  const std::string head =
      what + " of " + std::to_string(bytes) + " bytes on GPU " + std::to_string(device);
  if (err != cudaErrorMemoryAllocation) {
    *message = head + " failed (" + CudaText(err) + ")";
    return WorkspaceStatus::kCudaError;
  }
  size_t free = 0, total = 0;
  cudaMemGetInfo(&free, &total);
  cudaGetLastError();
  *message = head + " failed: out of memory (" + std::to_string(free) + " of " +
             std::to_string(total) + " bytes free)";
  return WorkspaceStatus::kOutOfMemory;
}

// A cudaMalloc on the current device `device`.
WorkspaceStatus Allocate(int device, int64_t bytes, void** pointer, std::string* message) {
  const cudaError_t err = cudaMalloc(pointer, static_cast<size_t>(bytes));
  if (err == cudaSuccess) return WorkspaceStatus::kOk;
  return AllocationFailed(err, "cudaMalloc", device, bytes, message);
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

// What a failure to export fabric handles asks of the machine, and the ways around it.
constexpr const char* kFabricNeeds =
    ". Fabric handles need GPUs of one NVLink domain (NVL72) whose driver reports "
    "cudaMemHandleTypeFabric for memory pools, and an IMEX channel this process may open "
    "(the nvidia-imex service running, /dev/nvidia-caps-imex-channels/channel0). Use "
    "ep_transport='collective', or EP groups within one host (CUDA IPC)";

WorkspaceStatus NoFabric(const std::string& what, std::string* message) {
  cudaGetLastError();
  *message = what + kFabricNeeds;
  return WorkspaceStatus::kNotSupported;
}

constexpr const char* kImexChannels = "/dev/nvidia-caps-imex-channels";

bool HasImexChannel() {
  DIR* dir = opendir(kImexChannels);
  if (!dir) return false;
  bool found = false;
  while (const dirent* e = readdir(dir))
    found = found || std::strncmp(e->d_name, "channel", 7) == 0;
  closedir(dir);
  return found;
}

// "" when GPU `device` reports fabric handles for its memory pools and the machine has an IMEX
// channel, else what is missing.
std::string FabricAttributeProblem(int device) {
  const std::string gpu = "GPU " + std::to_string(device);
  int pools = 0, types = 0;
  cudaError_t err = cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device);
  if (err == cudaSuccess && pools)
    err = cudaDeviceGetAttribute(&types, cudaDevAttrMemoryPoolSupportedHandleTypes, device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return "cudaDeviceGetAttribute of " + gpu + "'s memory pools failed (" + CudaText(err) + ")";
  }
  if (!pools) return gpu + " has no memory pools (cudaDevAttrMemoryPoolsSupported = 0)";
  if (!(types & cudaMemHandleTypeFabric)) {
    char mask[16];
    std::snprintf(mask, sizeof(mask), "0x%x", static_cast<unsigned>(types));
    return gpu + "'s driver reports the memory-pool handle types " + mask +
           " (cudaDevAttrMemoryPoolSupportedHandleTypes), without fabric handles "
           "(cudaMemHandleTypeFabric = 0x8)";
  }
  // The driver reports fabric handles without an IMEX channel too, and then refuses to export
  // them (cudaErrorNotPermitted) after the pool is made: see AllocatePooled.
  if (!HasImexChannel())
    return "this machine has no IMEX channel (no " + std::string(kImexChannels) +
           "/channel*), which fabric handles go through";
  return "";
}

// A memory pool of fabric handles on the current device `device` (*pool, to destroy even when
// a later step fails) and its one allocation of `bytes` (*pointer), finished; `peers`: the
// other GPUs of this process, given read-write access to it (peer access does not cover pool
// memory).
WorkspaceStatus AllocatePooled(int device, int64_t bytes, const std::vector<int>& peers,
                               cudaMemPool_t* pool, void** pointer, std::string* message) {
  *pool = nullptr;
  *pointer = nullptr;
  const std::string gpu = "GPU " + std::to_string(device);
  if (const std::string problem = FabricAttributeProblem(device); !problem.empty())
    return NoFabric(problem, message);
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeFabric;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  if (const cudaError_t err = cudaMemPoolCreate(pool, &props); err != cudaSuccess) {
    *pool = nullptr;
    return NoFabric("cudaMemPoolCreate of a pool with fabric handles (cudaMemHandleTypeFabric) "
                    "on " + gpu + " failed (" + CudaText(err) + ")", message);
  }
  // The pool's export is tried before anything is allocated from it. A pool whose export has
  // failed is left to the process's end, never destroyed: driver 580 crashes (SIGSEGV) in
  // cudaMemPoolDestroy, and in cudaFree of its allocations, after that failure.
  cudaMemFabricHandle_t trial;
  if (const cudaError_t err =
          cudaMemPoolExportToShareableHandle(&trial, *pool, cudaMemHandleTypeFabric, 0);
      err != cudaSuccess) {
    *pool = nullptr;
    return NoFabric("cudaMemPoolExportToShareableHandle of " + gpu + "'s pool as a fabric "
                    "handle failed (" + CudaText(err) + ")", message);
  }
  cudaError_t err = cudaMallocFromPoolAsync(pointer, static_cast<size_t>(bytes), *pool, nullptr);
  if (err == cudaSuccess) err = cudaStreamSynchronize(nullptr);
  if (err == cudaErrorNotPermitted || err == cudaErrorNotSupported)
    return NoFabric("cudaMallocFromPoolAsync of " + std::to_string(bytes) + " bytes from " +
                    gpu + "'s pool of fabric handles failed (" + CudaText(err) + ")", message);
  if (err != cudaSuccess)
    return AllocationFailed(err, "cudaMallocFromPoolAsync", device, bytes, message);
  std::vector<cudaMemAccessDesc> access;
  for (int peer : peers) {
    cudaMemAccessDesc desc{};
    desc.location.type = cudaMemLocationTypeDevice;
    desc.location.id = peer;
    desc.flags = cudaMemAccessFlagsProtReadWrite;
    access.push_back(desc);
  }
  if (!access.empty()) {
    if (const cudaError_t e = cudaMemPoolSetAccess(*pool, access.data(), access.size());
        e != cudaSuccess)
      return Fail(e, "cudaMemPoolSetAccess of " + gpu + "'s pool for this process's other GPUs",
                  message);
  }
  return WorkspaceStatus::kOk;
}

// The exported bytes (workspace_cuda.h) of segment `base` on the current device `device`: of
// `pool`, its fabric pool, for kFabric.
WorkspaceStatus ExportSegment(WorkspaceHandleKind kind, int device, void* base,
                              cudaMemPool_t pool, std::string* out, std::string* message) {
  const std::string gpu = "GPU " + std::to_string(device);
  if (kind == WorkspaceHandleKind::kIpc) {
    cudaIpcMemHandle_t ipc;
    if (const cudaError_t err = cudaIpcGetMemHandle(&ipc, base); err != cudaSuccess)
      return Fail(err, "cudaIpcGetMemHandle of a segment on " + gpu, message);
    static_assert(1 + sizeof(ipc) == kWorkspaceIpcBytes);
    out->assign(1, kWorkspaceIpcKind);
    out->append(reinterpret_cast<const char*>(&ipc), sizeof(ipc));
    return WorkspaceStatus::kOk;
  }
  cudaMemFabricHandle_t fabric;
  cudaMemPoolPtrExportData data;
  if (const cudaError_t err =
          cudaMemPoolExportToShareableHandle(&fabric, pool, cudaMemHandleTypeFabric, 0);
      err != cudaSuccess)
    return NoFabric("cudaMemPoolExportToShareableHandle of " + gpu + "'s pool as a fabric "
                    "handle failed (" + CudaText(err) + ")", message);
  if (const cudaError_t err = cudaMemPoolExportPointer(&data, base); err != cudaSuccess)
    return Fail(err, "cudaMemPoolExportPointer of a segment on " + gpu, message);
  static_assert(1 + sizeof(fabric) + sizeof(data) == kWorkspaceFabricBytes);
  out->assign(1, kWorkspaceFabricKind);
  out->append(reinterpret_cast<const char*>(&fabric), sizeof(fabric));
  out->append(reinterpret_cast<const char*>(&data), sizeof(data));
  return WorkspaceStatus::kOk;
}

// What is wrong with rank q's exported bytes `blob`, or "" (a known kind, of its size).
std::string BlobProblem(size_t q, const std::string& blob) {
  const std::string what = "rank " + std::to_string(q) + "'s exported handle";
  if (blob.empty()) return what + " is empty (its process exported nothing for it)";
  size_t expected = 0;
  std::string kind;
  if (blob[0] == kWorkspaceIpcKind) {
    expected = kWorkspaceIpcBytes;
    kind = "a CUDA IPC handle ('I', then a cudaIpcMemHandle_t of 64 bytes)";
  } else if (blob[0] == kWorkspaceFabricKind) {
    expected = kWorkspaceFabricBytes;
    kind = "a fabric handle ('F', then a cudaMemFabricHandle_t and a cudaMemPoolPtrExportData "
           "of 64 bytes each)";
  } else {
    char first[8];
    std::snprintf(first, sizeof(first), "0x%02x", static_cast<unsigned char>(blob[0]));
    return what + " starts with the byte " + first + ", which names no kind of handle ('I': "
           "CUDA IPC, 'F': fabric)";
  }
  if (blob.size() != expected)
    return what + " has " + std::to_string(blob.size()) + " bytes; " + kind + " is " +
           std::to_string(expected);
  return "";
}

// Imports rank q's fabric segment `blob` (checked) into this process: its pool, read-write
// access for each of `devices` (this process's GPUs of the workspace) that lacks it, and the
// pointer, one address for all of them (*pointer).
WorkspaceStatus ImportFabric(size_t q, const std::string& blob, const std::set<int>& devices,
                             Entry* entry, void** pointer, std::string* message) {
  const std::string rank = "rank " + std::to_string(q) + "'s segment";
  cudaMemFabricHandle_t fabric;
  cudaMemPoolPtrExportData data;
  std::memcpy(&fabric, blob.data() + 1, sizeof(fabric));
  std::memcpy(&data, blob.data() + 1 + sizeof(fabric), sizeof(data));
  if (const cudaError_t err = cudaSetDevice(*devices.begin()); err != cudaSuccess)
    return Fail(err, "cudaSetDevice(" + std::to_string(*devices.begin()) + ")", message);
  cudaMemPool_t pool = nullptr;
  if (const cudaError_t err =
          cudaMemPoolImportFromShareableHandle(&pool, &fabric, cudaMemHandleTypeFabric, 0);
      err != cudaSuccess)
    return NoFabric("cudaMemPoolImportFromShareableHandle of the fabric handle of " + rank +
                    "'s pool failed (" + CudaText(err) + ")", message);
  entry->imported_pools.push_back(pool);
  // An imported pool is reachable from its own GPU only (where that GPU is this process's
  // too, it has access already, which is left as it is).
  std::vector<cudaMemAccessDesc> access;
  for (int device : devices) {
    cudaMemLocation location{};
    location.type = cudaMemLocationTypeDevice;
    location.id = device;
    cudaMemAccessFlags flags = cudaMemAccessFlagsProtNone;
    if (cudaMemPoolGetAccess(&flags, pool, &location) != cudaSuccess) cudaGetLastError();
    if (flags == cudaMemAccessFlagsProtReadWrite) continue;
    access.push_back(cudaMemAccessDesc{location, cudaMemAccessFlagsProtReadWrite});
  }
  if (!access.empty()) {
    if (const cudaError_t err = cudaMemPoolSetAccess(pool, access.data(), access.size());
        err != cudaSuccess)
      return Fail(err, "cudaMemPoolSetAccess of " + rank + "'s imported pool for this "
                  "process's GPUs", message);
  }
  if (const cudaError_t err = cudaMemPoolImportPointer(pointer, pool, &data);
      err != cudaSuccess)
    return Fail(err, "cudaMemPoolImportPointer of " + rank, message);
  entry->imported.push_back(*pointer);
  return WorkspaceStatus::kOk;
}

// This process's segments (the ranks with devices[s] >= 0), zeroed on the legacy stream: one
// allocation cut into P segments when `shared`, else a cudaMalloc a rank (kIpc) or a fabric
// pool's allocation a rank (kFabric; never shared).
WorkspaceStatus AllocateSegments(const std::vector<int>& devices, int64_t bytes, bool shared,
                                 WorkspaceHandleKind kind, Entry* entry, std::string* message) {
  const size_t P = devices.size();
  WorkspaceInfo& info = entry->info;
  info.bytes = bytes;
  info.stride = shared ? (bytes + kSegmentAlign - 1) / kSegmentAlign * kSegmentAlign : 0;
  info.ranks.assign(P, WorkspaceRank{-1, nullptr, nullptr});
  info.tables.assign(P, {});
  if (kind == WorkspaceHandleKind::kFabric) entry->pools.assign(P, nullptr);
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
    if (kind == WorkspaceHandleKind::kFabric) {
      std::vector<int> peers;
      for (int d : devices) {
        if (d >= 0 && d != devices[s]) peers.push_back(d);
      }
      const auto status =
          AllocatePooled(devices[s], size, peers, &entry->pools[s], &pointer, message);
      if (pointer) entry->allocations.emplace_back(devices[s], pointer);
      if (status != WorkspaceStatus::kOk) return status;
    } else {
      if (const auto status = Allocate(devices[s], size, &pointer, message);
          status != WorkspaceStatus::kOk)
        return status;
      entry->allocations.emplace_back(devices[s], pointer);
    }
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
  if (const auto status =
          AllocateSegments(devices, bytes, shared, WorkspaceHandleKind::kIpc, entry, message);
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

WorkspaceStatus WorkspaceExport(const std::vector<int>& devices, int64_t bytes,
                                WorkspaceHandleKind kind, int64_t* handle,
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
    status = AllocateSegments(devices, bytes, false, kind, &entry, message);
  if (status == WorkspaceStatus::kOk) status = Finish(entry.info, message);
  for (size_t s = 0; s < devices.size() && status == WorkspaceStatus::kOk; ++s) {
    if (devices[s] < 0) continue;
    cudaSetDevice(devices[s]);
    status = ExportSegment(kind, devices[s], entry.info.ranks[s].base,
                           kind == WorkspaceHandleKind::kFabric ? entry.pools[s] : nullptr,
                           &(*exported)[s], message);
    if (status != WorkspaceStatus::kOk) *message = "rank " + std::to_string(s) + ": " + *message;
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
    if (entry.ready || !entry.opened.empty() || !entry.imported_pools.empty()) {
      *message = "workspace " + std::to_string(handle) + " has imported its peers already";
      return WorkspaceStatus::kBadArgument;
    }
    if (imported.size() != P) {
      *message = "the workspace has " + std::to_string(P) + " ranks, got " +
                 std::to_string(imported.size()) + " handles";
      return WorkspaceStatus::kBadArgument;
    }
    for (size_t q = 0; q < P; ++q) {
      if (info.ranks[q].device >= 0) continue;
      if (const std::string problem = BlobProblem(q, imported[q]); !problem.empty()) {
        *message = problem;
        return WorkspaceStatus::kBadArgument;
      }
    }
    // A fabric segment is imported once, at one address for all of this process's GPUs.
    const std::set<int> devices = LocalDevices(info);
    std::vector<void*> fabric(P, nullptr);
    for (size_t q = 0; q < P; ++q) {
      if (info.ranks[q].device >= 0 || imported[q][0] != kWorkspaceFabricKind) continue;
      if (const auto st = ImportFabric(q, imported[q], devices, &entry, &fabric[q], message);
          st != WorkspaceStatus::kOk)
        return st;
    }
    std::vector<std::vector<void*>> tables(P);
    for (size_t s = 0; s < P; ++s) {
      const int device = info.ranks[s].device;
      if (device < 0) continue;
      tables[s].assign(P, nullptr);
      for (size_t q = 0; q < P; ++q) {
        if (info.ranks[q].device >= 0) {
          tables[s][q] = info.ranks[q].base;  // this process's: peer (or pool) access
          continue;
        }
        if (fabric[q]) {
          tables[s][q] = fabric[q];
          continue;
        }
        // A GPU of this process that holds several ranks maps each peer once.
        void* mapped = nullptr;
        for (size_t r = 0; r < s && !mapped; ++r) {
          if (info.ranks[r].device == device) mapped = tables[r][q];
        }
        if (!mapped) {
          cudaIpcMemHandle_t ipc;
          std::memcpy(&ipc, imported[q].data() + 1, sizeof(ipc));
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

std::string WorkspaceFabricProblem(int device) {
  std::string message, blob;
  if (CheckDevices({device}, kSegmentAlign, false, &message) != WorkspaceStatus::kOk)
    return message;
  CurrentDevice keep;
  if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    cudaGetLastError();
    return "cudaSetDevice(" + std::to_string(device) + ") failed (" + CudaText(err) + ")";
  }
  cudaMemPool_t pool = nullptr;
  void* pointer = nullptr;
  WorkspaceStatus status = AllocatePooled(device, kSegmentAlign, {}, &pool, &pointer, &message);
  if (status == WorkspaceStatus::kOk)
    status = ExportSegment(WorkspaceHandleKind::kFabric, device, pointer, pool, &blob, &message);
  if (pointer) cudaFree(pointer);
  if (pool) cudaMemPoolDestroy(pool);
  cudaGetLastError();
  return status == WorkspaceStatus::kOk ? "" : message;
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
