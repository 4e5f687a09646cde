// Block-scaled e4m3 ("fp8", mok_jax/quantize.py): a block's scale is amax / 448 (1 for a block of
// zeros), each value a / scale rounded to the nearest e4m3 (ties to even) and saturated. The
// gather (the tokens' 1 x 128 blocks) and the SwiGLU epilogue (h's) quantize with these, with
// the bits of the XLA reference: every division correctly rounded, as the reference's.
#pragma once

#include <cstdint>

namespace mok::sm90 {

// Columns of an activation block along the reduction, rows x columns of an expert weight's.
constexpr int kFp8Block = 128;
constexpr float kE4m3Max = 448.0f;

// max(a, b) that is NaN when either is (max.NaN), as the reference's amax (jnp.max) is: a NaN
// then makes its block's scale 1 (`amax > 0` fails) and stays NaN itself.
__device__ __forceinline__ float MaxNaN(float a, float b) {
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
}

// The scale of a block whose largest magnitude is `amax`.
__device__ __forceinline__ float BlockScale(float amax) {
  return amax > 0.0f ? __fdiv_rn(amax, kE4m3Max) : 1.0f;
}

// lo / scale and hi / scale as two e4m3 bytes (lo in the low byte): each quotient correctly
// rounded to f32, then to e4m3 (ties to even), saturated at +-448 (satfinite: a finite value
// past 448 becomes 448, as the reference's clip makes it; NaN stays NaN).
__device__ __forceinline__ uint16_t E4m3Pair(float lo, float hi, float scale) {
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;"
      : "=h"(pair)
      : "f"(__fdiv_rn(hi, scale)), "f"(__fdiv_rn(lo, scale)));
  return pair;
}

}  // namespace mok::sm90
