// Tile shapes, pipeline depth, register split and kinds of the grouped expert GEMM (sm90).
#pragma once

#include <cstdint>

#include <cuda.h>
#include <cuda_bf16.h>

#include <cute/tensor.hpp>

// The kernels are sm_90a code (wgmma, TMA, setmaxnreg). Built for another target they compile
// without complaint, CuTe's wgmma atoms turning into no-ops, and run without their MMAs: stop
// such a build here (nvcc defines the macro for compute_90a only).
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "mok_jax's CUDA kernels are sm_90a code: build them with MOK_CUDA_ARCHS=90a"
#endif

namespace mok::sm90 {

struct GemmConfig {
  // A 128 x 256 tile over two consumer warpgroups (64 x 256 each, one
  // wgmma.m64n256k16 per k16 step) keeps 128 f32 accumulators per thread and reads 48 KB of
  // shared memory per 64-deep k-step; four stages (192 KB) cover L2 latency (the weight
  // gradients: GemmKind::kBlockK, kStages).
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  // Groups of a kRowsByGroup or kGroupedK launch, whose offsets are copied to shared memory.
  static constexpr int kMaxGroups = 512;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // setmaxnreg: the producer needs few registers; consumers hold the accumulators. In clusters
  // of two (ScheduleUnit) the producer's scheduling of units would spill at 40. The two splits
  // use all of the 168 x 384 registers the launch gives a CTA (64,512), which is all setmaxnreg
  // can hand out: 48 and 232 (65,536) hang, the consumers waiting in setmaxnreg.inc.
  //
  // With the forward's tails (kTail) the producer spills 16 bytes at 40; the clustered
  // consumers at 224 spill nothing outside their k-loops because the epilogue computes its
  // addresses late (StageAndStore's kLateAddresses; docs/performance.md).
  static constexpr uint32_t kProducerRegs = 40;
  static constexpr uint32_t kConsumerRegs = 232;
  static constexpr uint32_t kClusterProducerRegs = 56;
  static constexpr uint32_t kClusterConsumerRegs = 224;
  // TMA boxes: 64 bf16 = 128 bytes inner, the 128-byte swizzle span.
  static constexpr int kBoxInner = 64;
};

// What the epilogue does with the 128 x 256 f32 accumulator tile.
enum class Epilogue {
  // Columns [0, n_split) to out0, [n_split, n) to out1 (at column - n_split), rounded to bf16;
  // n_split is the row pitch of both.
  kStore,
  // Forward GEMM1: B = [w_gate tile (128 columns) | w_up tile (128 columns)]; out0 = gu
  // (rows, 2n) gets [g | u] rounded (null: gu is not stored), out1 = h (rows, n) gets
  // round(silu(g) * u) from f32 g, u.
  kSwiGLU,
  // Backward of SwiGLU: the tile is dh / w; aux = gu (rows, 2n). out0 = dgu (rows, 2n) gets
  // [dh * u * silu'(g) | dh * silu(g)], out1 (rows, n) round(w * silu(g) * u), dw_parts the
  // rows' <dh / w, silu(g) * u> by 128 columns. w is each row's route weight (row_scale), or 1
  // (null).
  kSwiGLUBwd,
};

// How CTAs map to tiles and what the reduction runs over.
enum class Schedule {
  // M = the routed rows of each group (offsets), K fixed: C[rows of g] = A[rows] @ B_g.
  // Expert GEMMs of the forward and the data gradients.
  kRowsByGroup,
  // K = the routed rows of each group, M and N fixed: C_g = A[rows of g]^T @ B[rows of g].
  // Weight gradients: one CTA owns an output tile over the whole ragged reduction.
  kGroupedK,
};

// The compile-time shape of one GEMM: operand majors (K: the reduction is contiguous in
// memory; MN: the other dimension is), epilogue, schedule, operand type.
template <cute::GMMA::Major kMajorA_, cute::GMMA::Major kMajorB_, Epilogue kEpi_,
          Schedule kSched_, bool kRuns_ = false, bool kFp8_ = false>
struct GemmKind {
  static constexpr cute::GMMA::Major kMajorA = kMajorA_;
  static constexpr cute::GMMA::Major kMajorB = kMajorB_;
  static constexpr Epilogue kEpi = kEpi_;
  static constexpr Schedule kSched = kSched_;
  // Block-scaled e4m3 operands (Config(precision="fp8"), quantize.cuh): A in 1 x 128 blocks
  // along K, B in 128 x 128 blocks, both K-major (e4m3 wgmma reads no other major). A k-step
  // is one 128-deep block: its partial products leave the tensor cores each k-step and are
  // added in f32 with their two scales (MmaTileFp8). The forward's GEMMs and the backward's
  // data gradients, row-grouped, without tails, split tiles or clusters (their stages hold
  // whole tiles).
  static constexpr bool kFp8 = kFp8_;
  static_assert(!kFp8_ || (kMajorA_ == cute::GMMA::Major::K && kMajorB_ == cute::GMMA::Major::K &&
                           kSched_ == Schedule::kRowsByGroup),
                "FP8 GEMMs are K-major and row-grouped");
  // kGroupedK only: the queue hands out runs of tiles (ChainParams::run_tiles) whose tiles of
  // one column tile load B's k-tiles once (GemmTile::keep_b); a kernel of its own, so that the
  // launches without runs keep the ring and register split that measured faster for them.
  static constexpr bool kRuns = kRuns_;
  static_assert(!kRuns_ || kSched_ == Schedule::kGroupedK, "runs are the weight gradients'");
  static constexpr bool kKMajorA = kMajorA_ == cute::GMMA::Major::K;
  static constexpr bool kKMajorB = kMajorB_ == cute::GMMA::Major::K;
  // The weight gradients stage their whole bf16 output tile (64 KB) in shared memory, which
  // storer threads' TMA stores write out while the consumers go on to the next tile (StageSlab),
  // and keep the room of three 64-deep pipeline stages for it; the others stage 64 columns at a
  // time beside four stages.
  //
  // A weight-gradient tile has 2 to 6 k-steps and a 64 KB output tile: with 16-byte st.global
  // stores (or TMA stores from two 4 KB halves, which the warpgroup waits on in turn) its
  // epilogue is a third of its time; staged whole, dsv3's launch takes about 10% less on an H200
  // (docs/performance.md). The forward keeps four stages: three make it slower (qwen3_30b about
  // 8% on an H200).
  static constexpr bool kTmaStore = kEpi_ == Epilogue::kStore && kSched_ == Schedule::kGroupedK;
  // The bf16 outputs that leave through TMA stores (o0, o1): the weight gradients' (kTmaStore)
  // and the row-grouped ones' (StageAndStore: the forward's, dx_r); not the SwiGLU backward's.
  static constexpr bool kStoresByTma = kEpi_ == Epilogue::kStore || kEpi_ == Epilogue::kSwiGLU;
  // The weight gradients' stages are half as deep (32 of k) and twice as many, in the same
  // 144 KB: with 48 KB stages the producer can refill only one while the consumers hold two,
  // and the consumers wait for a stage's bytes in 28% of their samples (ncu, gptoss_120b, H200);
  // 32 deep, gptoss_120b's weight-gradient launch takes about 10% less on an H200. Their
  // operands are MN-major, whose panels need no 64-deep swizzle atom. The bits are those of
  // 64-deep stages: the same k16 MMAs in the same order.
  //
  // The runs (kRuns) keep B in its stages and load only A, whose k-steps reach a CTA at about
  // 16 KB a microsecond however deep they are (globaltimer marks, dsv3, H200): there 64-deep
  // steps, three stages of them, halve the loads and barrier rounds a tile, and dsv3's
  // weight-gradient launch takes about 5% less back to back on an H200 (docs/performance.md, The
  // weight gradients in runs). Loading a last k-step of at most 32 rows as one 32-deep box a
  // panel, so that no padding rows are loaded, is slower: more TMA boxes a tile.
  static constexpr int kBlockK = kFp8_ ? 128 : kTmaStore && !kRuns_ ? 32 : 64;
  // The FP8 SwiGLU backward keeps three: its 12 KB stagings and four 48 KB stages would
  // not fit in a CTA's shared memory.
  static constexpr int kStages =
      kTmaStore ? (kRuns_ ? 3 : 6) : kFp8_ && kEpi_ == Epilogue::kSwiGLUBwd ? 3 : 4;
  // Bytes of one operand element; an FP8 k-step is 128 of them deep, the same 128-byte rows.
  static constexpr int kElemBytes = kFp8_ ? 1 : 2;
  static_assert(kBlockK * kElemBytes == 128 || (!kKMajorA && !kKMajorB),
                "K-major stages are 128-byte swizzled rows");
  // FP8: A's stage also holds the 128 rows' scales of its k-block (f32).
  static constexpr uint32_t kAScaleBytes = kFp8_ ? GemmConfig::kBlockM * sizeof(float) : 0;
  static constexpr uint32_t kStageBytes =
      (GemmConfig::kBlockM + GemmConfig::kBlockN) * kBlockK * kElemBytes + kAScaleBytes;
  // The expert GEMMs over routed rows that store plainly (the forward's, and dx_r in the
  // backward) take a group's last rows past a multiple of 128 (its tail) into its last full row
  // tiles, kTailRows a tile, instead of a row tile of their own: the stage holds them beside A
  // and they multiply the B already there (MmaTile, TailCount). Not the SwiGLU backward: there
  // tails are slower on three of the four bench shapes (docs/performance.md).
  static constexpr bool kTail = kSched_ == Schedule::kRowsByGroup && kKMajorA &&
                                kEpi_ != Epilogue::kSwiGLUBwd && !kFp8_;
};

// The rows of a group's tail that ride in one full row tile (four stages of them fit beside
// the forward's 192 KB of stages).
//
// A tail in a row tile of its own would be a half tile (64 rows), which streams all of its B for
// half of a full tile's MMAs, and in the forward-MLP launch the bytes into shared memory are
// what bound it: on an H200, gptoss_120b's shape takes that launch 2.40 ms with 256 routes an
// expert, 2.74 with the bench's 256 +- 16 and such half tiles (docs/performance.md).
constexpr int kTailRows = 16;

// Host-built arguments of one grouped GEMM launch.
struct GemmParams {
  // K-major operands are read in (64, rows) boxes, MN-major ones in one 3D box of (64, kBlockK)
  // panels a k-step (MakePanelMap).
  CUtensorMap a;
  CUtensorMap b0;
  CUtensorMap b1;           // kSwiGLU: w_up; K-major B: the matrix for k >= k_split
  // kRowsByGroup: split tiles load only what they multiply (MmaTileSplit): a half tile 64 rows
  // of A (a_half: boxes of 64 rows), a narrow tile half of B's columns (b0_half, b1_half).
  CUtensorMap a_half;
  CUtensorMap b0_half;
  CUtensorMap b1_half;
  // kStoresByTma: out0 and out1 for TMA stores; kTmaStore: (32 columns, 64 rows) boxes, all
  // groups' rows group after group; kRowsByGroup: (64 columns, 64 rows) boxes (o0 of kSwiGLU:
  // gu, when kept).
  CUtensorMap o0;
  CUtensorMap o1;
  CUtensorMap a_tail;       // kTail: A in boxes of kTailRows rows
  // kFp8: A's scales, (blocks of K, rows) f32 read in (128 rows, 1) boxes (GatherQuantizeKernel
  // and the FP8 SwiGLU epilogue write them so).
  CUtensorMap a_scale;
  const int32_t* offsets;   // (groups + 1) first routed row of each group, multiples of
                            // block_m; null: one group of m_total rows
  // kGroupedK with offsets: each routed row's token, -1 for the padding rows that end each
  // group (fewer than block_m): a group's reduction stops at its last used row, rounded up to
  // kBlockK, instead of at the padded end. Null: the whole padded range. kTail: the same rows
  // say which groups end in a tail (null: none does).
  const int32_t* row_tokens;
  int block_m;              // kRowsByGroup with offsets: 128, or 64, when a group's last tile
                            // may be a half tile (its rows past 64 belong to the next group)
  int groups;
  int64_t m_total;          // kRowsByGroup: rows of A and the outputs; kGroupedK: rows (K)
                            // of the single group when offsets is null
  int64_t m_expected;       // host: the rows that the launch choices expect the groups to
                            // hold, at most m_total (ExpectedRoutedRows)
  int m;                    // kGroupedK: the M extent of each group's output
  int n;                    // output columns (kSwiGLU / kSwiGLUBwd: columns of h)
  int k;                    // kRowsByGroup: the reduction
  int k_split;              // K-major B: b0 serves k < k_split, b1 the rest (at k - k_split)
  int n_split;              // kStore*: column split and row pitch of the outputs
  int n_tiles, m_tiles;
  int raster_rows;          // row tiles per band of the tile order (tile_scheduler.cuh)
  int max_tails;            // kTail: the most full row tiles a group's tail may ride in
  int64_t tiles;            // an upper bound on the linear tiles (LinearTiles): sizes the grid
  void* out0;
  void* out1;
  const __nv_bfloat16* aux; // kSwiGLUBwd: gu
  const float* row_scale;   // kSwiGLUBwd: the weight of each route (row_tokens), or null: 1
  float* dw_parts;          // kSwiGLUBwd with row_scale: (m_total, dw_part_cols) f32
  int dw_part_cols;         // ceil(n / 128)
  // kFp8: B's 128 x 128 block scales, f32 as quantize_experts has them: (groups, k / 128,
  // n / 128) for the forward's weights, whose K-major copies B is; (groups, n / 128, k / 128)
  // with b_scale_nk, where B is a weight as it is (the backward's data gradients). kSwiGLU:
  // w_gate's in b_scale0, w_up's in b_scale1; a K-major B past k_split: b1's in b_scale1.
  const float* b_scale0;
  const float* b_scale1;
  bool b_scale_nk;
  // kFp8 kSwiGLU: h goes to out1 in e4m3, its scales (n / 128, rows) to h_scale with pitch
  // h_scale_pitch (the down GEMM's a_scale).
  float* h_scale;
  int64_t h_scale_pitch;
};

// Whether a GEMM of `Kind` reads b1: kSwiGLU's w_up, or a K-major B past k_split. The host
// describes b1 (PrepareGemm) and the kernel prefetches its descriptor only then.
template <class Kind>
__host__ __device__ constexpr bool UsesB1(const GemmParams& p) {
  return Kind::kEpi == Epilogue::kSwiGLU || (Kind::kKMajorB && p.k_split < p.k);
}

// Several GEMMs of one launch, whose tiles the CTAs take in order: first all of slot 0's, then
// slot 1's, and so on. The forward's expert MLPs run as one such launch: routed gate|up, shared
// gate|up (slots 0, 1: the kernel's first GemmKind), routed down, shared down (slots 2, 3: its
// second). A down tile starts once the gate|up tiles of its rows are done, while other gate|up
// tiles still run: no wave ends between the GEMMs. Slots are compile-time indices in the kernel
// (a runtime index into kernel parameters would copy them to local memory).
constexpr int kMaxChain = 4;
struct ChainParams {
  GemmParams gemm[kMaxChain];  // a slot with n_tiles = 0 has no tiles
  int wait_base[kMaxChain];    // -1, or: the slot's A is rows that another slot writes, whose
                               // counts in `ready` start here; a tile waits until the count of
  int wait_count[kMaxChain];   // its row tile reaches wait_count (that slot's column tiles)
  int ready_base[kMaxChain];   // -1, or where this slot's per-row-tile counts start in `ready`
  int32_t* queue;              // *queue: the next tile to hand out (zero before launch). Tiles go
                               // out in order, as SMs free up: CTAs that share an expert's
                               // weights stay together in time, and no CTA waits for a tile
                               // that is not already running.
  int32_t* ready;              // finished column tiles per row tile (zero before launch)
  // kGroupedK: the queue hands out runs of this many consecutive tiles (1: tiles), which one
  // CTA takes in turn; the tiles of a run with one group and column tile, whose reduction fits
  // in the stages, load B's k-tiles once (GemmTile::keep_b).
  int run_tiles;
};

}  // namespace mok::sm90
