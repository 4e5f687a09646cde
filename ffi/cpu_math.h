// Scalar helpers of the C++ CPU reference targets: the storage types of x (f32 or bf16 bits),
// the SwiGLU activation and the gate|up product, with the rounding points of docs/usage.md
// ("What the layer computes").
#pragma once

#include <algorithm>
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

// e4m3 (float8_e4m3fn) bytes, as the FP8 kernels convert: f32 rounded to the nearest e4m3,
// ties to even, saturated at +-448 (satfinite); NaN becomes 0x7f.
inline uint8_t ToE4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;
  if (a == 0.0f) return sign;
  int ex;
  std::frexp(a, &ex);  // a in [2^(ex - 1), 2^ex)
  // The e4m3 spacing there: 2^(E - 3) for a normal binade E >= -6, 2^-9 below.
  const int step = std::max(ex - 1, -6) - 3;
  const float v = std::ldexp(std::nearbyint(std::ldexp(a, -step)), step);  // ties to even
  if (v == 0.0f) return sign;
  std::frexp(v, &ex);
  const int E = ex - 1;
  if (E < -6) return sign | static_cast<uint8_t>(std::ldexp(v, 9));  // subnormal
  return sign | static_cast<uint8_t>((E + 7) << 3) |
         static_cast<uint8_t>(static_cast<int>(std::ldexp(v, 3 - E)) - 8);
}

inline float FromE4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float s = (b & 0x80) ? -1.0f : 1.0f;
  if (e == 15 && m == 7) return std::nanf("");
  if (e == 0) return s * std::ldexp(static_cast<float>(m), -9);
  return s * std::ldexp(static_cast<float>(8 + m), e - 10);
}

// A block's amax after value a: NaN once any value is, as jnp.max.
inline float AmaxWith(float amax, float a) {
  a = std::fabs(a);
  return std::isnan(a) || std::isnan(amax) ? std::nanf("") : std::max(amax, a);
}

// The scale of a block (mok_jax/quantize.py): amax / 448, 1 for zeros and for a NaN amax.
inline float BlockScale(float amax) { return amax > 0.0f ? amax / 448.0f : 1.0f; }

// v[0, n) in 1 x 128 blocks: block b's scale at scale[b * pitch], its values v / scale in e4m3.
inline void QuantizeRow(int64_t n, const float* v, uint8_t* q, float* scale, int64_t pitch) {
  for (int64_t b = 0; b * 128 < n; ++b) {
    const int64_t end = std::min(n, (b + 1) * 128);
    float amax = 0.0f;
    for (int64_t i = b * 128; i < end; ++i) amax = AmaxWith(amax, v[i]);
    const float s = BlockScale(amax);
    scale[b * pitch] = s;
    for (int64_t i = b * 128; i < end; ++i) q[i] = ToE4m3(v[i] / s);
  }
}

// acc plus, over the 128-blocks kb of K, (sum_k a[k] b[k] in f32, k ascending) times a's and
// b's block scales, added in f32 (fmaf) as the FP8 kernels promote their tensor-core sums: a
// and b (K) e4m3, a's scales at a_scale[kb * a_pitch], b's (a row of a K-major weight) at
// b_scale[kb * b_stride].
inline float Fp8Dot(float acc, int64_t K, const uint8_t* a, const float* a_scale,
                    int64_t a_pitch, const uint8_t* b, const float* b_scale, int64_t b_stride) {
  for (int64_t kb = 0; kb < K / 128; ++kb) {
    float part = 0.0f;
    for (int64_t k = kb * 128; k < (kb + 1) * 128; ++k) part += FromE4m3(a[k]) * FromE4m3(b[k]);
    acc = std::fmaf(part, a_scale[kb * a_pitch] * b_scale[kb * b_stride], acc);
  }
  return acc;
}

}  // namespace mok::cpu
