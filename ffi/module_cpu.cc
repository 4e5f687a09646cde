// Python module mok_jax._mok_cpu: the CPU targets as capsules for jax.ffi.register_ffi_target,
// and the scratch sizes (layout, tile queue) that mok_jax.ops declares.
#include <nanobind/nanobind.h>

#include "../cuda/layout_contract.h"
#include "capsule.h"
#include "moe_cpu.h"

namespace nb = nanobind;

NB_MODULE(_mok_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["mok_moe_fwd"] = mok::Capsule(MokMoeFwdCpu);
    targets["mok_moe_bwd"] = mok::Capsule(MokMoeBwdCpu);
    targets["mok_moe_combine"] = mok::Capsule(MokMoeCombineCpu);
    targets["mok_moe_fwd_fp8"] = mok::Capsule(MokMoeFwdFp8Cpu);
    targets["mok_moe_bwd_fp8"] = mok::Capsule(MokMoeBwdFp8Cpu);
    targets["mok_quantize_weight"] = mok::Capsule(MokQuantizeWeightCpu);
    return targets;
  });
  m.def("layout_scratch_ints", &mok::LayoutScratchInts, nb::arg("T"), nb::arg("k"),
        nb::arg("experts"),
        "Ints of the layout scratch (layout counts and tile queue) that mok_moe_fwd takes.");
  m.def("tile_queue_ints", &mok::TileQueueInts, nb::arg("T"), nb::arg("k"), nb::arg("experts"),
        "Ints of the tile-queue scratch (queues of its GEMM launches) that mok_moe_bwd takes.");
  m.def("dw_part_cols", &mok::DwPartCols, nb::arg("I"),
        "Columns of mok_moe_bwd's dw_parts scratch: each routed row's dweights by 128 of I.");
  m.def("fp8_scale_pitch", &mok::Fp8ScalePitch, nb::arg("rows"),
        "Columns of mok_moe_fwd_fp8's activation scales (blocks, pitch) for `rows` rows.");
}
