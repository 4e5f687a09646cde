// Scalar helpers of the C++ CPU reference targets: the storage types of x (f32 or bf16 bits)
// and the SwiGLU activation, with the rounding points of DESIGN.md.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mok::cpu {

using bf16_bits = uint16_t;  // how XLA's FFI hands out bf16 buffers

inline float Load(float v) { return v; }
inline float Load(bf16_bits v) {
  uint32_t u = uint32_t{v} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <class S>
S Store(float f);
template <>
inline float Store<float>(float f) { return f; }
// Round to nearest even, as the GPU's cvt.rn.bf16.f32 does; NaN stays a (quiet) NaN.
template <>
inline bf16_bits Store<bf16_bits>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_bits((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_bits(u >> 16);
}

// f rounded to storage precision S, back in f32: what a GEMM operand of type S holds.
template <class S>
float Round(float f) { return Load(Store<S>(f)); }

inline float Sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }
inline float Silu(float v) { return v * Sigmoid(v); }
// d silu / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
inline float SiluGrad(float v) {
  float s = Sigmoid(v);
  return s * (1.0f + v * (1.0f - s));
}

}  // namespace mok::cpu
