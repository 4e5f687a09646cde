// Python module mok_jax._mok_cuda: the CUDA targets as capsules for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "capsule.h"
#include "moe_cuda.h"

namespace nb = nanobind;

NB_MODULE(_mok_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["mok_moe_fwd"] = mok::Capsule(MokMoeFwdCuda);
    targets["mok_moe_bwd"] = mok::Capsule(MokMoeBwdCuda);
    targets["mok_moe_combine"] = mok::Capsule(MokMoeCombineCuda);
    return targets;
  });
}
