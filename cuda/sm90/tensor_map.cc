#include "tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

namespace mok::sm90 {

namespace {

// No L2 promotion: a miss fetches the sectors a box row asks for, not the 256 bytes around
// them. Measured faster where the launches read most; why is not measured. Every box row
// here is 128 bytes of a matrix whose rows lie kilobytes apart: 256-byte promotion fetches a
// neighbouring 128 bytes that another k-step or tile reads, if at all, through an L2 whose
// fabric between its two partitions ncu finds 96-99% busy in these launches.
//
// On an H200, dsv3's forward+backward takes about 3% less back to back than with 256-byte
// promotion (docs/performance.md, L2 promotion of the TMA loads).
constexpr CUtensorMapL2promotion kPromotion = CU_TENSOR_MAP_L2_PROMOTION_NONE;

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
                   uint32_t box_inner, uint32_t box_rows, CUtensorMapSwizzle swizzle,
                   CUtensorMapDataType dtype) {
  auto encode = EncodeTiled();
  if (!encode || rows == 0 || inner == 0) return false;
  const uint64_t bytes = dtype == CU_TENSOR_MAP_DATA_TYPE_UINT8 ? 1 : 2;  // or bf16
  if (dtype != CU_TENSOR_MAP_DATA_TYPE_UINT8 && dtype != CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
    return false;
  cuuint64_t dims[2] = {inner, rows};
  cuuint64_t strides[1] = {inner * bytes};  // bytes between rows
  cuuint32_t box[2] = {box_inner, box_rows};
  cuuint32_t element_strides[2] = {1, 1};
  return encode(map, dtype, 2, const_cast<void*>(base), dims, strides,
                box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle, kPromotion,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool MakeScaleMap(CUtensorMap* map, const float* base, uint64_t rows, uint64_t pitch,
                  uint64_t blocks) {
  constexpr uint32_t kBoxRows = 128;  // a GEMM tile's rows
  auto encode = EncodeTiled();
  if (!encode || rows == 0 || blocks == 0 || pitch < rows || pitch % 4 != 0) return false;
  cuuint64_t dims[2] = {rows, blocks};
  cuuint64_t strides[1] = {pitch * sizeof(float)};  // bytes between blocks: 16-byte multiples
  cuuint32_t box[2] = {kBoxRows, 1};
  cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base), dims, strides,
                box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                kPromotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
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
                CU_TENSOR_MAP_SWIZZLE_128B, kPromotion,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace mok::sm90
