#include "tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

namespace mok::sm90 {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 EncodeTiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace

bool MakeTensorMap(CUtensorMap* map, const void* base, uint64_t inner, uint64_t rows,
                   uint32_t box_inner, uint32_t box_rows, CUtensorMapSwizzle swizzle) {
  auto encode = EncodeTiled();
  if (!encode || rows == 0 || inner == 0) return false;
  cuuint64_t dims[2] = {inner, rows};
  cuuint64_t strides[1] = {inner * 2};  // bytes between rows
  cuuint32_t box[2] = {box_inner, box_rows};
  cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides,
                box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool MakePanelMap(CUtensorMap* map, const void* base, uint64_t inner, uint64_t rows,
                  uint32_t box_rows, uint32_t panels) {
  constexpr uint64_t kPanel = 64;  // bf16 columns in 128 bytes
  auto encode = EncodeTiled();
  if (!encode || rows == 0 || inner == 0 || inner % kPanel != 0) return false;
  cuuint64_t dims[3] = {kPanel, rows, inner / kPanel};
  cuuint64_t strides[2] = {inner * 2, kPanel * 2};  // bytes between rows, between panels
  cuuint32_t box[3] = {static_cast<cuuint32_t>(kPanel), box_rows, panels};
  cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides,
                box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace mok::sm90
