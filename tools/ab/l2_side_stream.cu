// Does reading memory from the L2 partition it is homed in stream faster? tools/ab/l2_side_probe.cu
// found the H200's SMs in two groups of 66 and each 4 KB of memory homed on one side (by the
// physical page above 2 MB), and Nsight Compute the link between the sides 90-97% busy in
// plain HBM streams (docs/performance.md, The link between the two L2 partitions). Here, on a
// 1 GB buffer:
//   1. the SMs' sides: each SM times L2 misses on the first line of 512 consecutive 4 KB
//      granules; an SM is on SM 0's side if its latencies, centred per granule, correlate
//      positively with SM 0's;
//   2. each granule's side: SM 0 and an SM of the other side each time a miss on its first
//      line (the buffer in chunks, a read of 256 MB between passes so that they miss);
//   3. a read of the whole buffer by one CTA an SM, 16-byte loads, 128 KB in flight an SM, the
//      granules dealt out (a) in order to all CTAs, (b) each side's granules to that side's
//      CTAs (near), (c) each side's granules to the other side's CTAs (far): the same bytes,
//      TB/s as the median of REPS (default 9) launches of each, taken in turn.
// Build: nvcc -std=c++17 -arch=sm_90a -O3 -o runs/probe/l2_side_stream tools/ab/l2_side_stream.cu
// Run: runs/probe/l2_side_stream
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "probe.cuh"

namespace {

constexpr int64_t kGranule = 4096;
constexpr int64_t kBufferBytes = int64_t{1} << 30;
constexpr int kGranules = static_cast<int>(kBufferBytes / kGranule);
constexpr int kGroupGranules = 512;   // step 1
constexpr int kChunk = 8192;          // step 2: granules a pass
constexpr int kStreamThreads = 512;   // step 3: a CTA an SM
constexpr int kUnroll = 16;           // 16-byte loads in flight a thread: 128 KB a CTA


// The CTA on SM `target` (one CTA an SM) times a load of the first line of granules first,
// first + 1, ..., first + count - 1 of `base`, each waiting for the one before.
__global__ void __launch_bounds__(32) ChaseKernel(const uint8_t* base, int first, int count,
                                                  int target, uint16_t* lat) {
  __shared__ uint64_t sink;
  if (probe::SmId() != target || threadIdx.x != 0) return;
  uint64_t carry = 0;
  for (int i = 0; i < count; ++i) {
    lat[i] = probe::TimedLoad(
        reinterpret_cast<const uint64_t*>(base + int64_t{first + i} * kGranule + carry), carry,
        &sink);
  }
}

// Step 3. lists[side] holds that side's granules; a CTA on side s (side_of[smid]) at rank
// rank_of[smid] among the CTAs of its side reads granules list[rank], list[rank + count], ...
// (count: the CTAs of its side) of its side's list, or with swap = 1 of the other side's. The
// stream in order passes one list of all granules as side 0's, every CTA on side 0 at rank
// smid, count the SMs.
__global__ void __launch_bounds__(kStreamThreads, 1)
    StreamKernel(const uint4* base, const int32_t* list0, int n0, const int32_t* list1, int n1,
                 const int8_t* side_of, const int16_t* rank_of, int count0, int count1,
                 int swap, uint32_t* sink) {
  const int sm = probe::SmId();
  const int side = side_of[sm] ^ swap;
  const int32_t* list = side ? list1 : list0;
  const int n = side ? n1 : n0;
  const int count = (side_of[sm] ? count1 : count0);
  const int rank = rank_of[sm];
  constexpr int kPerGranule = kGranule / 16;                    // 256 uint4
  constexpr int kGranulesAStep = kStreamThreads / kPerGranule;  // 2
  const int lane = threadIdx.x % kPerGranule, row = threadIdx.x / kPerGranule;
  uint32_t acc = 0;
  // Granule j of this CTA is list[rank + j * count]; a step covers kUnroll * 2 of them.
  const int mine = n > rank ? (n - rank + count - 1) / count : 0;
  constexpr int kStep = kUnroll * kGranulesAStep;
  const int full = mine / kStep * kStep;
  for (int j0 = 0; j0 < full; j0 += kStep) {  // all kUnroll loads issued before any is used
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int g = list[rank + int64_t{j0 + u * kGranulesAStep + row} * count];
      v[u] = __ldcg(base + int64_t{g} * kPerGranule + lane);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (int j = full + row; j < mine; j += kGranulesAStep) {
    const uint4 v = __ldcg(base + int64_t{list[rank + int64_t{j} * count]} * kPerGranule + lane);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

}  // namespace

int main() {
  const int reps = std::getenv("REPS") ? std::atoi(std::getenv("REPS")) : 9;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint8_t* base;
  CHECK(cudaMalloc(&base, kBufferBytes));
  CHECK(cudaMemset(base, 0, kBufferBytes));
  const probe::L2Flush flush;
  const int chase_smem = 120 * 1024;  // one CTA an SM
  CHECK(cudaFuncSetAttribute(ChaseKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             chase_smem));
  uint16_t* d_lat;
  CHECK(cudaMalloc(&d_lat, int64_t{std::max(sms * kGroupGranules, kGranules)} * 2));
  auto chase = [&](int first, int count, int target, uint16_t* out) {
    flush.Run(sms);
    ChaseKernel<<<sms, 32, chase_smem>>>(base, first, count, target, out);
    CHECK(cudaGetLastError());
  };

  // 1. The SMs' sides.
  for (int s = 0; s < sms; ++s) chase(0, kGroupGranules, s, d_lat + s * kGroupGranules);
  std::vector<uint16_t> g(sms * kGroupGranules);
  CHECK(cudaMemcpy(g.data(), d_lat, g.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<double> centred(g.size());
  for (int i = 0; i < kGroupGranules; ++i) {
    double mean = 0;
    for (int s = 0; s < sms; ++s) mean += g[s * kGroupGranules + i];
    mean /= sms;
    for (int s = 0; s < sms; ++s)
      centred[s * kGroupGranules + i] = g[s * kGroupGranules + i] - mean;
  }
  std::vector<int8_t> side_of(sms);
  std::vector<int16_t> rank_of(sms);
  int count[2] = {0, 0}, other = -1;
  for (int s = 0; s < sms; ++s) {
    double dot = 0;
    for (int i = 0; i < kGroupGranules; ++i)
      dot += centred[s * kGroupGranules + i] * centred[i];
    side_of[s] = dot > 0 ? 0 : 1;
    rank_of[s] = static_cast<int16_t>(count[side_of[s]]++);
    if (side_of[s] == 1 && other < 0) other = s;
  }
  std::printf("SMs on SM 0's side: %d, on the other: %d (first: SM %d)\n", count[0], count[1],
              other);
  if (other < 0) return 1;

  // 2. Each granule's side, from SM 0 (side 0) and SM `other` (side 1).
  std::vector<uint16_t> lat0(kGranules), lat1(kGranules);
  for (int first = 0; first < kGranules; first += kChunk) {
    chase(first, kChunk, 0, d_lat);
    CHECK(cudaMemcpy(lat0.data() + first, d_lat, kChunk * 2, cudaMemcpyDeviceToHost));
    chase(first, kChunk, other, d_lat);
    CHECK(cudaMemcpy(lat1.data() + first, d_lat, kChunk * 2, cudaMemcpyDeviceToHost));
  }
  std::vector<int32_t> lists[2];
  std::vector<int> gap;
  for (int i = 0; i < kGranules; ++i) {
    lists[lat0[i] <= lat1[i] ? 0 : 1].push_back(i);
    gap.push_back(std::abs(int{lat0[i]} - int{lat1[i]}));
  }
  std::sort(gap.begin(), gap.end());
  std::printf("granules near side 0: %zu, side 1: %zu; |latency difference| clocks: 10th "
              "percentile %d, median %d\n",
              lists[0].size(), lists[1].size(), gap[gap.size() / 10], gap[gap.size() / 2]);
  std::vector<int32_t> all(kGranules);
  for (int i = 0; i < kGranules; ++i) all[i] = i;

  // 3. The streams.
  int32_t *d_all, *d_l0, *d_l1;
  int8_t* d_side;
  int16_t *d_rank, *d_rank_all;
  CHECK(cudaMalloc(&d_all, kGranules * 4));
  CHECK(cudaMalloc(&d_l0, lists[0].size() * 4 + 4));
  CHECK(cudaMalloc(&d_l1, lists[1].size() * 4 + 4));
  CHECK(cudaMalloc(&d_side, sms));
  CHECK(cudaMalloc(&d_rank, sms * 2));
  CHECK(cudaMalloc(&d_rank_all, sms * 2));
  CHECK(cudaMemcpy(d_all, all.data(), kGranules * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_l0, lists[0].data(), lists[0].size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_l1, lists[1].data(), lists[1].size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_side, side_of.data(), sms, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_rank, rank_of.data(), sms * 2, cudaMemcpyHostToDevice));
  std::vector<int16_t> rank_all(sms);
  for (int s = 0; s < sms; ++s) rank_all[s] = static_cast<int16_t>(s);
  CHECK(cudaMemcpy(d_rank_all, rank_all.data(), sms * 2, cudaMemcpyHostToDevice));
  std::vector<int8_t> zeros(sms, 0);
  int8_t* d_zero_side;
  CHECK(cudaMalloc(&d_zero_side, sms));
  CHECK(cudaMemcpy(d_zero_side, zeros.data(), sms, cudaMemcpyHostToDevice));
  const int stream_smem = 120 * 1024;
  CHECK(cudaFuncSetAttribute(StreamKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             stream_smem));
  const int n0 = static_cast<int>(lists[0].size()), n1 = static_cast<int>(lists[1].size());
  auto launch = [&](int mode) {
    if (mode == 0) {
      StreamKernel<<<sms, kStreamThreads, stream_smem>>>(
          reinterpret_cast<const uint4*>(base), d_all, kGranules, d_all, kGranules, d_zero_side,
          d_rank_all, sms, sms, 0, flush.sink);
    } else {
      StreamKernel<<<sms, kStreamThreads, stream_smem>>>(
          reinterpret_cast<const uint4*>(base), d_l0, n0, d_l1, n1, d_side, d_rank, count[0],
          count[1], mode == 2 ? 1 : 0, flush.sink);
    }
  };
  // Mode 2 hands side s's CTAs the other side's list: its count must be the CTAs reading it.
  if (count[0] != count[1])
    std::printf("(sides of %d and %d SMs: the far stream's CTAs take their list's share by "
                "their own side's count)\n", count[0], count[1]);
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms[3];
  for (int r = 0; r < reps; ++r) {
    for (int mode = 0; mode < 3; ++mode) {
      launch(mode);  // warm, so that the timed launch follows a busy GPU
      CHECK(cudaEventRecord(a));
      launch(mode);
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float t;
      CHECK(cudaEventElapsedTime(&t, a, b));
      ms[mode].push_back(t);
    }
  }
  CHECK(cudaGetLastError());
  const char* names[3] = {"granules in order to all SMs", "each side's granules to its own SMs",
                          "each side's granules to the other side's SMs"};
  for (int mode = 0; mode < 3; ++mode) {
    const float t = probe::Median(ms[mode]);
    std::printf("  %-46s %7.3f ms  %5.2f TB/s\n", names[mode], t, kBufferBytes / t / 1e9);
  }
  return 0;
}
