// mok_quantize_weight on the CPU: each 128 x 128 block's amax, scale and e4m3 values in plain
// loops (cpu_math.h's conversion, the reference's bits), and the values again transposed.
#include "cpu_math.h"
#include "moe_args.h"
#include "moe_cpu.h"

namespace mok::cpu {
namespace {

template <class S>
void QuantizeMatrices(const QuantizeDims& d, const S* w, uint8_t* data, uint8_t* k_major,
                      float* scale) {
  const int64_t K = d.K, N = d.N;
  for (int64_t b = 0; b < d.batch; ++b) {
    const S* m = w + b * K * N;
    for (int64_t bk = 0; bk < d.k_blocks; ++bk) {
      for (int64_t bn = 0; bn < d.n_blocks; ++bn) {
        const int64_t k_end = std::min(K, (bk + 1) * 128), n_end = std::min(N, (bn + 1) * 128);
        float amax = 0.0f;
        for (int64_t i = bk * 128; i < k_end; ++i)
          for (int64_t j = bn * 128; j < n_end; ++j) amax = AmaxWith(amax, Load(m[i * N + j]));
        const float s = BlockScale(amax);
        scale[(b * d.k_blocks + bk) * d.n_blocks + bn] = s;
        for (int64_t i = bk * 128; i < k_end; ++i)
          for (int64_t j = bn * 128; j < n_end; ++j) {
            const uint8_t q = ToE4m3(Load(m[i * N + j]) / s);
            data[(b * K + i) * N + j] = q;
            k_major[(b * N + j) * K + i] = q;
          }
      }
    }
  }
}

ffi::Error QuantizeWeight(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> data,
                          ffi::Result<ffi::AnyBuffer> k_major, ffi::Result<ffi::AnyBuffer> scale) {
  auto dims = CheckQuantizeArgs("mok_quantize_weight", w, *data, *k_major, *scale);
  if (dims.has_error()) return dims.error();
  auto* q = data->reinterpret_data<uint8_t>();
  auto* t = k_major->reinterpret_data<uint8_t>();
  auto* s = scale->reinterpret_data<float>();
  if (w.element_type() == ffi::DataType::F32)
    QuantizeMatrices(*dims, w.reinterpret_data<float>(), q, t, s);
  else
    QuantizeMatrices(*dims, w.reinterpret_data<bf16_bits>(), q, t, s);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mok::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokQuantizeWeightCpu, mok::cpu::QuantizeWeight,
                              mok::BindQuantizeWeight(xla::ffi::Ffi::Bind()));
