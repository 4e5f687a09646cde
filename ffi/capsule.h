// An FFI handler as the capsule that jax.ffi.register_ffi_target takes.
#pragma once

#include <nanobind/nanobind.h>

#include <type_traits>

#include "xla/ffi/api/c_api.h"

namespace mok {

template <class Fn>
nanobind::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an FFI handler takes an XLA_FFI_CallFrame*");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace mok
