"""The FP8 recipe in NumPy, inputs whose FP8 products are exact, and the checks that the FP8
target (mok_moe_fwd_fp8: the C++ CPU target in tests/test_fp8.py, the CUDA kernels in
tests/test_fp8_cuda.py) must pass against NumPy and the XLA reference.

Tolerances, and why: the target and the reference quantize alike, bit for bit (xq is checked
so), so the only differences are how each sums its f32 products (and, on the GPU, the tensor
cores' e4m3 sums, which keep about 14 bits before the promotion every 128 of K). Such a
difference of one ulp in g or u can move h across an e4m3 rounding boundary (a flip: one e4m3
step, 2^-4 to 2^-3 of that value), and that, rarely, moves y by a part of one h value's share.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import mok_jax
from cases import BF16, assert_close, distinct_experts, f64, make_case
from mok_jax import ops, quantize

E4M3 = ml_dtypes.float8_e4m3fn
BLOCK = 128

# y and every gradient against the XLA reference, relative to the array's largest magnitude: a
# flip of one h (or dg) value moves its share of a sum by 2^-3 of it; seen at most 3e-3.
FP8_RTOL = 2e-2
# ... while flips stay rare: the mean difference, relative to the mean magnitude (a wrong scale
# or row moves every element by far more; one bf16 ulp is 2^-8).
FP8_MEAN_RTOL = 2e-3
# hq against NumPy's quantization of h from the target's own xq in float64: the fraction of
# values one e4m3 step away, and the relative difference of the block scales (h's amax).
HQ_FLIP_FRACTION = 0.02
HQ_SCALE_RTOL = 1e-3


def numpy_quantize(a, block, recipe="fp8"):
  """The recipe in NumPy: per block, scale = amax / 448 ("fp8") or 2^ceil(log2(amax / 448))
  ("mxfp8"), 1 for a zero block; values a / scale, saturated at 448, rounded to e4m3."""
  a = np.asarray(a, np.float32)
  bm, bn = block
  M, N = a.shape
  scale = np.ones((-(-M // bm), -(-N // bn)), np.float32)
  data = np.zeros(a.shape, E4M3)
  for i in range(scale.shape[0]):
    for j in range(scale.shape[1]):
      blk = a[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
      amax = np.float32(np.abs(blk).max())
      if amax > 0:
        s = amax / np.float32(448) if recipe == "fp8" else np.exp2(np.ceil(np.log2(
            amax / np.float32(448))))
        scale[i, j] = np.float32(s)
      v = np.clip(blk / scale[i, j], -448, 448).astype(E4M3)
      data[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = v
  return data, scale


def u8(a):
  return np.asarray(a).view(np.uint8)


def dequantize_rows(data, scale_t):
  """(M, K) e4m3 rows with their scales (K / 128, pitch) [block, row] as float64."""
  data = np.asarray(data).astype(np.float64)
  M, K = data.shape
  scale = np.asarray(scale_t, np.float64)[:, :M].T  # (M, K / 128)
  return data * np.repeat(scale, BLOCK, axis=1)


def dequantize_weight(q):
  """A weight's 128 x 128 quantize.Blocks as float64."""
  return f64(quantize.dequantize(q, (BLOCK, BLOCK)))


def local_ids(experts, E):
  experts = np.asarray(experts)
  return jnp.asarray(np.where((experts >= 0) & (experts < E), experts, -1).astype(np.int32))


def run_target(case, block_m, out_dtype=jnp.bfloat16):
  """ops.moe_fwd_fp8 on the case's weights quantized by quantize_experts (jitted): (y, Fp8Buffers)
  as NumPy arrays, and the quantized weights."""
  E = case.w_gate.shape[0]
  qs = mok_jax.quantize_experts(case.w_gate, case.w_up, case.w_down)
  shared = None
  if case.shared is not None:
    shared = tuple(quantize.quantize(w, (BLOCK, BLOCK), "fp8") for w in case.shared)
  f = jax.jit(lambda x, e, w, qs, shared: ops.moe_fwd_fp8(
      x, e, w, *(q.blocks for q in qs), shared, out_dtype=out_dtype, block_m=block_m))
  y, buffers = f(case.x, local_ids(case.experts, E), case.weights, qs, shared)
  return np.asarray(y), ops.Fp8Buffers(*map(np.asarray, buffers)), qs, shared


class Routed(NamedTuple):
  """Which routed rows hold a route, and each one's token and expert."""

  used: np.ndarray  # (n,) the routed rows that hold routes
  token: np.ndarray  # (n,)
  expert: np.ndarray  # (n,)
  padding: np.ndarray  # the padding rows before offsets[E]


def routed(buffers, k, experts):
  rows, offsets = buffers.rows, buffers.offsets
  used = np.nonzero(rows >= 0)[0]
  padding = np.nonzero((rows < 0) & (np.arange(len(rows)) < offsets[-1]))[0]
  flat = np.asarray(experts).reshape(-1)
  return Routed(used, rows[used] // k, flat[rows[used]], padding)


def check_gather(case, buffers):
  """xq: each routed row's token row quantized as the reference quantizes it (the same bits,
  scales included); padding rows zeros with scale 1; xq_shared every token's."""
  T, H = case.x.shape
  k = case.experts.shape[1]
  data, scale = numpy_quantize(np.asarray(case.x, np.float32), (1, BLOCK))
  r = routed(buffers, k, case.experts)
  np.testing.assert_array_equal(u8(buffers.xq[r.used]), u8(data[r.token]), "xq")
  np.testing.assert_array_equal(buffers.xq_scale[:, r.used], scale[r.token].T, "xq_scale")
  assert not u8(buffers.xq[r.padding]).any(), "xq padding rows"
  assert (buffers.xq_scale[:, r.padding] == 1).all(), "xq padding scales"
  if case.shared is not None:
    np.testing.assert_array_equal(u8(buffers.xq_shared), u8(data), "xq_shared")
    np.testing.assert_array_equal(buffers.xq_shared_scale[:, :T], scale.T, "xq_shared_scale")


def numpy_h(xq_rows, xq_scale, qs_gate, qs_up):
  """h = silu(g) * u (f32) of quantized rows through a quantized gate and up (float64)."""
  x = dequantize_rows(xq_rows, xq_scale)
  g, u = x @ dequantize_weight(qs_gate), x @ dequantize_weight(qs_up)
  return (g / (1 + np.exp(-g)) * u).astype(np.float32)


def assert_hq_close(data, scale_t, h, what):
  """e4m3 rows (with their scales [block, row]) against NumPy's quantization of h (f32): the
  scales within HQ_SCALE_RTOL, the values at most one e4m3 step apart, in at most
  HQ_FLIP_FRACTION of them."""
  want, want_scale = numpy_quantize(h, (1, BLOCK))
  got_scale = np.asarray(scale_t)[:, :h.shape[0]].T
  np.testing.assert_allclose(got_scale, want_scale, rtol=HQ_SCALE_RTOL, err_msg=f"{what} scales")
  got, want = np.asarray(data).astype(np.float64), want.astype(np.float64)
  step = np.maximum(np.abs(want) / 8, 2.0**-9)  # one e4m3 step at want (its subnormal step)
  differ = got != want
  assert (np.abs(got - want)[differ] <= step[differ] * (1 + 2 * HQ_SCALE_RTOL)).all(), what
  assert differ.mean() <= HQ_FLIP_FRACTION, f"{what}: {differ.mean():.4f} of the values differ"


def check_hidden(case, buffers, qs, shared):
  """hq of each routed row (and the shared expert's) against NumPy from the target's own xq;
  padding rows zeros with scale 1."""
  k = case.experts.shape[1]
  r = routed(buffers, k, case.experts)
  for e in np.unique(r.expert):
    rows = r.used[r.expert == e]
    h = numpy_h(buffers.xq[rows], buffers.xq_scale[:, rows], _expert(qs[0], e), _expert(qs[1], e))
    assert_hq_close(buffers.hq[rows], buffers.hq_scale[:, rows], h, f"hq of expert {e}")
  assert not u8(buffers.hq[r.padding]).any(), "hq padding rows"
  assert (buffers.hq_scale[:, r.padding] == 1).all(), "hq padding scales"
  if shared is not None:
    h = numpy_h(buffers.xq_shared, buffers.xq_shared_scale, shared[0], shared[1])
    assert_hq_close(buffers.hq_shared, buffers.hq_shared_scale, h, "hq_shared")


def _expert(q, e):
  return quantize.Blocks(q.blocks.data[e], q.blocks.scale[e])


def assert_fp8_close(got, want, what):
  """An FP8 result against the reference's: every element within FP8_RTOL of the largest
  magnitude, and the mean difference within FP8_MEAN_RTOL of the mean magnitude."""
  got, want = f64(got), f64(want)
  assert_close(got, want, FP8_RTOL, what)
  mean = np.abs(got - want).mean()
  assert mean <= FP8_MEAN_RTOL * np.abs(want).mean(), f"{what}: mean difference {mean:.3g}"


# --- inputs whose FP8 products are exact ----------------------------------------------------


def exact_case(T=200, H=256, I=256, E=2, Is=128, seed=0):
  """A case (k = 1, every weight 1) on which the FP8 GEMMs of gate|up are exact in f32 and in
  the tensor cores, so that h, and so hq, must have NumPy's bits:

  - x: each 128-block of a row is small integers (|v| <= 2) times a power of two of its own
    (block 0's is 1), with 7 times it in the block's first column (its amax: scale 2^-6 times
    the power, exact) and 0 in its second;
  - w_gate: 5, 6 or 7 in its first row (the one that meets x's 7), zeros elsewhere (zero
    blocks: scale 1), so g = 7 w_gate[0] >= 35, where silu(g) = g in f32;
  - w_up: 128 x 128 blocks of small integers times a power of two each, a 7 pin in each
    block's second row (which meets x's zero column), zeros in its first (which meets x's 7),
    so that u sums products of at most 4, under 2^9 in each block: exact in any order;
  - w_down: such blocks too; y's sums are not exact (hq has all of e4m3's values).
  The shared expert (Is columns) is built like the routed ones.
  """
  rng = np.random.default_rng(seed)

  def blocks_of(rows, cols, low=-3, high=4):  # a power of two per 128 x 128 block
    p = np.exp2(rng.integers(low, high, (-(-rows // BLOCK), -(-cols // BLOCK))))
    return np.repeat(np.repeat(p, BLOCK, 0), BLOCK, 1)[:rows, :cols]

  x = rng.integers(-2, 3, (T, H)).astype(np.float64)
  x[:, ::BLOCK], x[:, 1::BLOCK] = 7, 0
  x_pow = np.exp2(rng.integers(-2, 3, (T, H // BLOCK)))
  x_pow[:, 0] = 1
  x *= np.repeat(x_pow, BLOCK, axis=1)

  def gate(I):
    w = np.zeros((H, I))
    w[0] = rng.integers(5, 8, I)
    w[0, ::BLOCK] = 7
    return w

  def up(I):
    w = rng.integers(-2, 3, (H, I)).astype(np.float64)
    w[::BLOCK], w[1::BLOCK, ::BLOCK] = 0, 7
    return w * blocks_of(H, I)

  def down(I):
    w = rng.integers(-2, 3, (I, H)).astype(np.float64)
    w[::BLOCK, ::BLOCK] = 7
    return w * blocks_of(I, H)

  bf = lambda a: jnp.asarray(a, BF16)  # noqa: E731  (every value is exact in bf16)
  stack = lambda f, n: bf(np.stack([f(n) for _ in range(E)]))  # noqa: E731
  experts = (np.arange(T) % E).reshape(T, 1).astype(np.int32)
  case = make_case(T, H, I, E, 1, dtype=BF16, seed=seed, experts=experts)
  shared = (bf(gate(Is)), bf(up(Is)), bf(down(Is))) if Is else None
  return case._replace(x=bf(x), weights=jnp.ones((T, 1), jnp.float32), w_gate=stack(gate, I),
                       w_up=stack(up, I), w_down=stack(down, I), shared=shared)


def check_exact(case, block_m):
  """exact_case through the target: xq, hq and their scales with NumPy's bits; y_routed and
  y_shared within their rounding of the float64 product of hq and w_down (bf16, 2^-9; the
  tensor cores' e4m3 partial sums, which keep about 14 bits: 2^-9 of the sum of the
  magnitudes bounds them, four k32 steps to a block); y = y_routed[pos] + y_shared, rounded
  once."""
  y, b, qs, shared = run_target(case, block_m)
  check_gather(case, b)
  r = routed(b, 1, case.experts)

  def check_mlp(xq, xq_scale, hq, hq_scale, y_rows, q_gate, q_up, q_down, what):
    xs = dequantize_rows(xq, xq_scale)
    g, u = xs @ dequantize_weight(q_gate), xs @ dequantize_weight(q_up)
    assert g.min() >= 35  # silu(g) = g in f32
    h = (g * u).astype(np.float32)  # exact
    data, scale = numpy_quantize(h, (1, BLOCK))
    np.testing.assert_array_equal(u8(hq), u8(data), f"{what} hq")
    np.testing.assert_array_equal(np.asarray(hq_scale)[:, :len(h)], scale.T, f"{what} hq scale")
    hd, wd = dequantize_rows(hq, hq_scale), dequantize_weight(q_down)
    want, size = hd @ wd, np.abs(hd) @ np.abs(wd)
    err = np.abs(f64(y_rows) - want)
    bound = 2.0**-8 * np.abs(want) + 2.0**-9 * size
    assert (err <= bound).all(), f"{what}: worst excess {np.max(err - bound):.3g}"

  for e in range(case.w_gate.shape[0]):
    rows = r.used[r.expert == e]
    check_mlp(b.xq[rows], b.xq_scale[:, rows], b.hq[rows], b.hq_scale[:, rows], b.y_routed[rows],
              _expert(qs[0], e), _expert(qs[1], e), _expert(qs[2], e), f"expert {e}")
  if shared is not None:
    check_mlp(b.xq_shared, b.xq_shared_scale, b.hq_shared, b.hq_shared_scale, b.y_shared,
              *shared, "shared")
  want = f64(b.y_routed[b.pos[:, 0]]).astype(np.float32)
  if shared is not None:
    want = want + f64(b.y_shared).astype(np.float32)
  np.testing.assert_array_equal(f64(y), f64(jnp.asarray(want, BF16)), "y")


def check_against_reference(case, block_m):
  """A random case through the target: xq with the reference's bits, hq within flips of NumPy,
  and y within flips of the XLA reference's (mok_jax.moe on backend 'xla')."""
  y, b, qs, shared = run_target(case, block_m)
  check_gather(case, b)
  check_hidden(case, b, qs, shared)
  config = mok_jax.Config(precision="fp8")
  want = jax.jit(lambda *a: mok_jax.moe(*a, shared=case.shared, config=config, backend="xla"))(
      *case.args())
  assert_fp8_close(y, want, "y")


def random_case(T, H, I, E, k, Is, seed, experts=None):
  return make_case(T, H, I, E, k, Is=Is or None, dtype=BF16, seed=seed, experts=experts)


def fp8_routing(name, T, E, k, seed=1):
  """(T, k) int64 ids of a named routing: 'distinct' (k distinct experts a token), 'skewed'
  (most routes to expert 0, the last experts empty), or 'invalid' (a third out of range)."""
  rng = np.random.default_rng(seed)
  ids = distinct_experts(rng, T, k, E).astype(np.int64)
  if name == "skewed":
    ids = np.where(rng.random(ids.shape) < 0.7, 0, ids % max(1, E - 2))
  elif name == "invalid":
    bad = rng.random(ids.shape) < 0.3
    ids[bad] = rng.choice([-1, E, 2**31 - 1], size=bad.sum())
  elif name != "distinct":
    raise ValueError(name)
  return ids
