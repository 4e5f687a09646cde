// Python module mok_jax._mok_cpu: the CPU targets as capsules for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include <type_traits>

#include "../cuda/layout_contract.h"
#include "moe_cpu.h"

namespace nb = nanobind;

namespace {

template <class Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an FFI handler takes an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_mok_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["mok_moe_fwd"] = Capsule(MokMoeFwdCpu);
    targets["mok_moe_bwd"] = Capsule(MokMoeBwdCpu);
    return targets;
  });
  m.def("layout_scratch_ints", &mok::LayoutScratchInts, nb::arg("routes"), nb::arg("experts"),
        "Ints of the layout scratch that mok_moe_fwd takes for this many routes and experts.");
}
