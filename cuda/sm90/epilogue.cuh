// GEMM epilogues. Outputs go through a swizzled shared-memory staging tile (each consumer
// warpgroup stages its own 64 rows): bf16 ones to TMA stores that the consumers do not wait for
// (the weight gradients stage their whole output tile for a storer thread to issue, the others
// 64 columns at a time), f32 ones to coalesced 16-byte global stores; the SwiGLU backward
// brings its gu in through it the same way.
#pragma once

#include <type_traits>
#include <utility>

#include <cute/tensor.hpp>

#include "gemm_config.cuh"
#include "mainloop.cuh"
#include "ptx.cuh"
#include "quantize.cuh"

namespace mok::sm90 {

// An IEEE division (FCHK, a slow path, a Newton step) per value would make the SwiGLU epilogue
// a tenth of a tile's time (ncu); __fdividef is one MUFU.RCP and a multiply (2 ulp).
// For g < -87, 1 + exp(-g) overflows and both give 0, as silu(g) and sigmoid(g) round to.
//
// exp(-g) is __expf's 2^(-g log2 e) with subnormal results flushed to zero (ex2.approx.ftz): one
// MUFU.EX2, where __expf adds a range check and two multiplies to keep them. The same bits: for
// g > 87 the flushed 2^(-g log2 e) is below half an ulp of 1, and 1 + it rounds to 1 either way.
__device__ __forceinline__ float ExpNeg(float g) { return Exp2Ftz(g * -1.4426950408889634f); }
__device__ __forceinline__ float Sigmoid(float g) { return __fdividef(1.0f, 1.0f + ExpNeg(g)); }
__device__ __forceinline__ float Silu(float g) { return __fdividef(g, 1.0f + ExpNeg(g)); }

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float2 UnpackBf16(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}

// Where accumulator value v of a consumer thread sits in its warpgroup's 64-row slab (the
// wgmma m64nNk16 D layout): row AccRow(t) + AccRowStep(v), columns AccCol(t) + AccColStep(v)
// and the one after. Spelled out so that every address is one per-thread base plus a
// compile-time offset: the persistent tile loop then keeps no per-value addresses live.
__device__ __forceinline__ int AccRow(int wg_thread) {
  return wg_thread / 32 * 16 + wg_thread % 32 / 4;
}
__device__ __forceinline__ int AccCol(int wg_thread) { return wg_thread % 4 * 2; }
constexpr int AccRowStep(int v) { return 8 * ((v >> 1) & 1); }
constexpr int AccColStep(int v) { return 8 * (v >> 2); }

// What a consumer warpgroup's accumulators hold of a tile: 64 rows from row0 and kCols =
// 2 size(acc) columns, all 256 of the tile's or (a split tile, MmaTileSplit) its part `part`.
struct WarpgroupPart {
  int64_t row0;
  int part;
};

template <class Accum>
constexpr int AccCols() {
  return 2 * decltype(cute::size(std::declval<Accum>()))::value;
}

// Where 16-byte chunk c of staging row r sits: at chunk c ^ (r % 8), so that the 8 rows of a
// warp's accumulator store and the 4 rows of a warp's 16-byte reads each meet 32 distinct banks.
__device__ __forceinline__ int StageIndex(int r, int chunk) {
  return r * kStageCols + ((chunk ^ (r % 8)) << 3);
}

// One staging pass over 64 of the tile's columns: pair(u) packs this thread's values u, u + 1
// of the pass (u = 4 chunk + 2 half: its row AccRow + 8 half, columns AccCol + 8 chunk of the
// pass); store(src) then has the warpgroup's first thread hand the staged (64 columns, 64 rows)
// box at shared address src to a TMA store, which the warpgroup does not wait for: the
// staging's 128-byte swizzle (StageIndex) is the tensor map's. The next pass (or tile) waits
// only until that store has read the staging.
template <class Pair, class Store>
__device__ __forceinline__ void StagePass(bf16_t* stage, int wg_thread, uint32_t barrier,
                                          Pair pair, Store store) {
  const int r0 = AccRow(wg_thread), c0 = AccCol(wg_thread);
  const uint32_t base = SmemAddr(stage);
  const bool storer = wg_thread == 0;
  if (storer) BulkWaitRead<0>();  // the last pass's store has read the staging
  NamedBarrierSync(barrier, 128);
  CUTE_UNROLL
  for (int chunk = 0; chunk < 8; ++chunk) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + 8 * half;
      StoreShared32(base + 2 * (StageIndex(r, chunk) + c0), pair(4 * chunk + 2 * half));
    }
  }
  FenceProxyAsyncShared();  // the writes, before the async proxy reads them
  NamedBarrierSync(barrier, 128);
  if (storer) {
    store(base);
    BulkCommitGroup();
  }
}

// kSwiGLU's gu (o0), when kept: the accumulators' gate columns [0, kCols / 2) to gu's columns
// col0 on, their up partners to n + col0 on, rounded to bf16, through the staging. gu null:
// gu is not kept (the forward with Config.recompute, or not differentiated), so its staging
// passes are skipped; h does not depend on them (it comes from the f32 accumulators).
template <class Accum>
__device__ __forceinline__ void StoreGu(const GemmParams& p, bf16_t* stage, int wg_thread,
                                        uint32_t barrier, int col0, int32_t row,
                                        const Accum& acc) {
  constexpr int kCols = AccCols<Accum>();
  constexpr int kHalfPasses = kCols / 2 / kStageCols;
  if (p.out0 == nullptr) return;
  CUTE_UNROLL
  for (int pass = 0; pass < kCols / kStageCols; ++pass) {
    const int col = col0 + (pass % kHalfPasses) * kStageCols;
    if (col >= p.n) continue;  // uniform
    const int half_base = pass < kHalfPasses ? 0 : p.n;  // gate or up half of a gu row
    StagePass(stage, wg_thread, barrier,
              [&](int u) { return PackBf16(acc(32 * pass + u), acc(32 * pass + u + 1)); },
              [&](uint32_t src) { TmaStore2d(&p.o0, src, half_base + col, row); });
  }
}

// bf16 tiles (kStore, kSwiGLU) through the staging tile, 64 columns at a time, as TMA stores of
// (64 columns, 64 rows) boxes (the tensor maps o0, o1: PrepareGemm). A warpgroup's 64 rows
// from row0 lie within its group's rows or not at all: groups start at multiples of block_m
// (64 or 128) and a tile's rows at multiples of 64 within its group, so a box never reaches
// into the next group's rows (rows past the tensor, the shared expert's last, are clipped).
// kLateAddresses hides the thread index from ptxas (Opaque), so that the staging addresses are
// computed here, each tile, rather than hoisted out of the tile loop and held across the
// k-loops: for the clustered launches, whose consumers have 224 registers, not 232, and would
// spill for them. Only those take it: the unclustered launches spill nothing, and there it
// costs qwen3_30b's forward-MLP launch about 2% on an H200 (6% more instructions).
//
// Against each thread's 16-byte copy-out of four staged rows, the TMA stores take up to about
// 1% off the forward-MLP launch on an H200. Most of what the copy-out costs (4.5% of that launch
// on gptoss_120b) stays with them, in their traffic or each pass's wait for its store to read
// the staging, not in a copy loop (docs/performance.md).
template <class Kind, bool kLateAddresses, class Smem, class Accum>
__device__ __forceinline__ void StageAndStore(const GemmParams& p, const GemmTile& tile,
                                              Smem& smem, int thread, WarpgroupPart part,
                                              const Accum& acc) {
  using C = GemmConfig;
  constexpr Epilogue kEpi = Kind::kEpi;
  constexpr int kCols = AccCols<Accum>();
  if constexpr (kLateAddresses) thread = Opaque(thread);
  const int wg = thread / 128, wg_thread = thread % 128;
  const uint32_t barrier = 2 + wg;
  bf16_t* stage = smem.stage[wg];
  if (part.row0 >= tile.m_end) return;  // uniform over the warpgroup: a half tile's other half
  const int32_t row = static_cast<int32_t>(part.row0);
  if constexpr (kEpi == Epilogue::kStore) {
    // One output (PrepareGemm: n_split = n).
    const int col0 = tile.n_tile * C::kBlockN + part.part * kCols;
    CUTE_UNROLL
    for (int pass = 0; pass < kCols / kStageCols; ++pass) {
      const int col = col0 + pass * kStageCols;
      if (col >= p.n) break;  // uniform: the columns past n of a narrow or last tile
      StagePass(stage, wg_thread, barrier,
                [&](int u) { return PackBf16(acc(32 * pass + u), acc(32 * pass + u + 1)); },
                [&](uint32_t src) { TmaStore2d(&p.o0, src, col, row); });
    }
  } else {
    static_assert(kEpi == Epilogue::kSwiGLU);
    // Accumulator columns [0, kCols / 2) are gate, the rest up: value v + kCols / 4 is the up
    // partner of gate value v. gu (o0) gets [g | u] (gate columns at col0, up columns at n +
    // col0), h (o1) gets silu(g) * u from the f32 values.
    constexpr int kHalfPasses = kCols / 2 / kStageCols;
    constexpr int kUp = kCols / 4;
    const int col0 = tile.n_tile * (C::kBlockN / 2) + part.part * (kCols / 2);
    StoreGu(p, stage, wg_thread, barrier, col0, row, acc);
    CUTE_UNROLL
    for (int pass = 0; pass < kHalfPasses; ++pass) {
      const int col = col0 + pass * kStageCols;
      if (col >= p.n) break;  // uniform
      StagePass(stage, wg_thread, barrier,
                [&](int u) {
                  const int v = 32 * pass + u;
                  return PackBf16(Silu(acc(v)) * acc(v + kUp), Silu(acc(v + 1)) * acc(v + kUp + 1));
                },
                [&](uint32_t src) { TmaStore2d(&p.o1, src, col, row); });
    }
  }
}

// The SwiGLU backward (kSwiGLUBwd), 32 of the tile's columns per pass through the warpgroup's
// staging tile, whose three regions hold g, u and h: g and u come in with coalesced 16-byte
// loads issued two passes ahead; each thread computes at its accumulator positions from shared
// memory, writes dg and du over the g and u it read and h beside them; then all three leave with
// coalesced 16-byte stores. Shared-memory accesses are volatile asm, kept in program order: each
// step issues all of its loads before it uses any, so that their latencies overlap.
//
// With row_scale (the routed MLP) the tile is each row's dh before its route's weight w (A is
// dy gathered, unscaled): the row's share of dweights, <dh, h> (h = silu(g) u in f32) over each
// 128 columns, goes to dw_parts (each thread's sums a pass, its quad's by a fixed butterfly,
// then the passes': the same bits whatever the tile's shape), and the epilogue goes on with
// w dh, storing w h for dw_down's A (GemmParams). Without it (the shared expert) w is 1.
//
// The sums cost registers where the accumulators and the g, u two passes ahead fill the 168 a
// thread: summing each thread's values over 128 columns before the butterfly would spill 72-196
// bytes, some in the k-loop, and <dh, round(h)> would take an unpack more a value; as here 4-12
// bytes spill, outside the loops.
//
// dgu may be gu itself (mok_jax.ops.bwd_aliases): a thread reads each 16-byte chunk of g and u
// before it writes dg or du there, and no other thread reads that chunk, so no load (the
// read-only path's included) sees a chunk after its store.
//
// Why staged, with all of a step's loads first: done from registers, with 4-byte loads and
// stores at the accumulator positions, this epilogue would take twice the mainloop's time on
// qwen3_30b (ncu: 70% of the samples outside the mainloop, waiting on gu); staged value by value
// (each value's loads behind the stores of the one before, g and u one pass ahead), a third of
// the launch, mostly in short-scoreboard and fixed-latency waits on those chains. On an H200
// this form takes the SwiGLU backward's launch 3.5-7% less than value by value on the four
// bench shapes (docs/performance.md).

// Where a consumer thread's 16-byte copies of the SwiGLU backward's passes lie (32 columns a
// pass): chunk cc of rows r1 and r1 + 32 of its warpgroup's 64-row slab, of g and of u (q = 0,
// 1: g; 2, 3: u) in gu, and the same in dgu and h. Once a tile, not at each copy.
struct SwiGLUBwdCopies {
  static constexpr int kCols = 32;
  int r1, cc, col0;  // col0: this thread's chunk, pass 0
  bool row_in[2];
  int64_t gu_at[2];  // element offsets of rows r1, r1 + 32 in gu and dgu (the same layout)
  int64_t h_at[2];   // and in h

  __device__ __forceinline__ SwiGLUBwdCopies(const GemmParams& p, const GemmTile& tile,
                                             int wg_thread, WarpgroupPart part, int acc_cols) {
    r1 = wg_thread / 4, cc = wg_thread % 4;
    const int64_t row0 = part.row0, two_n = 2 * int64_t{p.n};
    row_in[0] = row0 + r1 < tile.m_end, row_in[1] = row0 + r1 + 32 < tile.m_end;
    col0 = tile.n_tile * GemmConfig::kBlockN + part.part * acc_cols + 8 * cc;
    gu_at[0] = (row0 + r1) * two_n + col0, gu_at[1] = (row0 + r1 + 32) * two_n + col0;
    h_at[0] = (row0 + r1) * p.n + col0, h_at[1] = (row0 + r1 + 32) * p.n + col0;
  }
  __device__ __forceinline__ bool col_in(const GemmParams& p, int pass) const {
    return col0 + kCols * pass < p.n;
  }
  // Pass `pass`'s g and u.
  __device__ __forceinline__ void Load(const GemmParams& p, int pass, uint4 (&in)[4]) const {
    const bool cols = col_in(p, pass);
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
      in[q] = row_in[q & 1] && cols
                  ? __ldg(reinterpret_cast<const uint4*>(p.aux + gu_at[q & 1] + (q >> 1) * p.n +
                                                         kCols * pass))
                  : make_uint4(0, 0, 0, 0);
    }
  }
};

// The first two passes' g and u of a full tile's warpgroup slab, loaded before its MMAs so that
// the epilogue finds them in registers (SwiGLUBwdStaged's `ahead`).
__device__ __forceinline__ void SwiGLUBwdLoadAhead(const GemmParams& p, const GemmTile& tile,
                                                   int thread, WarpgroupPart part,
                                                   uint4 (&ahead)[2][4]) {
  const SwiGLUBwdCopies copies(p, tile, thread % 128, part, GemmConfig::kBlockN);
  copies.Load(p, 0, ahead[0]);
  copies.Load(p, 1, ahead[1]);
}

template <class Smem, class Accum>
__device__ __forceinline__ void SwiGLUBwdStaged(const GemmParams& p, const GemmTile& tile,
                                                Smem& smem, int thread, WarpgroupPart part,
                                                const Accum& acc,
                                                const uint4 (*ahead)[4] = nullptr) {
  // g (then dg), u (then du) and h, 64 rows x 32 columns each, fill the 12 KB staging tile.
  constexpr int kCols = SwiGLUBwdCopies::kCols;
  constexpr int kPasses = AccCols<Accum>() / kCols;
  constexpr uint32_t kRegionBytes = kWarpgroupRows * kCols * 2;
  static_assert(sizeof(smem.stage[0]) == 3 * kRegionBytes, "g, u and h");
  static_assert(kPasses % 4 == 0, "whole 128-column parts of dweights");
  const int wg = thread / 128, wg_thread = thread % 128;
  const uint32_t barrier = 2 + wg;
  const uint32_t g_s = SmemAddr(smem.stage[wg]);
  const uint32_t u_s = g_s + kRegionBytes, h_s = u_s + kRegionBytes;
  auto* dgu = static_cast<__nv_bfloat16*>(p.out0);
  auto* h = static_cast<__nv_bfloat16*>(p.out1);
  const SwiGLUBwdCopies copies(p, tile, wg_thread, part, AccCols<Accum>());
  const int r1 = copies.r1, cc = copies.cc;
  const int r0 = AccRow(wg_thread), c0 = AccCol(wg_thread);
  // This thread's rows r0 and r0 + 8: their routes' weights and sums of <dh, h> so far.
  // A padding row (no route) gets zero dg, du and h whatever its g and u hold, so that the
  // weight gradients, which reduce over padding rows, never meet a value of gu that no route
  // defines.
  const bool scaled = p.row_scale != nullptr;
  float w[2] = {1.0f, 1.0f}, dot[2] = {0.0f, 0.0f}, part_sum = 0.0f;
  uint32_t keep[2] = {~0u, ~0u};
  if (scaled) {
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      const int64_t row = part.row0 + r0 + 8 * i;
      const int32_t route = row < tile.m_end ? __ldg(p.row_tokens + row) : -1;
      w[i] = route >= 0 ? __ldg(p.row_scale + route) : 0.0f;
      keep[i] = route >= 0 ? ~0u : 0u;
    }
  }
  // Byte offset of element (row, 8 chunk) of a (64, 32) array: chunks swizzled by row / 2, so
  // that both the 16-byte copies and the 4-byte accesses at accumulator positions are free of
  // bank conflicts.
  auto at = [](int row, int chunk) {
    return static_cast<uint32_t>(2 * (row * kCols + ((chunk ^ ((row >> 1) & 3)) << 3)));
  };
  // g and u two passes ahead: in[pass % 2] holds pass `pass`'s (the first two from `ahead`,
  // loaded before the tile's MMAs, where given).
  uint4 in[2][4];
  CUTE_UNROLL
  for (int pass = 0; pass < 2 && pass < kPasses; ++pass) {
    if (ahead) {
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) in[pass][q] = ahead[pass][q];
    } else {
      copies.Load(p, pass, in[pass]);
    }
  }
  CUTE_UNROLL
  for (int pass = 0; pass < kPasses; ++pass) {
    const bool col_in = copies.col_in(p, pass);
    NamedBarrierSync(barrier, 128);  // the warpgroup's copies out of the last pass are done
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q)
      StoreShared128((q >> 1 ? u_s : g_s) + at(r1 + 32 * (q & 1), cc), in[pass % 2][q]);
    if (pass + 2 < kPasses) copies.Load(p, pass + 2, in[pass % 2]);  // in flight two passes
    NamedBarrierSync(barrier, 128);
    uint32_t a[8], gv[8], uv[8];  // this thread's values v, v + 1 of the pass, j = 0..7
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) {
      const int v = 16 * pass + 2 * j;
      a[j] = at(r0 + AccRowStep(v), AccColStep(v) / 8 - 4 * pass) + 2 * c0;
      gv[j] = LoadShared32(g_s + a[j]);
      uv[j] = LoadShared32(u_s + a[j]);
    }
    uint32_t dg_bits[8], du_bits[8], h_bits[8];
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) {
      const int v = 16 * pass + 2 * j;
      const float2 g = UnpackBf16(gv[j]), u = UnpackBf16(uv[j]);
      const float dh0 = w[j & 1] * acc(v), dh1 = w[j & 1] * acc(v + 1);
      const float s0 = Sigmoid(g.x), s1 = Sigmoid(g.y);
      const float silu0 = g.x * s0, silu1 = g.y * s1;
      // d silu / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
      dg_bits[j] = keep[j & 1] & PackBf16(dh0 * u.x * s0 * (1.0f + g.x * (1.0f - s0)),
                                          dh1 * u.y * s1 * (1.0f + g.y * (1.0f - s1)));
      du_bits[j] = keep[j & 1] & PackBf16(dh0 * silu0, dh1 * silu1);
      const float h0 = silu0 * u.x, h1 = silu1 * u.y;
      h_bits[j] = keep[j & 1] & PackBf16(w[j & 1] * h0, w[j & 1] * h1);  // w = 1: h's bits
      dot[j & 1] = fmaf(acc(v), h0, dot[j & 1]);
      dot[j & 1] = fmaf(acc(v + 1), h1, dot[j & 1]);
    }
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) {  // each thread rewrites only the positions it read
      StoreShared32(g_s + a[j], dg_bits[j]);
      StoreShared32(u_s + a[j], du_bits[j]);
    }
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) StoreShared32(h_s + a[j], h_bits[j]);
    if (scaled) {
      // The pass's sums of the quad's rows r0 (c0 = 0, 2 keep it) and r0 + 8 (c0 = 4, 6).
      CUTE_UNROLL
      for (int i = 0; i < 2; ++i) {
        dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], 1);
        dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], 2);
      }
      part_sum += c0 < 4 ? dot[0] : dot[1];
      dot[0] = dot[1] = 0.0f;
      if (pass % 4 == 3) {  // the end of 128 columns
        const int col = tile.n_tile * GemmConfig::kBlockN + part.part * AccCols<Accum>() +
                        kCols * (pass - 3);
        const int64_t row = part.row0 + r0 + (c0 < 4 ? 0 : 8);
        if (c0 % 4 == 0 && row < tile.m_end && col < p.n)
          p.dw_parts[row * p.dw_part_cols + col / 128] = part_sum;
        part_sum = 0.0f;
      }
    }
    NamedBarrierSync(barrier, 128);
    uint4 out[6];  // q = 0, 1: dg; 2, 3: du; 4, 5: h
    CUTE_UNROLL
    for (int q = 0; q < 6; ++q)
      out[q] = LoadShared128(g_s + (q >> 1) * kRegionBytes + at(r1 + 32 * (q & 1), cc));
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
      if (copies.row_in[q & 1] && col_in)
        StoreGlobal128(dgu + copies.gu_at[q & 1] + (q >> 1) * p.n + kCols * pass, out[q]);
    }
    CUTE_UNROLL
    for (int q = 0; q < 2; ++q) {
      if (copies.row_in[q] && col_in)
        StoreGlobal128(h + copies.h_at[q] + kCols * pass, out[4 + q]);
    }
  }
}

// kTmaStore (the weight gradients): a consumer warpgroup's 64-row slab of the tile, rounded to
// bf16, goes into its staging as eight (32 columns, 64 rows) boxes laid out as TMA writes them
// with the 64-byte swizzle; the warpgroup then hands the slab to its storer, a thread of the
// producer warpgroup, which issues the eight TMA stores and waits until they have read the
// staging, while the warpgroup goes straight on to its next tile's MMAs. It waits for that
// read only at its next epilogue, before it writes the staging again.
//
// On an H200 a storer thread, rather than the warpgroup's first thread, issuing the stores takes
// about 13% off gptoss_120b's weight-gradient launch; the storer warps copying the slab out with
// 16-byte st.global (a warp a row's 512 bytes) instead of TMA stores would cost dsv3's launch
// about 20% (docs/performance.md).
struct SlabJob {
  int32_t slot;    // the chain slot whose o0 / o1 take the slab; -1: the chain has ended
  int32_t row;     // the slab's first row in o0 / o1 (group * m + the slab's row in the group)
  int32_t n_tile;
};
struct SlabHandoff {
  SlabJob job[GemmConfig::kConsumerWarpgroups];
  uint64_t staged[GemmConfig::kConsumerWarpgroups];  // the warpgroup wrote job and its slab
  uint64_t stored[GemmConfig::kConsumerWarpgroups];  // the storer's stores have read the slab
};

constexpr int kSlabBoxes = GemmConfig::kBlockN / kTmaStoreCols;
constexpr uint32_t kSlabBoxBytes = kWarpgroupRows * kTmaStoreCols * 2;  // 4 KB, 512-aligned

// The consumer warpgroup's side. `posted`: the slabs this warpgroup has handed over in this
// chain (the same in all its threads). A slab at or past m_end (rows past the gradient's m, the
// next group's) has nothing to store; rows and columns past the tensor are clipped by TMA.
template <class Smem, class Accum>
__device__ __forceinline__ void StageSlab(const GemmParams& p, const GemmTile& tile, Smem& smem,
                                          int thread, WarpgroupPart part, const Accum& acc,
                                          SlabHandoff& handoff, uint32_t& posted, int slot) {
  static_assert(sizeof(smem.stage[0]) == kSlabBoxes * kSlabBoxBytes, "a warpgroup's whole slab");
  static_assert(AccCols<Accum>() == GemmConfig::kBlockN, "weight-gradient tiles are never split");
  const int wg = thread / 128, wg_thread = thread % 128;
  const uint32_t barrier = 2 + wg;
  const int64_t row0 = part.row0;
  if (row0 >= tile.m_end) return;  // uniform over the warpgroup
  const uint32_t base = SmemAddr(smem.stage[wg]);
  // stmatrix q of 16 writes the thread's values 8 q .. 8 q + 7: the 8-column groups 2 q and
  // 2 q + 1 (matrices 0, 1: rows 0-7 and 8-15 of the warp's 16 of group 2 q; 2, 3: of 2 q + 1).
  // This lane gives the address of row `row` (of the warpgroup's 64) of group 2 q + hi: box
  // q / 2 (32 columns), 16-byte chunk 2 (q % 2) + hi XORed with (row / 2) % 4
  // (CU_TENSOR_MAP_SWIZZLE_64B). Each matrix's eight rows meet 32 distinct banks.
  const int lane = wg_thread % 32, matrix = lane / 8;
  const int row = wg_thread / 32 * 16 + (matrix & 1) * 8 + lane % 8, hi = matrix >> 1;
  const uint32_t row_base = base + static_cast<uint32_t>(row * 64);
  const uint32_t even = static_cast<uint32_t>(((hi ^ (row >> 1)) & 3) << 4);
  const uint32_t odd = static_cast<uint32_t>((((2 + hi) ^ (row >> 1)) & 3) << 4);
  // The storer's stores of the last slab have read the staging (its arrival releases what its
  // wait for their reads acquired; the named barrier passes that on to the warpgroup).
  if (wg_thread == 0 && posted > 0) BarrierWaitLean(&handoff.stored[wg], (posted - 1) & 1);
  NamedBarrierSync(barrier, 128);
  CUTE_UNROLL
  for (int q = 0; q < 16; ++q) {
    const int v = 8 * q;
    StoreMatrixX4(row_base + q / 2 * kSlabBoxBytes + (q % 2 ? odd : even),
                  PackBf16(acc(v), acc(v + 1)), PackBf16(acc(v + 2), acc(v + 3)),
                  PackBf16(acc(v + 4), acc(v + 5)), PackBf16(acc(v + 6), acc(v + 7)));
  }
  FenceProxyAsyncShared();  // the writes, before the async proxy reads them
  NamedBarrierSync(barrier, 128);
  if (wg_thread == 0) {
    handoff.job[wg] = {slot, static_cast<int32_t>(int64_t{tile.group} * p.m + row0),
                       tile.n_tile};
    BarrierArrive(&handoff.staged[wg]);
  }
  ++posted;
}

// After a warpgroup's last tile of the chain: tells its storer that no slab follows (once the
// storer has taken the last one, which frees the job record), and returns once the storer's
// stores have read the staging.
__device__ __forceinline__ void EndSlabs(SlabHandoff& handoff, int wg, uint32_t posted) {
  if (posted > 0) BarrierWaitLean(&handoff.stored[wg], (posted - 1) & 1);
  handoff.job[wg].slot = -1;
  BarrierArrive(&handoff.staged[wg]);
}

// The storer's side, for one slab: its eight boxes to o0 / o1, then the wait for their reads.
__device__ __forceinline__ void StoreSlab(const GemmParams& p, const SlabJob& job,
                                          uint32_t base) {
  CUTE_UNROLL
  for (int b = 0; b < kSlabBoxes; ++b) {
    // Boxes never straddle n_split (a multiple of 64).
    const int32_t col = job.n_tile * GemmConfig::kBlockN + kTmaStoreCols * b;
    if (col < p.n_split) TmaStore2d(&p.o0, base + b * kSlabBoxBytes, col, job.row);
    else if (col < p.n) TmaStore2d(&p.o1, base + b * kSlabBoxBytes, col - p.n_split, job.row);
  }
  BulkCommitGroup();
  BulkWaitRead<0>();
}

// A tail tile's tail (kTail; TailMma): warpgroup wg's two transposed 64 x kTailRows panels, in
// bf16, stored a value at a time (kTailRows rows, a few KB a tile). The padding rows after the
// group's last tail, up to m_end, then get zeros (ZeroTailPadding) in every output of the
// tile's columns, as the padding rows of a tile that multiplies them (zero rows of A) would: the
// backward reads gu and h of padding rows, and multiplies them by zero.
template <class Kind, class TailAcc>
__device__ __forceinline__ void StoreTail(const GemmParams& p, const GemmTile& tile, int thread,
                                          const TailAcc& acc0, const TailAcc& acc1) {
  using C = GemmConfig;
  const int wg = thread / 128, wg_thread = thread % 128;
  // This thread's values: tail rows c0 + AccColStep(v) + v % 2, panel columns r0 +
  // AccRowStep(v); one base per output and compile-time steps from it.
  const int64_t row0 = tile.m0 + tile.tail_at + AccCol(wg_thread);
  const int r0 = AccRow(wg_thread);
  auto* out0 = static_cast<__nv_bfloat16*>(p.out0);
  auto* out1 = static_cast<__nv_bfloat16*>(p.out1);
  if constexpr (Kind::kEpi == Epilogue::kSwiGLU) {
    // gu = [g | u] (null: not kept), h = silu(g) * u from the f32 values.
    const int c0 = tile.n_tile * (C::kBlockN / 2) + 64 * wg + r0;
    const int64_t pitch = p.n;
    __nv_bfloat16* h = out1 + row0 * pitch + c0;
    __nv_bfloat16* gu = out0 ? out0 + row0 * 2 * pitch + c0 : nullptr;
    CUTE_UNROLL
    for (int v = 0; v < 8; ++v) {
      if (c0 + AccRowStep(v) >= p.n) continue;
      const int64_t at = (AccColStep(v) + v % 2) * pitch + AccRowStep(v);
      const float g = acc0(v), u = acc1(v);
      if (gu) {
        gu[2 * at - AccRowStep(v)] = __float2bfloat16_rn(g);
        gu[2 * at - AccRowStep(v) + pitch] = __float2bfloat16_rn(u);
      }
      h[at] = __float2bfloat16_rn(Silu(g) * u);
    }
  } else {
    // kStore: out0 | out1 at n_split.
    static_assert(Kind::kEpi == Epilogue::kStore);
    const int64_t pitch = p.n_split;
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      // Panels never straddle n_split (a multiple of 64).
      const int c0 = tile.n_tile * C::kBlockN + 64 * (wg + 2 * half) + r0;
      if (c0 - r0 >= p.n) continue;
      __nv_bfloat16* out = c0 < p.n_split ? out0 + row0 * pitch + c0
                                          : out1 + row0 * pitch + (c0 - p.n_split);
      CUTE_UNROLL
      for (int v = 0; v < 8; ++v)
        out[(AccColStep(v) + v % 2) * pitch + AccRowStep(v)] =
            __float2bfloat16_rn(half ? acc1(v) : acc0(v));
    }
  }
}

// After the group's last tail's other stores (StoreTail): zeros, 16 bytes a store, over both
// warpgroups, in the rows after that tail up to m_end, of the tile's chunks of 8 columns
// (kSwiGLU: of h, and of g and u in gu).
template <class Kind>
__device__ __forceinline__ void ZeroTailPadding(const GemmParams& p, const GemmTile& tile,
                                                int thread) {
  using C = GemmConfig;
  constexpr Epilogue kEpi = Kind::kEpi;
  auto* out0 = static_cast<__nv_bfloat16*>(p.out0);
  auto* out1 = static_cast<__nv_bfloat16*>(p.out1);
  const int64_t zero0 = tile.m0 + tile.tail_at + kTailRows;
  constexpr int kTileCols = kEpi == Epilogue::kSwiGLU ? C::kBlockN / 2 : C::kBlockN;
  constexpr int kChunkCols = 8;  // bf16
  constexpr int kChunks = kTileCols / kChunkCols;
  const int cells = static_cast<int>(tile.m_end - zero0) * kChunks;  // under 128 rows' worth
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int i = thread; i < cells; i += 128 * C::kConsumerWarpgroups) {
    const int64_t row = zero0 + i / kChunks;
    const int64_t c = int64_t{tile.n_tile} * kTileCols + kChunkCols * (i % kChunks);
    if (c >= p.n) continue;
    if constexpr (kEpi == Epilogue::kSwiGLU) {
      if (out0) {
        StoreGlobal128(out0 + row * 2 * p.n + c, zero);
        StoreGlobal128(out0 + row * 2 * p.n + p.n + c, zero);
      }
      StoreGlobal128(out1 + row * p.n + c, zero);
    } else {  // kStore
      if (c < p.n_split) StoreGlobal128(out0 + row * p.n_split + c, zero);
      else StoreGlobal128(out1 + row * p.n_split + c - p.n_split, zero);
    }
  }
}

// The FP8 forward's gate|up epilogue (kSwiGLU with kFp8): gu if kept (StoreGu), then
// h = silu(g) * u from the f32 g, u,
// quantized in 1 x 128 blocks along I (quantize.cuh), the down GEMM's A. A column tile's 128 h
// columns are one block, whose amax over a row is a butterfly over the quad of threads that
// hold the row. The warpgroup's 64 rows go out as one (128 bytes, 64 rows) TMA box of e4m3
// through its staging (the box's 128-byte swizzle), not waited for, as StagePass's; each row's
// scale with a plain store (published with the rows, RunConsumerFp8).
template <class Smem, class Accum>
__device__ __forceinline__ void StoreSwiGLUFp8(const GemmParams& p, const GemmTile& tile,
                                               Smem& smem, int thread, WarpgroupPart part,
                                               const Accum& acc) {
  static_assert(AccCols<Accum>() == GemmConfig::kBlockN, "FP8 tiles are never split");
  constexpr int kUp = AccCols<Accum>() / 4;  // value v + kUp is gate value v's up partner
  const int wg = thread / 128, wg_thread = thread % 128;
  const uint32_t barrier = 2 + wg;
  if (part.row0 >= tile.m_end) return;  // uniform over the warpgroup
  StoreGu(p, smem.stage[wg], wg_thread, barrier, tile.n_tile * kFp8Block,
          static_cast<int32_t>(part.row0), acc);
  const int r0 = AccRow(wg_thread), c0 = AccCol(wg_thread);
  float h[kUp];
  float amax[2] = {0.0f, 0.0f};  // rows r0, r0 + 8
  CUTE_UNROLL
  for (int v = 0; v < kUp; ++v) {
    h[v] = Silu(acc(v)) * acc(v + kUp);
    amax[(v >> 1) & 1] = MaxNaN(amax[(v >> 1) & 1], fabsf(h[v]));
  }
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    amax[i] = MaxNaN(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], 1));
    amax[i] = MaxNaN(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], 2));
  }
  const float scale[2] = {BlockScale(amax[0]), BlockScale(amax[1])};
  const uint32_t base = SmemAddr(smem.stage[wg]);
  if (wg_thread == 0) BulkWaitRead<0>();  // the last store has read the staging
  NamedBarrierSync(barrier, 128);
  CUTE_UNROLL
  for (int j = 0; j < kUp / 4; ++j) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      // Values v, v + 1: row r0 + 8 half, columns (bytes) c0 + 8 j and the one after.
      const int v = 4 * j + 2 * half, r = r0 + 8 * half, col = c0 + 8 * j;
      StoreShared16(base + r * kFp8Block + (((col >> 4) ^ (r % 8)) << 4) + (col & 15),
                    E4m3Pair(h[v], h[v + 1], scale[half]));
    }
  }
  FenceProxyAsyncShared();  // the writes, before the async proxy reads them
  NamedBarrierSync(barrier, 128);
  if (wg_thread == 0) {
    TmaStore2d(&p.o1, base, tile.n_tile * kFp8Block, static_cast<int32_t>(part.row0));
    BulkCommitGroup();
  }
  if (c0 == 0) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int64_t row = part.row0 + r0 + 8 * half;
      if (row < tile.m_end) p.h_scale[tile.n_tile * p.h_scale_pitch + row] = scale[half];
    }
  }
}

// thread: index among the 256 consumer threads; acc: its warpgroup's part of the tile.
// gu_ahead: kSwiGLUBwd, the first two passes' g and u if loaded before the MMAs
// (SwiGLUBwdLoadAhead), else null.
template <class Kind, bool kLateAddresses = false, class Smem, class Accum>
__device__ __forceinline__ void StoreTile(const GemmParams& p, const GemmTile& tile,
                                          Smem& smem, int thread, WarpgroupPart part,
                                          const Accum& acc,
                                          const uint4 (*gu_ahead)[4] = nullptr) {
  constexpr Epilogue kEpi = Kind::kEpi;
  static_assert(AccCols<Accum>() == 256 || AccCols<Accum>() == 128,
                "a 64 x 256 or 64 x 128 wgmma atom per warpgroup");
  static_assert(!Kind::kTmaStore, "StageSlab");
  if constexpr (kEpi == Epilogue::kSwiGLUBwd) {
    SwiGLUBwdStaged(p, tile, smem, thread, part, acc, gu_ahead);
  } else if constexpr (Kind::kFp8 && kEpi == Epilogue::kSwiGLU) {
    StoreSwiGLUFp8(p, tile, smem, thread, part, acc);
  } else {
    static_assert(Kind::kSched == Schedule::kRowsByGroup, "grouped outputs are TMA-stored");
    StageAndStore<Kind, kLateAddresses>(p, tile, smem, thread, part, acc);
  }
}

}  // namespace mok::sm90
