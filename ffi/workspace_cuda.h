// The registry of symmetric workspaces (mok_jax.Workspace): device memory of the same size and
// byte layout on every rank of an EP group, each rank's segment reachable from every other
// rank, named by an integer handle. The handle is what Python keeps and what an FFI handler
// will get as an attribute; WorkspaceLookup turns it into a rank's pointers. Plain C++ over
// the CUDA runtime: no XLA, no CuTe.
//
// Two ways to build one, both in one process:
//   - ranks on distinct GPUs: a cudaMalloc on each, peer access enabled between every pair
//     (cudaDeviceCanAccessPeer must hold for each pair: NVLink or PCIe peer-to-peer);
//   - ranks on one GPU (the loopback tests): one cudaMalloc cut into P segments.
// Ranks in several processes (CUDA IPC / fabric handles) are not built: Python raises first.
// Each segment is zeroed once at creation (flags, epochs and counters start at 0), and the
// device table of the P segment bases is written once on each rank's GPU.
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
  int device;    // CUDA ordinal of the rank's GPU
  void* base;    // its segment, `bytes` long
  void** peers;  // (P) device table on `device`: peers[q] = rank q's base
};

struct WorkspaceInfo {
  int64_t bytes = 0;       // a segment's size, the same on every rank
  int64_t stride = 0;      // distance between segments on one GPU (0 for distinct GPUs)
  std::vector<WorkspaceRank> ranks;
};

// Allocates a workspace of `bytes` a rank for the ranks on `devices` (in rank order: all
// distinct, or all the same GPU). On kOk, *handle > 0; otherwise *message says what failed
// (the bytes and the GPU for kOutOfMemory, with what was free).
WorkspaceStatus WorkspaceCreate(const std::vector<int>& devices, int64_t bytes, int64_t* handle,
                                std::string* message);

// Frees the workspace `handle` (waits for the work on its GPUs, as cudaFree does). false when
// no workspace has that handle.
bool WorkspaceFree(int64_t handle);

// The workspace `handle`, copied into *info; false when there is none.
bool WorkspaceLookup(int64_t handle, WorkspaceInfo* info);

}  // namespace mok::cuda
