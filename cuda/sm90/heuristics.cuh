// The launch choices of the grouped GEMMs: functions of the shape (and of expert parallelism's
// `ranks` hint) alone, never of the environment. None of them moves a bit of any output: they
// pick the order of tiles, who shares operands and where a group's last rows ride, while every
// output element keeps its one reduction order (tests/test_moe_bwd_cuda.py,
// test_same_bits_whatever_the_launch_choices).
#pragma once

#include <cstdint>

#include "gemm_config.cuh"

namespace mok::sm90 {

// Row tiles per band of the tile order (GemmParams::raster_rows). Eight row tiles and the
// column panels the rest of a wave of 132 CTAs spans keep the bytes a wave reads from HBM near
// the smallest for all four bench shapes.
constexpr int kRasterRows = 8;

// Whether the groups of a row-grouped GEMM average at most kClusterRows rows (routed rows with
// their padding bound, R / E). Few row tiles a group: its weights stream into one or two row
// tiles, what a launch's SMs take in of B bounds it, and clusters of two CTAs (UseClusters)
// pay: a pair that shares B reads it from L2 once (a group's odd row tile goes as two column
// tiles side by side, which share its rows of A). Many: a band of eight row tiles already
// shares B through L2, and the pairs' lockstep costs more than the bytes save.
//
// On an H200, clusters take about 6% off dsv3's forward-MLP launch (R / E 255) and about 1% off
// gptoss_120b's (383), and add about 1% to qwen3_30b's (1151) (docs/performance.md).
constexpr int64_t kClusterRows = 512;

inline bool FewRowsPerGroup(const GemmParams& p) {
  return p.m_expected <= kClusterRows * p.groups;
}

// The most row tiles of a group that take kTailRows of its tail each (TailCount). Groups with
// few rows (FewRowsPerGroup) spread any tail over as many full row tiles as it needs, which
// saves a row tile that streams all of B; the others take only tails of at most kTailRows,
// in their last full row tile.
//
// On an H200, up to eight tails a group instead of one would add about 8% to mixtral's
// forward-MLP launch (docs/performance.md).
inline int MaxTails(const GemmParams& p) {
  return FewRowsPerGroup(p) ? GemmConfig::kBlockM / kTailRows : 1;
}

// Whether a row-grouped launch of `c` runs in clusters of two CTAs (ScheduleUnit): when its
// groups have few rows (FewRowsPerGroup).
inline bool UseClusters(const ChainParams& c) {
  for (const GemmParams& p : c.gemm) {
    if (p.offsets) return FewRowsPerGroup(p);
  }
  return false;
}

// The tiles a CTA takes at once from the weight gradients' queue (ChainParams::run_tiles):
// runs of kRunTiles where experts average at most kRunRoutes routes (`routes`: those expected on
// this GPU, ExpectedRoutedRows), so that most of their reductions fit in the stages (6 x 32
// rows) and a run's tiles, which share a column tile of one expert (a band of the tile order),
// load B's k-tiles once; else tiles one at a time.
//
// On an H200 the runs take about 6% off dsv3's weight-gradient launch (docs/performance.md).
// They are a kernel of their own (BwdWeightRuns): the runs' ring and 56/224 register split would
// make the launches without runs 3-5% slower, and in the 40/232 split the runs' producer spills.
constexpr int kRunTiles = 8;
constexpr int64_t kRunRoutes = 160;

inline int WeightGradRunTiles(int64_t routes, int64_t experts) {
  return routes <= kRunRoutes * experts ? kRunTiles : 1;
}

}  // namespace mok::sm90
