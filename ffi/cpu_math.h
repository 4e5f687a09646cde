// Scalar helpers of the C++ CPU reference targets: the storage types of x (f32 or bf16 bits),
// the SwiGLU activation and the gate|up product, with the rounding points of docs/usage.md
// ("What the layer computes").
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

// g = x_row @ wg and u = x_row @ wu (I floats each, summed over H in order) and gu_row = [g | u]
// rounded to S. The forward and the backward's recompute both call it, so that a recomputed gu
// has the bits of a saved one.
template <class S>
void GateUp(int64_t H, int64_t I, const S* x_row, const S* wg, const S* wu, S* gu_row, float* g,
            float* u) {
  for (int64_t i = 0; i < I; ++i) g[i] = u[i] = 0.0f;
  for (int64_t h = 0; h < H; ++h) {
    float xv = Load(x_row[h]);
    for (int64_t i = 0; i < I; ++i) {
      g[i] += xv * Load(wg[h * I + i]);
      u[i] += xv * Load(wu[h * I + i]);
    }
  }
  for (int64_t i = 0; i < I; ++i) {
    gu_row[i] = Store<S>(g[i]);
    gu_row[I + i] = Store<S>(u[i]);
  }
}

}  // namespace mok::cpu
