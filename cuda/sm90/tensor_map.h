// Host-side TMA descriptors. cuTensorMapEncodeTiled is a driver entry point; it is fetched
// through the runtime so that the module links no libcuda and imports on machines without one.
#pragma once

#include <cstdint>

#include <cuda.h>

namespace mok::sm90 {

// A row-major bf16 (or `dtype`: UINT8 for e4m3) matrix (rows, inner) read or written in
// (box_inner, box_rows) boxes with `swizzle`; out-of-bounds elements read as zero and are not
// written. Returns false if the driver refuses it.
bool MakeTensorMap(CUtensorMap* map, const void* base, uint64_t inner, uint64_t rows,
                   uint32_t box_inner, uint32_t box_rows,
                   CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B,
                   CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16);

// The block scales of an FP8 activation (rows, blocks of K) as f32 (blocks, pitch): block b of
// row r at b * pitch + r (pitch >= rows, a multiple of 4), read in (128 rows, 1 block) boxes;
// rows past `rows` read as zero.
bool MakeScaleMap(CUtensorMap* map, const float* base, uint64_t rows, uint64_t pitch,
                  uint64_t blocks);

// The same matrix as the MN-major operand of a GEMM, whose 64-column panels are the 128-byte
// swizzle atoms' width: one TMA reads `panels` neighbouring (64 columns, box_rows rows) panels
// into consecutive shared memory, as that many 2D boxes would, through a 3D view (column in
// panel, row, panel). `inner` must be a multiple of 64.
bool MakePanelMap(CUtensorMap* map, const void* base, uint64_t inner, uint64_t rows,
                  uint32_t box_rows, uint32_t panels);

}  // namespace mok::sm90
