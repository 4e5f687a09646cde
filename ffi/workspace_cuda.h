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
//   - ranks of several processes of one host (WorkspaceExport, then WorkspaceImport): each
//     process cudaMallocs the segments of its own ranks and exports a CUDA IPC handle of each
//     (cudaIpcGetMemHandle); Python exchanges the handles (bytes) through jax.distributed's
//     key-value store; each process then maps the other processes' segments
//     (cudaIpcOpenMemHandle, once for each of its GPUs) and writes its device tables. Its own
//     ranks reach each other through peer access, as in the first case.
// Each segment is zeroed once by its owner at creation (flags, epochs and counters start at
// 0), and the device table of the P segment bases is written once on each of this process's
// ranks' GPUs.
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
  kCudaError,     // any other CUDA error
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

// The bytes of a CUDA IPC memory handle (cudaIpcMemHandle_t).
constexpr int kWorkspaceIpcHandleBytes = 64;

// Allocates a workspace of `bytes` a rank for the ranks on `devices`, all of this process (in
// rank order: all distinct, or all the same GPU). On kOk, *handle > 0; otherwise *message says
// what failed (the bytes and the GPU for kOutOfMemory, with what was free).
WorkspaceStatus WorkspaceCreate(const std::vector<int>& devices, int64_t bytes, int64_t* handle,
                                std::string* message);

// The first step of a workspace across processes: `devices` holds, in rank order, the CUDA
// ordinal of each of this process's ranks (distinct) and -1 for each rank of another process.
// Allocates and zeroes this process's segments (finished before it returns) and exports each:
// on kOk, *handle > 0 names a workspace that WorkspaceLookup does not return yet, and
// (*exported)[s] holds the kWorkspaceIpcHandleBytes of rank s's IPC handle (empty for the
// ranks of other processes).
WorkspaceStatus WorkspaceExport(const std::vector<int>& devices, int64_t bytes, int64_t* handle,
                                std::vector<std::string>* exported, std::string* message);

// The second step: `imported[q]` is rank q's IPC handle for each rank of another process
// (ignored for this process's ranks). Maps them on each of this process's GPUs of the
// workspace and writes the device tables; on kOk the workspace is ready (WorkspaceLookup).
// On a failure the workspace stays allocated, not ready: WorkspaceFree releases it.
WorkspaceStatus WorkspaceImport(int64_t handle, const std::vector<std::string>& imported,
                                std::string* message);

// Waits for the work on the workspace's GPUs, then unmaps the other processes' segments
// (cudaIpcCloseMemHandle); the workspace is no longer returned by WorkspaceLookup, and its own
// segments stay allocated until WorkspaceFree, which the other processes' mappings need until
// they have closed theirs. false when no workspace has that handle.
bool WorkspaceClose(int64_t handle);

// Frees the workspace `handle` (closes what WorkspaceClose has not, then waits for the work on
// its GPUs, as cudaFree does). false when no workspace has that handle.
bool WorkspaceFree(int64_t handle);

// The workspace `handle`, copied into *info; false when there is none or it is not ready.
bool WorkspaceLookup(int64_t handle, WorkspaceInfo* info);

// Copies `size` bytes between the host and rank `peer`'s segment at `offset`, through the
// address that this process's rank `rank` maps it at (tables[rank][peer]): to the segment
// when `to_device`, else from it. "" on success, else what failed. For tests and debugging.
std::string WorkspaceCopy(int64_t handle, int rank, int peer, int64_t offset, void* host,
                          int64_t size, bool to_device);

}  // namespace mok::cuda
