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

`quantize_experts` quantizes `mok_jax.moe`'s expert weights once (`QuantizedWeight`), for the
layer to take in their place.
"""

from __future__ import annotations

import dataclasses
import functools
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


# Division. XLA:GPU divides f32 within 2 ulp, not correctly rounded, and XLA:CPU turns a
# division by a block's scale into a multiplication by its reciprocal, one rounding more. The
# spec's values are those of correctly rounded quotients, so each quotient a / b is taken as
# an estimate within a few ulp, and what depends on its last bits is decided exactly from a and
# b: by remainders a - b c, exact in f32 when c is near a / b and b c is a sum of exact products
# (_halves).
_INF = float("inf")
_F32_MAX_ULPS = 8  # how far from the correctly rounded quotient an estimate may lie, in ulp


def _halves(b):
  """b = hi + lo, hi with the 12 leading bits of b's significand and lo the rest (at most 12
  bits): the product of either with a value of at most 12 significant bits is exact in f32."""
  bits = jax.lax.bitcast_convert_type(b, jnp.uint32) & jnp.uint32(0xFFFFF000)
  hi = jax.lax.bitcast_convert_type(bits, jnp.float32)
  return hi, b - hi


def _over_e4m3_max(amax, c):
  """amax / 448 correctly rounded (amax >= 0), from c, an estimate of it within a few ulp.

  448 c = 7 (64 c): 7 times either half of 64 c is exact, and so is the remainder
  r = amax - 448 c built from them while c is near the quotient. The quotient lies within half
  an ulp of c, on either side, exactly when -224 ulp_below(c) <= r <= 224 ulp_above(c) (no
  quotient of an f32 by 448 lies half-way between two f32 values: that would take more than 24
  bits of amax); else c steps one ulp towards it."""
  for _ in range(3):
    hi, lo = _halves(64 * c)
    r = (amax - 7 * hi) - 7 * lo
    up, down = jnp.nextafter(c, jnp.float32(_INF)), jnp.nextafter(c, jnp.float32(0))
    c = jnp.where(r > 224 * (up - c), up, jnp.where(r < -224 * (c - down), down, c))
  return c


def _pow2(k):
  """2^k as f32 for integer arrays k in f32's normal range, built from its bits."""
  return jax.lax.bitcast_convert_type((k + 127).astype(jnp.uint32) << 23, jnp.float32)


def _exponent(x):
  """floor(log2 x) for normal f32 x > 0 (-127 for 0 and subnormals), from its bits."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return ((bits >> 23) & 0xFF).astype(jnp.int32) - 127


def _e4m3_of_quotient(a, s, q):
  """clip(a / s, +-448) correctly rounded to f32, then to the nearest e4m3 (ties to even), as
  f32 values; s > 0 (a block's scale, broadcast to a's shape), q an estimate of a / s within a
  few ulp.

  |q| lies between the neighbouring e4m3 values lo = n g and hi = lo + g (g the e4m3 spacing
  of its binade, 2^-9 below 2^-6), and its rounding is the right one unless the midpoint
  m = lo + g / 2 lies within a few ulp of it. There the side of m that the correctly rounded
  quotient lies on is decided exactly: m has at most 5 significant bits, so d = |a| - s m,
  built from s's halves, is exact; the f32 quotient is above m when d > s ulp(m) / 2, below
  when d < -s ulp_below(m) / 2, and else m itself, a tie that goes to the even one of n and
  n + 1. Only exact f32 operations are used (products by powers of two, floor, sums of
  neighbours, comparisons) and integer ones on the bits, none whose rounding a backend may
  change."""
  size = jnp.minimum(jnp.abs(q), E4M3_MAX)
  spacing = jnp.maximum(_exponent(size), -6) - 3
  n = jnp.floor(size * _pow2(-spacing))
  g = _pow2(spacing)
  lo = n * g
  m = lo + 0.5 * g
  ulp = _pow2(_exponent(m) - 23)
  power_of_two = (jax.lax.bitcast_convert_type(m, jnp.uint32) & 0x7FFFFF) == 0  # m = 2^-10
  ulp_below = jnp.where(power_of_two, 0.5 * ulp, ulp)
  near = (size - m <= _F32_MAX_ULPS * ulp) & (m - size <= _F32_MAX_ULPS * ulp_below)
  # a and s scaled by the same power of two, s to [1, 2): no product below underflows, on a
  # backend that flushes subnormals too.
  unit = _pow2(-_exponent(s))
  a, s = a * unit, s * unit
  s_hi, s_lo = _halves(s)
  d = (jnp.abs(a) - s_hi * m) - s_lo * m
  odd = jnp.fmod(n, 2) == 1
  up = jnp.where(near, (d > s * ulp * 0.5) | ((d >= -s * ulp_below * 0.5) & odd), size > m)
  rounded = jnp.copysign(jnp.where(up, lo + g, lo), q)
  return jnp.where(jnp.isnan(q), q, rounded)


def _scales(amax, recipe):
  ratio = _over_e4m3_max(amax, amax / jnp.float32(E4M3_MAX))
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
  s = scale[..., :, None, :, None]
  values = _e4m3_of_quotient(blocks, s, blocks / s)
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


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("blocks", "blocks_t", "k_major", "master"), meta_fields=("recipe",))
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """An expert weight (E, K, N) quantized once for `mok_jax.moe` (`quantize_experts`), in place
  of the array with the same bits of y and of every gradient.

  The layer's products read only the blocks: `blocks` those of the forward product, which
  reduces over K; `blocks_t` those of the data gradient, which reduces over N, or None where
  the same blocks serve W^T ("fp8": 128 x 128). `k_major` is `blocks.data` with its last two
  axes swapped, (..., N, K): the layout in which e4m3 wgmma reads the forward's weight (both
  operands K-major), made once here so that a CUDA call does not copy the weight ("fp8"; None
  for "mxfp8", which has no Hopper kernels). The weight gradient, a GEMM of x's dtype on
  unquantized operands that never reads the weight's values, is w.r.t. `master`, the weight
  quantized: an e4m3 leaf could carry no bf16 gradient, and through `master` the gradient
  reaches the master weights straight through (d quantize_experts(w) / d w = identity) by
  ordinary autodiff. The recipe is static (jit-static, kept by vmap and scan).
  """

  blocks: Blocks
  blocks_t: Blocks | None
  k_major: jax.Array | None
  master: jax.Array
  recipe: str

  @property
  def shape(self):
    return self.master.shape

  @property
  def dtype(self):
    return self.master.dtype

  @property
  def ndim(self):
    return self.master.ndim

  def values(self, reduce_axis: int):
    """The f32 values the product that reduces over `reduce_axis` (-2: K, -1: N) reads."""
    q = self.blocks if reduce_axis == -2 or self.blocks_t is None else self.blocks_t
    return dequantize(q, weight_block(self.recipe, reduce_axis))


def master_cotangent(w, g):
  """The cotangent of a weight argument whose gradient w.r.t. the array it stands for is g: g
  itself for an array, a QuantizedWeight of zeros but its master for a quantized one (an FP8
  layer's weight gradient never reads the blocks' values; reference.quantized_dot)."""
  if isinstance(w, QuantizedWeight):
    return dataclasses.replace(jax.tree.map(jnp.zeros_like, w), master=g.astype(w.dtype))
  return g.astype(w.dtype)


def _orientations(recipe):
  """The reduce axes whose weight blocks differ: -2 (the forward), and -1 (the data gradient)
  unless the forward's blocks serve it too."""
  return (-2,) if weight_block(recipe, -2) == weight_block(recipe, -1) else (-2, -1)


def _quantize_weight(w, recipe: str) -> QuantizedWeight:
  """w (..., K, N) as `QuantizedWeight`: its blocks computed from stop_gradient(w), w itself
  the master."""
  fixed = jax.lax.stop_gradient(w)
  if recipe == "fp8":
    # The blocks and their K-major copy in one pass, by the FFI target (this module's bits);
    # imported here because mok_jax.ops builds on this module's types.
    from mok_jax import ops
    blocks, k_major = ops.quantize_weight(fixed)
    return QuantizedWeight(blocks, None, k_major, w, recipe)
  blocks = [quantize(fixed, weight_block(recipe, axis), recipe) for axis in _orientations(recipe)]
  return QuantizedWeight(blocks[0], blocks[1] if len(blocks) > 1 else None, None, w, recipe)


def quantize_experts(w_gate, w_up, w_down, *, recipe: str = "fp8"):
  """The expert weights of `mok_jax.moe` quantized once, to pass in their place with
  `Config(precision=recipe)`: the same bits of y and of every gradient as the arrays, and the
  gradients w.r.t. w_gate, w_up, w_down (straight through).

  w_gate, w_up (E, H, I) and w_down (E, I, H), float, of x's dtype (cast them first, as for
  `moe`). "fp8": one 128 x 128 quantization each, for the forward and the data gradients
  alike. "mxfp8": its 1 x 32 blocks lie along the reduced axis, K in the forward and N in the
  data gradient, so each weight is quantized in both orientations (twice the e4m3 bytes). One
  pass over the weights: b 3 E H I bytes read (b a weight element's), 3 E H I (2 + 4 / 128^2)
  written for "fp8" (the blocks and their K-major copy), and twice 3 E H I (1 + 1 / 32) for
  "mxfp8".
  """
  if recipe not in RECIPES:
    raise ValueError(f"quantize_experts: recipe must be one of {RECIPES}, got {recipe!r}")
  named = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
  for name, w in named.items():
    if isinstance(w, QuantizedWeight):
      raise ValueError(f"quantize_experts: {name} is quantized already; pass its master weight "
                       f"({name}.master)")
    if jnp.ndim(w) != 3 or not jnp.issubdtype(jnp.result_type(w), jnp.floating):
      raise ValueError(f"quantize_experts: {name} must be a float array (E, K, N), got "
                       f"{jnp.result_type(w)} {jnp.shape(w)}")
  E, H, I = jnp.shape(w_gate)
  if jnp.shape(w_up) != (E, H, I) or jnp.shape(w_down) != (E, I, H):
    raise ValueError(f"quantize_experts: w_gate, w_up must be (E, H, I) and w_down (E, I, H); "
                     f"got {jnp.shape(w_gate)}, {jnp.shape(w_up)}, {jnp.shape(w_down)}")
  return tuple(_quantize_weight(w, recipe) for w in named.values())


def check_quantized(w: QuantizedWeight, name: str, recipe: str):
  """That w's blocks have the dtypes and shapes of its master's quantization by `recipe`
  (which must be the one it was quantized with)."""
  if w.recipe != recipe:
    raise ValueError(f"moe: {name} was quantized with recipe {w.recipe!r}, but "
                     f"Config(precision={recipe!r}); quantize with recipe={recipe!r} or pass "
                     f"Config(precision={w.recipe!r})")
  orientations = _orientations(recipe)
  if (w.blocks_t is None) != (len(orientations) == 1):
    want = "None" if len(orientations) == 1 else "the blocks of W^T"
    raise ValueError(f"moe: {name}.blocks_t must be {want} for recipe {recipe!r}; make the "
                     "weights with mok_jax.quantize_experts")
  for axis, q in zip(orientations, (w.blocks, w.blocks_t)):
    want = scale_shape(w.shape, weight_block(recipe, axis))
    if (not isinstance(q, Blocks) or jnp.shape(q.data) != w.shape or jnp.shape(q.scale) != want
        or jnp.result_type(q.data) != E4M3 or jnp.result_type(q.scale) != jnp.float32):
      raise ValueError(
          f"moe: {name}'s blocks must be e4m3 data of its master's shape {w.shape} and f32 "
          f"scales {want}, got {_describe(q)}; make them with mok_jax.quantize_experts")
  if recipe == "fp8":
    want = (*w.shape[:-2], w.shape[-1], w.shape[-2])
    if (w.k_major is None or jnp.shape(w.k_major) != want
        or jnp.result_type(w.k_major) != E4M3):
      got = "None" if w.k_major is None else (
          f"{jnp.result_type(w.k_major)} {jnp.shape(w.k_major)}")
      raise ValueError(f"moe: {name}.k_major must be its blocks' e4m3 data K-major {want}, got "
                       f"{got}; make the weights with mok_jax.quantize_experts")
  elif w.k_major is not None:
    raise ValueError(f"moe: {name}.k_major must be None for recipe {recipe!r}; make the "
                     "weights with mok_jax.quantize_experts")


def _describe(q):
  if not isinstance(q, Blocks):
    return type(q).__name__
  return (f"{jnp.result_type(q.data)} {jnp.shape(q.data)} and {jnp.result_type(q.scale)} "
          f"{jnp.shape(q.scale)}")
