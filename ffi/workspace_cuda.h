// The registry of symmetric workspaces (mok_jax.Workspace): device memory of the same size and
// byte layout on every rank of an EP group, each rank's segment reachable from every other
// rank, named by an integer handle. The handle is what Python keeps and what an FFI handler
// gets as an attribute; WorkspaceLookup turns it into a rank's pointers. Plain C++ over the
// CUDA runtime: no XLA, no CuTe.
//
// Three ways to build one:
//   - ranks on distinct GPUs of this process (WorkspaceCreate): a cudaMalloc on each, peer
//     access enabled between every pair (cudaDeviceCanAccessPeer must hold for each pair:
//     NVLink or PCIe peer-to-peer);
//   - ranks on one GPU (the loopback tests, WorkspaceCreate): one cudaMalloc cut into P
//     segments;
//   - ranks of several processes (WorkspaceExport, then WorkspaceImport): each process
//     allocates and zeroes the segments of its own ranks and exports each as bytes (below);
//     Python exchanges them through jax.distributed's key-value store; each process then maps
//     the other processes' segments and writes its device tables. Its own ranks reach each
//     other through peer access, as in the first case (a fabric segment, memory of a pool,
//     through the pool's access, which its owner grants each of its other GPUs).
// The exported bytes of a segment start with a byte that names their kind (WorkspaceHandleKind):
//   'I' + cudaIpcMemHandle_t (64 bytes): a cudaMalloc exported with cudaIpcGetMemHandle, mapped
//     with cudaIpcOpenMemHandle once on each GPU of the importer; processes of one host only.
//   'F' + cudaMemFabricHandle_t (64) + cudaMemPoolPtrExportData (64): the segment is the one
//     allocation of its own memory pool, created with cudaMemHandleTypeFabric on the segment's
//     GPU; the pool goes out as a fabric handle (cudaMemPoolExportToShareableHandle), the
//     segment as its pointer's export data (cudaMemPoolExportPointer). The importer imports
//     the pool (cudaMemPoolImportFromShareableHandle), grants its GPUs read-write access
//     (cudaMemPoolSetAccess) and imports the pointer (cudaMemPoolImportPointer): one address
//     for all its GPUs. Fabric handles reach across the hosts of an NVLink domain (NVL72); the
//     driver must report cudaMemHandleTypeFabric in cudaDevAttrMemoryPoolSupportedHandleTypes
//     and the process needs an IMEX channel (nvidia-imex running, /dev/nvidia-caps-imex-channels).
// Python picks the kind (mok_jax/workspace.py): IPC where every process is on one host, fabric
// where the group spans hosts; the importer follows the kind byte of each peer's bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mok::cuda {

enum class WorkspaceStatus {
  kOk,
  kBadArgument,   // devices or bytes that no workspace can have
  kOutOfMemory,   // a cudaMalloc failed for lack of memory
  kNoPeerAccess,  // two of the GPUs cannot reach each other's memory
  kNotSupported,  // the GPU or its driver cannot export what was asked (fabric handles)
  kCudaError,     // any other CUDA error
};

// How WorkspaceExport shares this process's segments (the header comment has the bytes).
enum class WorkspaceHandleKind {
  kIpc,     // CUDA IPC handles: processes of one host
  kFabric,  // fabric handles of memory pools: the hosts of an NVLink domain
};

struct WorkspaceRank {
  int device;    // CUDA ordinal of the rank's GPU in this process; -1: a rank of another process
  void* base;    // its segment, `bytes` long (null for a rank of another process)
  void** peers;  // (P) device table on `device`: peers[q] = rank q's base as `device` maps it
                 // (null for a rank of another process)
};

struct WorkspaceInfo {
  int64_t bytes = 0;       // a segment's size, the same on every rank
  int64_t stride = 0;      // distance between segments on one GPU (0 for distinct GPUs)
  std::vector<WorkspaceRank> ranks;
  // tables[s]: a host copy of rank s's device table (empty for a rank of another process).
  std::vector<std::vector<void*>> tables;
};

// The exported bytes of a segment: the kind byte, then the handle (the header comment).
constexpr char kWorkspaceIpcKind = 'I';
constexpr char kWorkspaceFabricKind = 'F';
constexpr int kWorkspaceIpcBytes = 1 + 64;           // 'I', cudaIpcMemHandle_t
constexpr int kWorkspaceFabricBytes = 1 + 64 + 64;   // 'F', cudaMemFabricHandle_t,
                                                     // cudaMemPoolPtrExportData

// Allocates a workspace of `bytes` a rank for the ranks on `devices`, all of this process (in
// rank order: all distinct, or all the same GPU). On kOk, *handle > 0; otherwise *message says
// what failed (the bytes and the GPU for kOutOfMemory, with what was free).
WorkspaceStatus WorkspaceCreate(const std::vector<int>& devices, int64_t bytes, int64_t* handle,
                                std::string* message);

// The first step of a workspace across processes: `devices` holds, in rank order, the CUDA
// ordinal of each of this process's ranks (distinct) and -1 for each rank of another process.
// Allocates and zeroes this process's segments (finished before it returns) and exports each
// as `kind` asks: on kOk, *handle > 0 names a workspace that WorkspaceLookup does not return
// yet, and (*exported)[s] holds rank s's exported bytes (kWorkspaceIpcBytes or
// kWorkspaceFabricBytes; empty for the ranks of other processes). kNotSupported: a GPU cannot
// export fabric handles, *message says what the driver reported and what to do.
WorkspaceStatus WorkspaceExport(const std::vector<int>& devices, int64_t bytes,
                                WorkspaceHandleKind kind, int64_t* handle,
                                std::vector<std::string>* exported, std::string* message);

// The second step: `imported[q]` is rank q's exported bytes for each rank of another process
// (ignored for this process's ranks), of either kind (its first byte). Checks every one
// (kBadArgument naming the rank: empty, an unknown kind, the wrong size), then maps them on
// this process's GPUs of the workspace and writes the device tables; on kOk the workspace is
// ready (WorkspaceLookup). On a failure the workspace stays allocated, not ready:
// WorkspaceFree releases it.
WorkspaceStatus WorkspaceImport(int64_t handle, const std::vector<std::string>& imported,
                                std::string* message);

// Waits for the work on the workspace's GPUs, then unmaps the other processes' segments
// (cudaIpcCloseMemHandle; for fabric handles, cudaFree of the imported pointers and
// cudaMemPoolDestroy of the imported pools); the workspace is no longer returned by
// WorkspaceLookup, and its own segments stay allocated until WorkspaceFree, which the other
// processes' mappings need until they have closed theirs. false when no workspace has that handle.
bool WorkspaceClose(int64_t handle);

// Frees the workspace `handle` (closes what WorkspaceClose has not, then waits for the work on
// its GPUs, as cudaFree does, and destroys its fabric pools). false when no workspace has that
// handle.
bool WorkspaceFree(int64_t handle);

// "" when GPU `device` can export a memory pool through a fabric handle (it tries: a pool, an
// allocation, their export, then frees them), else what the driver reported and what to do.
std::string WorkspaceFabricProblem(int device);

// The workspace `handle`, copied into *info; false when there is none or it is not ready.
bool WorkspaceLookup(int64_t handle, WorkspaceInfo* info);

// Copies `size` bytes between the host and rank `peer`'s segment at `offset`, through the
// address that this process's rank `rank` maps it at (tables[rank][peer]): to the segment
// when `to_device`, else from it. "" on success, else what failed. For tests and debugging.
std::string WorkspaceCopy(int64_t handle, int rank, int peer, int64_t offset, void* host,
                          int64_t size, bool to_device);

}  // namespace mok::cuda
