"""Block-scaled e4m3 (FP8) numerics: the spec that the layer's FP8 precisions follow.

Recipes (`Config.precision`):

- "fp8" (DeepSeek-V3's): an f32 scale per block, amax / 448 (a block of zeros has scale 1);
  activations in 1 x 128 blocks along the reduction dimension, expert weights in 128 x 128
  blocks (one quantization serves W and W^T).
- "mxfp8" (the OCP MX format, MoK's on Blackwell): 1 x 32 blocks along the reduction
  dimension for activations and weights alike, each scale a power of two (e8m0),
  2^ceil(log2(amax / 448)) (a block of zeros has scale 1).

A value is a / scale rounded to the nearest e4m3 (ties to even) and saturated at +-448; its
dequantized value is that e4m3 times the scale, exact in f32. Blocks at an edge that the shape
does not fill hold fewer values.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

RECIPES = ("fp8", "mxfp8")
E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0


class Blocks(NamedTuple):
  """A quantized array: e4m3 values of a's shape and one f32 scale a block."""

  data: jax.Array  # a's shape, float8_e4m3fn
  scale: jax.Array  # a's shape with its last two dimensions divided by the block's, rounded up


def act_block(recipe: str) -> int:
  """The length of an activation block along the reduction dimension."""
  return {"fp8": 128, "mxfp8": 32}[recipe]


def weight_block(recipe: str, reduce_axis: int) -> tuple[int, int]:
  """The block of an expert weight (..., K, N) or (..., N, K) over its last two dimensions:
  128 x 128 for "fp8" whichever is reduced, 1 x 32 along the reduced one for "mxfp8"."""
  if recipe == "fp8":
    return (128, 128)
  return (32, 1) if reduce_axis == -2 else (1, 32)


def _blocked(a, block):
  """a (..., M, N) zero-padded to whole blocks and split: (..., M / bm, bm, N / bn, bn)."""
  bm, bn = block
  M, N = a.shape[-2:]
  pad = [(0, 0)] * (a.ndim - 2) + [(0, -M % bm), (0, -N % bn)]
  a = jnp.pad(a, pad)
  return a.reshape(*a.shape[:-2], a.shape[-2] // bm, bm, a.shape[-1] // bn, bn)


def _divide(a, b):
  """a / b correctly rounded. XLA:CPU turns a division by a divisor that is the same across a
  loop (a constant, a block's scale) into a multiplication by its reciprocal, one rounding
  more; a divisor written to vary with a (b + 0 a) keeps the division. (0 a is NaN where a is
  not finite, and so is the quotient then.)"""
  return a / (b + 0.0 * a)


def _scales(amax, recipe):
  ratio = _divide(amax, jnp.float32(E4M3_MAX))
  if recipe == "fp8":
    scale = ratio
  else:
    # 2^ceil(log2 ratio), exactly: ratio = m 2^e with m in [0.5, 1) (frexp) is 2^(e - 1) when
    # m = 0.5, else above it; log2 and exp2 themselves need not be exact.
    m, e = jnp.frexp(ratio)
    scale = jnp.ldexp(jnp.ones_like(ratio), jnp.where(m == 0.5, e - 1, e))
  return jnp.where(amax > 0, scale, 1.0).astype(jnp.float32)


def quantize(a, block: tuple[int, int], recipe: str) -> Blocks:
  """a (..., M, N) in blocks of `block` over its last two dimensions (an activation's is (1,
  act_block)), by `recipe`. Non-finite values stay non-finite (their block's scale is too)."""
  if recipe not in RECIPES:
    raise ValueError(f"quantize: recipe must be one of {RECIPES}, got {recipe!r}")
  a32 = jnp.asarray(a, jnp.float32)
  M, N = a32.shape[-2:]
  blocks = _blocked(a32, block)
  amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))  # (..., M / bm, N / bn)
  scale = _scales(amax, recipe)
  values = jnp.clip(_divide(blocks, scale[..., :, None, :, None]), -E4M3_MAX, E4M3_MAX)
  data = values.reshape(*values.shape[:-4], -1, values.shape[-2] * values.shape[-1])
  return Blocks(data[..., :M, :N].astype(E4M3), scale)


def dequantize(q: Blocks, block: tuple[int, int]):
  """The f32 values of q: each e4m3 value times its block's scale (exact)."""
  bm, bn = block
  scale = jnp.repeat(jnp.repeat(q.scale, bm, axis=-2), bn, axis=-1)
  M, N = q.data.shape[-2:]
  return q.data.astype(jnp.float32) * scale[..., :M, :N]


def fake_quantize(a, block: tuple[int, int], recipe: str):
  """dequantize(quantize(a)): a as the recipe's kernels see it, in f32."""
  return dequantize(quantize(a, block, recipe), block)


def scale_shape(shape, block) -> tuple[int, ...]:
  """The shape of the scales of an array of `shape` in blocks of `block`."""
  return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
