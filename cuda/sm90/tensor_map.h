// Host-side TMA descriptors. cuTensorMapEncodeTiled is a driver entry point; it is fetched
// through the runtime so that the module links no libcuda and imports on machines without one.
#pragma once

#include <cstdint>

#include <cuda.h>

namespace mok::sm90 {

// A row-major bf16 matrix (rows, inner) read or written in (box_inner, box_rows) boxes with
// `swizzle`; out-of-bounds elements read as zero and are not written. Returns false if the
// driver refuses it.
bool MakeTensorMap(CUtensorMap* map, const void* base, uint64_t inner, uint64_t rows,
                   uint32_t box_inner, uint32_t box_rows,
                   CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B);

}  // namespace mok::sm90
