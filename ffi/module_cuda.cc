// Python module mok_jax._mok_cuda: the CUDA targets as capsules for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include <type_traits>

#include "moe_cuda.h"

namespace nb = nanobind;

namespace {

template <class Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an FFI handler takes an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_mok_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["mok_moe_fwd"] = Capsule(MokMoeFwdCuda);
    targets["mok_moe_bwd"] = Capsule(MokMoeBwdCuda);
    return targets;
  });
}
