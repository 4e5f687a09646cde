// Sizes that the layout kernels, the FFI handlers and Python (through mok_jax._mok_cpu) must
// agree on. Plain C++ with no CUDA include, so that every module can see it.
#pragma once

#include <cstdint>

namespace mok {

// Routes per CTA of the layout kernels: the layout scratch holds one count per expert for each
// chunk of this many routes.
constexpr int64_t kLayoutChunk = 1024;

constexpr int64_t LayoutCountInts(int64_t routes, int64_t experts) {
  return (routes + kLayoutChunk - 1) / kLayoutChunk * experts;
}

// The tile queue of the forward's expert-MLP kernel, after the layout counts: kQueueHeaderInts
// counters (the next tile to hand out), then one count of finished gate|up column tiles per
// row tile, first of the routed rows (at most R / 64 row tiles, R <= T k + 127 E), then of
// the shared expert's T rows (128 a tile). Zeroed by the forward before each launch.
constexpr int64_t kQueueHeaderInts = 8;
constexpr int64_t RoutedRowTilesBound(int64_t routes, int64_t experts) {
  return (routes + 127 * experts + 63) / 64;
}
constexpr int64_t TileQueueInts(int64_t T, int64_t k, int64_t experts) {
  return kQueueHeaderInts + RoutedRowTilesBound(T * k, experts) + (T + 127) / 128;
}

// The routed rows that the launch choices (clusters, tails, runs) expect when about one in
// `ranks` of the `routes` rows holds a route (expert parallelism: an owner's receive buffer has
// room for every rank's worst case, and its empty slots are invalid ids): those routes and the
// padding bound of the R rows that hold all of them (R = routes + the padding).
constexpr int64_t ExpectedRoutedRows(int64_t routes, int64_t R, int64_t ranks) {
  return R - routes + (routes + ranks - 1) / ranks;
}

// Columns of the backward's dw_parts: each routed row's share of dweights by 128 columns of
// the expert's I (the SwiGLU backward's epilogue writes them, the combine sums them in order).
constexpr int64_t DwPartCols(int64_t I) { return (I + 127) / 128; }

// The FP8 forward's activation scales (mok_moe_fwd_fp8): block b of row r at b * pitch + r, the
// rows padded to a multiple of 4 so that each block's row of scales starts 16-byte aligned
// (TMA's strides).
constexpr int64_t Fp8ScalePitch(int64_t rows) { return (rows + 3) / 4 * 4; }

// Ints of the forward's layout scratch: the layout counts, then the tile queue.
constexpr int64_t LayoutScratchInts(int64_t T, int64_t k, int64_t experts) {
  return LayoutCountInts(T * k, experts) + TileQueueInts(T, k, experts);
}

}  // namespace mok
