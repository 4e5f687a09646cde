// mok_moe_combine on the CPU: the forward's combine loop (combine_cpu.h) on rows from elsewhere.
#include <string>

#include "combine_cpu.h"
#include "moe_args.h"
#include "moe_cpu.h"

namespace mok::cpu {
namespace {

ffi::Error MoeCombine(ffi::AnyBuffer rows, ffi::AnyBuffer pos, ffi::AnyBuffer weights,
                      ffi::AnyBuffer extra, ffi::Result<ffi::AnyBuffer> out) {
  auto dims = CheckCombineArgs("mok_moe_combine", rows, pos, weights, extra, *out);
  if (dims.has_error()) return dims.error();
  const CombineDims& d = *dims;
  const int32_t* p = pos.reinterpret_data<int32_t>();
  for (int64_t q = 0; q < d.T * d.k; ++q)
    if (p[q] < -1 || p[q] >= d.N)
      return ffi::Error::InvalidArgument("mok_moe_combine: pos[" + std::to_string(q) + "] = " +
                                         std::to_string(p[q]) + " is outside [-1, " +
                                         std::to_string(d.N) + ")");
  const float* w = d.weighted ? weights.reinterpret_data<float>() : nullptr;
  bool out_f32 = out->element_type() == ffi::DataType::F32;
  if (rows.element_type() == ffi::DataType::F32) {
    CombineRows<float, float>(d.T, d.k, d.H, rows.reinterpret_data<float>(), p, w,
                              d.extra ? extra.reinterpret_data<float>() : nullptr,
                              out->reinterpret_data<float>());
  } else if (out_f32) {
    CombineRows<bf16_bits, float>(d.T, d.k, d.H, rows.reinterpret_data<bf16_bits>(), p, w,
                                  d.extra ? extra.reinterpret_data<bf16_bits>() : nullptr,
                                  out->reinterpret_data<float>());
  } else {
    CombineRows<bf16_bits, bf16_bits>(d.T, d.k, d.H, rows.reinterpret_data<bf16_bits>(), p, w,
                                      d.extra ? extra.reinterpret_data<bf16_bits>() : nullptr,
                                      out->reinterpret_data<bf16_bits>());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokMoeCombineCpu, mok::cpu::MoeCombine,
                              mok::BindMoeCombine(xla::ffi::Ffi::Bind()));
