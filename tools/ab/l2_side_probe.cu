// A probe of the H200's two L2 partitions as each SM sees them: which SMs sit on which side,
// and which side each 128-byte line of memory belongs to. Nsight Compute finds the link
// between the partitions (lts__ltcfabric2ltc_cycles_active) 90-95% busy in the forward MLPs,
// the SwiGLU backward and dx_r of dsv3, and 90% in a plain stream of TMA stores
// (docs/performance.md, The link between the two L2 partitions): if lines are homed by an
// address function a kernel can compute, CTAs could read mostly the lines of their own side
// (what that gives a plain read, tools/ab/l2_side_stream.cu measured: 3%).
//
// For each SM in turn (a launch of one CTA an SM, only the CTA on the target SM working; a read
// of a buffer four times L2's size between launches, so that the lines are not in L2), one
// thread loads each probed line once with a dependent ld.global.cg (the address of each load
// depends on the value before), timing each by clock64: the first pass misses L2 (DRAM and, for
// a line homed on the far side, the fabric), the second hits. The lines: set A, kLinesA
// consecutive lines from a 2 MB-aligned base (the low address bits); set B, the first line of
// each of kPagesB 2 MB pages (the bits above a page, where virtual and physical addresses may
// differ).
//
// Build: nvcc -std=c++17 -arch=sm_90a -O3 -o runs/probe/l2_side_probe tools/ab/l2_side_probe.cu
// Run: runs/probe/l2_side_probe OUT.bin; then python3 tools/ab/l2_side.py OUT.bin.
// OUT.bin: int32 sms, lines; int32 smid[sms]; int64 offset[lines] (bytes from the base); uint16
// miss[sms][lines], hit[sms][lines] (clocks, saturated at 65535).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "probe.cuh"

namespace {

constexpr int kLinesA = 4096;             // 512 KB of consecutive lines
constexpr int kPagesB = 2048;             // 4 GB of 2 MB pages
constexpr int kLines = kLinesA + kPagesB;
constexpr int64_t kPage = int64_t{2} << 20;

__global__ void __launch_bounds__(32) ChaseKernel(const uint8_t* base, const int64_t* offsets,
                                                  int target, int* smid_out,
                                                  uint16_t* miss, uint16_t* hit) {
  extern __shared__ int64_t offs[];  // kLines offsets, read before any timed load; a sink
  if (probe::SmId() != target) return;
  for (int i = threadIdx.x; i < kLines; i += 32) offs[i] = offsets[i];
  __syncwarp();
  if (threadIdx.x != 0) return;
  *smid_out = probe::SmId();
  for (int pass = 0; pass < 2; ++pass) {
    uint16_t* out = pass == 0 ? miss : hit;
    uint64_t carry = 0;
    for (int i = 0; i < kLines; ++i) {
      out[i] = probe::TimedLoad(reinterpret_cast<const uint64_t*>(base + offs[i] + carry), carry,
                                reinterpret_cast<volatile uint64_t*>(&offs[kLines]));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: l2_side_probe OUT.bin\n");
    return 1;
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t bytes = kPage * (kPagesB + 1);
  uint8_t* raw;
  CHECK(cudaMalloc(&raw, bytes + kPage));
  CHECK(cudaMemset(raw, 0, bytes + kPage));
  uint8_t* base = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(raw) + kPage - 1) & ~static_cast<uintptr_t>(kPage - 1));
  std::vector<int64_t> offsets(kLines);
  for (int i = 0; i < kLinesA; ++i) offsets[i] = int64_t{i} * 128;
  for (int p = 0; p < kPagesB; ++p) offsets[kLinesA + p] = kPage * (p + 1);
  int64_t* d_offsets;
  CHECK(cudaMalloc(&d_offsets, kLines * sizeof(int64_t)));
  CHECK(cudaMemcpy(d_offsets, offsets.data(), kLines * sizeof(int64_t), cudaMemcpyHostToDevice));
  const probe::L2Flush flush;
  int* d_smid;
  uint16_t *d_miss, *d_hit;
  CHECK(cudaMalloc(&d_smid, sms * sizeof(int)));
  CHECK(cudaMemset(d_smid, 0xff, sms * sizeof(int)));
  CHECK(cudaMalloc(&d_miss, int64_t{sms} * kLines * 2));
  CHECK(cudaMalloc(&d_hit, int64_t{sms} * kLines * 2));
  // One CTA an SM: shared memory past half of an SM's keeps a second CTA off it.
  const int smem = 120 * 1024;
  CHECK(cudaFuncSetAttribute(ChaseKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int s = 0; s < sms; ++s) {
    flush.Run(sms);
    ChaseKernel<<<sms, 32, smem>>>(base, d_offsets, s, d_smid + s, d_miss + int64_t{s} * kLines,
                                   d_hit + int64_t{s} * kLines);
    CHECK(cudaGetLastError());
  }
  CHECK(cudaDeviceSynchronize());
  std::vector<int> smid(sms);
  std::vector<uint16_t> miss(int64_t{sms} * kLines), hit(int64_t{sms} * kLines);
  CHECK(cudaMemcpy(smid.data(), d_smid, sms * sizeof(int), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(miss.data(), d_miss, miss.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hit.data(), d_hit, hit.size() * 2, cudaMemcpyDeviceToHost));
  FILE* f = std::fopen(argv[1], "wb");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", argv[1]);
    return 1;
  }
  const int32_t header[2] = {sms, kLines};
  std::fwrite(header, sizeof header, 1, f);
  std::fwrite(smid.data(), sizeof(int), sms, f);
  std::fwrite(offsets.data(), sizeof(int64_t), kLines, f);
  std::fwrite(miss.data(), 2, miss.size(), f);
  std::fwrite(hit.data(), 2, hit.size(), f);
  std::fclose(f);
  int missing = 0;
  for (int s = 0; s < sms; ++s) missing += smid[s] != s;
  std::printf("%d SMs, %d lines a SM; %d SMs found no CTA of theirs\n", sms, kLines, missing);
  return 0;
}
