"""The FP8 recipe in NumPy, inputs whose FP8 products are exact, and the checks that the FP8
target (mok_moe_fwd_fp8: the C++ CPU target in tests/test_fp8.py, the CUDA kernels in
tests/test_fp8_cuda.py) must pass against NumPy and the XLA reference.

Each stage is checked against its own inputs, as the target computed them:
  xq       the reference's bits (both quantize x alike);
  hq       h in float64 from the target's own xq, within what the target's sums may differ
           from exact (`accumulation_eta`) propagated through silu(g) u, then one e4m3
           rounding: a value may sit one step from NumPy's only where h lies that close to a
           rounding boundary (a flip);
  y_routed the float64 product of the target's own hq and w_down, y their weighted combine:
           flips in h cannot disturb these;
  y        against the XLA reference, after taking out what the target's flips (hq against
           NumPy's quantization of h) do to y; what is left is the sums' errors, the bf16
           roundings, and the flips the reference's own f32 sums may make.
The target's products of e4m3 values are exact; only its sums and its roundings are not, and
each bound below says which sums and roundings it allows for.
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

# --- how far the target's sums may be from exact ---------------------------------------------
# Every GEMM output o of the target is within eta * P of its float64 value on the same e4m3
# operands, P = |a| @ |b| on the dequantized operands (the sum of its products' magnitudes):
#
# ETA_F32 (the C++ CPU target): f32 sums in k order of each 128-block's exact products (127
# roundings, each at most 2^-24 of a partial sum <= P: Higham's gamma_n), then per block one
# rounded scale product and one fma into the f32 accumulator: (127 + 2 K / 128) 2^-24 <= 2^-16
# for K <= 8192.
ETA_F32 = 2.0**-16
# ETA_TENSOR_CORES (the CUDA kernels): e4m3 wgmma sums each 128-block of K in the tensor cores,
# whose accumulator keeps 13 fraction bits (an FP22: "about 14 bits" in DeepSeek-V3's report),
# then promotes it to f32 with the block scales (fma, as on the CPU). A block is four k32
# wgmmas; one 13-bit truncation of each k32 partial sum, each at most 2^-13 of P, gives 2^-11;
# 2^-9 leaves a factor 4 for the alignment of the products within a k32 step, and is what the
# exact-product tests (check_exact: y against the float64 product of hq and w_down) pass on an
# H100. tests/test_fp8_accumulation.py emulates the most pessimistic model (the partial sum's
# mantissa truncated to 13 bits after every one of a block's 128 adds) and shows these checks
# pass on its outputs with random signs and fail on planted bugs.
ETA_TENSOR_CORES = 2.0**-9
# The XLA reference's f32 products (HIGHEST) summed in any order: K roundings of partial sums
# <= P (gamma_K). Its flips against NumPy's quantization of h come from this.
REFERENCE_ETA_PER_K = 2.0**-24
# silu(g) * u in f32 (an exp, a reciprocal or division, two products: a few f32 roundings, a
# fast exp included) and the division by the block scale before the e4m3 rounding: a relative
# error of h, at most 8 roundings of 2^-24 taken twice.
H_ROUNDING = 2.0**-20
# silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))) lies in (-0.1, 1.1): |silu(a) - silu(b)| <=
# 1.1 |a - b|.
SILU_LIPSCHITZ = 1.1
# A rounding to bf16 (7 fraction bits, to nearest): at most half an ulp, 2^-8 of the value.
BF16_ROUNDING = 2.0**-8


def accumulation_eta():
  """eta of the target that jax runs on: the tensor cores' on a GPU, f32 sums on the CPU."""
  return ETA_TENSOR_CORES if jax.default_backend() == "gpu" else ETA_F32


# --- tolerances against the XLA reference ----------------------------------------------------
# Gradients against the XLA backend's: the FP8 targets' backward is the XLA reference's, after
# its own forward recomputed, so the two differ only where XLA compiled that forward
# differently (an f32 ulp in h may flip one of its e4m3 values, which moves its share of a sum
# by 2^-4 to 2^-3 of it; seen at most 3e-3 of the largest magnitude).
FP8_RTOL = 2e-2
# The mean of y's difference from the reference once the target's own flips are taken out,
# relative to the mean magnitude: the rare flips the reference's f32 sums make, and bf16
# roundings where the two round different f32 values (one bf16 ulp is 2^-8 to 2^-7 of a value;
# where the sums agree the roundings agree); a wrong scale or row moves every element of its
# rows by far more. The target's accumulation errors (eta P, mean) are allowed on top.
FP8_MEAN_RTOL = 2e-3


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
      x, e, w, *map(ops.fp8_weight, qs), shared and tuple(map(ops.fp8_weight, shared)),
      out_dtype=out_dtype, block_m=block_m))
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


def numpy_hidden(xq_rows, xq_scale, qs_gate, qs_up, eta):
  """h = silu(g) * u of quantized rows through a quantized gate and up, in float64, and how far
  a target whose sums are within eta * P of exact (P: |x| @ |w|) may put its f32 h from it:
  (h, tol), both (M, I)."""
  x = dequantize_rows(xq_rows, xq_scale)
  wg, wu = dequantize_weight(qs_gate), dequantize_weight(qs_up)
  g, u = x @ wg, x @ wu
  dg, du = eta * (np.abs(x) @ np.abs(wg)), eta * (np.abs(x) @ np.abs(wu))
  silu_g = g * 0.5 * (1 + np.tanh(g / 2))  # g sigmoid(g), overflow-free
  h = silu_g * u
  # silu(g') u' - silu(g) u = (silu(g') - silu(g)) u' + silu(g) (u' - u).
  tol = SILU_LIPSCHITZ * dg * (np.abs(u) + du) + np.abs(silu_g) * du + H_ROUNDING * np.abs(h)
  return h, tol


def e4m3_half_step(v):
  """Half the e4m3 step at |v| (in e4m3 units, the scale divided out): 2^(e - 4) in the binade
  [2^e, 2^(e + 1)), 2^-10 among the subnormals (below 2^-6, steps of 2^-9)."""
  v = np.abs(np.asarray(v, np.float64))
  return np.exp2(np.floor(np.log2(np.maximum(v, 2.0**-6))) - 4)


def _blocks(a):
  return np.asarray(a).reshape(a.shape[0], -1, BLOCK)


def assert_hq_close(data, scale_t, h, tol, what):
  """e4m3 rows (with their scales [block, row]) against h (float64): the target's f32 h lies
  within tol of h, so
  - each block's scale is within max(tol) / 448 of amax(|h|) / 448 (|max|a| - max|b|| <=
    max|a - b|), plus its f32 rounding; a block of zeros has scale 1;
  - each value, dequantized with the target's own scale, is within tol plus half the e4m3 step
    at it of h (rounding to nearest never leaves the binade of a value for a lower one). Where
    tol is small against the step, that is NumPy's value, or its neighbour where h lies within
    tol of the boundary between them (a flip)."""
  M = h.shape[0]
  got_scale = np.asarray(scale_t, np.float64)[:, :M].T
  amax, tmax = np.abs(_blocks(h)).max(-1), _blocks(tol).max(-1)
  want_scale = np.where(amax > 0, amax / 448, 1.0)
  scale_ok = np.abs(got_scale - want_scale) <= tmax / 448 + 2.0**-22 * want_scale
  scale_ok |= (amax == 0) & (got_scale * 448 <= tmax)  # h within tol of 0: any small amax
  assert scale_ok.all(), (
      f"{what} scales: {np.count_nonzero(~scale_ok)} of {scale_ok.size} out of bounds, e.g. "
      f"{got_scale[~scale_ok][:3]} for {want_scale[~scale_ok][:3]}")
  s = np.repeat(got_scale, BLOCK, axis=1)
  got = np.asarray(data).astype(np.float64)
  excess = np.abs(got * s - h) - (tol + e4m3_half_step(got) * s)
  bad = excess > 0
  assert not bad.any(), (f"{what}: {np.count_nonzero(bad)} of {bad.size} values beyond their "
                         f"bound, the worst by {excess.max():.3g} (h {h[bad][:3]})")


class Mlp(NamedTuple):
  """One expert's rows in the target's buffers, and its quantized weights."""

  what: str
  rows: np.ndarray | None  # the routed rows; None: the shared expert's (every token)
  xq: np.ndarray
  xq_scale: np.ndarray
  hq: np.ndarray
  hq_scale: np.ndarray
  y: np.ndarray  # its rows of y_routed (or y_shared)
  gate: quantize.Blocks
  up: quantize.Blocks
  down: quantize.Blocks


def mlps(case, buffers, qs, shared):
  """Each expert that holds routes, and the shared expert: a list of Mlp."""
  r = routed(buffers, case.experts.shape[1], case.experts)
  out = []
  for e in np.unique(r.expert):
    rows = r.used[r.expert == e]
    out.append(Mlp(f"expert {e}", rows, buffers.xq[rows], buffers.xq_scale[:, rows],
                   buffers.hq[rows], buffers.hq_scale[:, rows], buffers.y_routed[rows],
                   *(_expert(q, e) for q in qs)))
  if shared is not None:
    out.append(Mlp("shared", None, buffers.xq_shared, buffers.xq_shared_scale,
                   buffers.hq_shared, buffers.hq_shared_scale, buffers.y_shared, *shared))
  return out


def check_hidden(case, buffers, qs, shared, eta):
  """hq of each routed row (and the shared expert's) against h in float64 from the target's
  own xq (assert_hq_close, sums within eta * P); padding rows zeros with scale 1."""
  for m in mlps(case, buffers, qs, shared):
    h, tol = numpy_hidden(m.xq, m.xq_scale, m.gate, m.up, eta)
    assert_hq_close(m.hq, m.hq_scale, h, tol, f"hq of {m.what}")
  r = routed(buffers, case.experts.shape[1], case.experts)
  assert not u8(buffers.hq[r.padding]).any(), "hq padding rows"
  assert (buffers.hq_scale[:, r.padding] == 1).all(), "hq padding scales"


def _expert(q, e):
  return quantize.Blocks(q.blocks.data[e], q.blocks.scale[e])


def assert_product_close(got, a, b, eta, what):
  """got (bf16) against the float64 product a @ b: within eta * (|a| @ |b|) (the sums) plus
  its rounding to bf16."""
  want, size = a @ b, np.abs(a) @ np.abs(b)
  excess = np.abs(f64(got) - want) - (BF16_ROUNDING * np.abs(want) +
                                      (1 + BF16_ROUNDING) * eta * size)
  assert (excess <= 0).all(), (f"{what}: {np.count_nonzero(excess > 0)} beyond their bound, "
                               f"the worst by {excess.max():.3g}")


def combine64(rows, pos, weights, extra=None):
  """sum_j weights[t, j] rows[pos[t, j]] (+ extra[t]) in float64; pos -1: no row."""
  pos, weights = np.asarray(pos), f64(weights)
  out = np.zeros((pos.shape[0], rows.shape[1]))
  for j in range(pos.shape[1]):
    has = pos[:, j] >= 0
    out[has] += weights[has, j, None] * rows[pos[has, j]]
  return out if extra is None else out + extra


def check_outputs(case, y, buffers, qs, shared, eta):
  """y_routed of each routed row (and y_shared) against the float64 product of the target's own
  hq and w_down (assert_product_close); y against the float64 combine of those bf16 rows with
  the weights: its f32 sum (k + 1 roundings of a partial sum, 2^-24 each) and one bf16
  rounding."""
  for m in mlps(case, buffers, qs, shared):
    assert_product_close(m.y, dequantize_rows(m.hq, m.hq_scale), dequantize_weight(m.down), eta,
                         f"y of {m.what}")
  extra = None if shared is None else f64(buffers.y_shared)
  want = combine64(f64(buffers.y_routed), buffers.pos, case.weights, extra)
  size = combine64(np.abs(f64(buffers.y_routed)), buffers.pos, np.abs(f64(case.weights)),
                   None if extra is None else np.abs(extra))
  k = case.experts.shape[1]
  excess = np.abs(f64(y) - want) - (BF16_ROUNDING * np.abs(want) +
                                    (k + 2) * 2.0**-24 * size)
  assert (excess <= 0).all(), (f"y against the combine of y_routed: "
                               f"{np.count_nonzero(excess > 0)} beyond, worst {excess.max():.3g}")


def reference_flips(h, tol, data, scale):
  """How far the reference's dequantized hq may lie from NumPy's (data, scale: numpy_quantize of
  f32 h), its f32 h within tol of h: where h +- tol (with the scale that moves with amax)
  rounds to two e4m3 values, their distance; and every value by the relative change of its
  block's scale."""
  M = h.shape[0]
  amax, tmax = np.abs(_blocks(h)).max(-1), _blocks(tol).max(-1)
  rel = np.repeat(np.where(amax > 0, tmax / np.maximum(amax, 1e-300), 0.0), BLOCK, axis=1)
  s = np.repeat(np.asarray(scale, np.float64), BLOCK, axis=1)[:M]
  spread = tol + np.abs(h) * rel
  rne = lambda v: np.clip(v, -448, 448).astype(E4M3).astype(np.float64)  # noqa: E731
  apart = np.abs(rne((h + spread) / s) - rne((h - spread) / s))
  return apart * s + (np.abs(np.asarray(data, np.float64)) + apart) * s * rel


def check_end_to_end(case, y, buffers, qs, shared, want, eta):
  """y against the XLA reference's (want). Where the target's hq differs from NumPy's
  quantization of h (the reference quantizes alike from its f32 h; the differences are the
  flips check_hidden allows), y differs by their product with w_down, f, computed here; what is
  left of y - want - f is bounded elementwise by
  - the reference's own flips against NumPy (reference_flips, its sums within K 2^-24 P) times
    |w_down|, and its GEMM2 sums (I 2^-24 P);
  - the target's GEMM2 sums (eta P);
  - the bf16 roundings of the routed rows, the shared rows and y, in the target and in the
    reference (2^-8 of each), and their f32 combines;
  and on average by FP8_MEAN_RTOL of the mean |y| plus the mean of the target's eta P."""
  T, H = y.shape
  R = len(buffers.rows)
  k = case.experts.shape[1]
  flips, bound, acc = np.zeros((R, H)), np.zeros((R, H)), np.zeros((R, H))
  flips_s = bound_s = acc_s = None
  for m in mlps(case, buffers, qs, shared):
    K, I = m.gate.data.shape
    h, tol_ref = numpy_hidden(m.xq, m.xq_scale, m.gate, m.up, K * REFERENCE_ETA_PER_K)
    data, scale = numpy_quantize(h.astype(np.float32), (1, BLOCK))
    hq_np = dequantize_rows(data, scale.T)
    hq = dequantize_rows(m.hq, m.hq_scale)
    wd = dequantize_weight(m.down)
    f = (hq - hq_np) @ wd
    target_acc = eta * (np.abs(hq) @ np.abs(wd))
    sums = (reference_flips(h, tol_ref, data, scale) @ np.abs(wd) + target_acc +
            I * REFERENCE_ETA_PER_K * (np.abs(hq_np) @ np.abs(wd)))
    b = (1 + 2 * BF16_ROUNDING) * sums + BF16_ROUNDING * (2 * np.abs(f64(m.y)) + np.abs(f))
    if m.rows is None:
      flips_s, bound_s, acc_s = f, b, target_acc
    else:
      flips[m.rows], bound[m.rows], acc[m.rows] = f, b, target_acc
  w = np.abs(f64(case.weights))
  y, want = f64(y), f64(want)
  left = y - want - combine64(flips, buffers.pos, case.weights, flips_s)
  size = combine64(np.abs(f64(buffers.y_routed)), buffers.pos, w,
                   None if shared is None else np.abs(f64(buffers.y_shared)))
  limit = (combine64(bound, buffers.pos, w, bound_s) + (k + 2) * 2.0**-23 * size +
           (1 + BF16_ROUNDING) * BF16_ROUNDING * (np.abs(y) + np.abs(want)))
  excess = np.abs(left) - limit
  assert (excess <= 0).all(), (
      f"y against the reference, the target's flips taken out: {np.count_nonzero(excess > 0)} "
      f"of {excess.size} beyond their bound, the worst by {excess.max():.3g}")
  mean = np.abs(left).mean()
  allowed = FP8_MEAN_RTOL * np.abs(want).mean() + combine64(acc, buffers.pos, w, acc_s).mean()
  assert mean <= allowed, f"y against the reference: mean difference {mean:.3g} > {allowed:.3g}"


# The FP8 backward (mok_moe_bwd_fp8) rounds where the reference's does not: dgu to bf16 before
# it is quantized, each route's dx to bf16, dy quantized before the route's weight scales it,
# dweights from <dy @ w_down^T, h> rather than <dy, y_routed>. Its gradients so differ from the
# reference's by e4m3 flips (a value one e4m3 step, 2^-4 to 2^-3 of it, away), not by bits. A
# gradient passes if it is about as close to the exact one (the bf16 layer's, products
# unquantized) as the reference's is: its mean error within FP8_GRAD_SLACK of the reference's,
# and its mean difference from the reference within FP8_GRAD_SHARE of that error (seen: 0.2 for
# dx, 0.5 for dweights, 0.05 for the weight gradients, whose GEMMs are bf16 on the same rows).
# A wrong scale, row or block moves its elements by their size, far past either bound.
FP8_GRAD_SLACK = 1.1
FP8_GRAD_SHARE = 0.75


def check_fp8_grads(got, want, exact):
  """FP8 gradients (dicts by name) against the reference's FP8 ones and the exact ones."""
  for name in want:
    g, w, e = f64(got[name]), f64(want[name]), f64(exact[name])
    assert np.all(np.isfinite(g)), f"d{name}: not finite"
    size = np.abs(e).mean()
    if size == 0:  # no route reaches it (every id invalid): zeros, as the reference's
      assert not np.any(g) and not np.any(w), f"d{name}: not zero where no route reaches it"
      continue
    err, ref_err = np.abs(g - e).mean() / size, np.abs(w - e).mean() / size
    apart = np.abs(g - w).mean() / size
    assert err <= FP8_GRAD_SLACK * ref_err, (
        f"d{name}: mean error {err:.3g} of the exact gradient, the reference's {ref_err:.3g}")
    assert apart <= FP8_GRAD_SHARE * ref_err, (
        f"d{name}: mean difference {apart:.3g} from the reference, whose error is {ref_err:.3g}")


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
  y_shared within their rounding of the float64 product of hq and w_down (assert_product_close
  with the platform's accumulation_eta); y = y_routed[pos] + y_shared, rounded once."""
  y, b, qs, shared = run_target(case, block_m)
  check_gather(case, b)
  eta = accumulation_eta()
  for m in mlps(case, b, qs, shared):
    xs = dequantize_rows(m.xq, m.xq_scale)
    g, u = xs @ dequantize_weight(m.gate), xs @ dequantize_weight(m.up)
    assert g.min() >= 35  # silu(g) = g in f32
    h = (g * u).astype(np.float32)  # exact
    data, scale = numpy_quantize(h, (1, BLOCK))
    np.testing.assert_array_equal(u8(m.hq), u8(data), f"{m.what} hq")
    np.testing.assert_array_equal(np.asarray(m.hq_scale)[:, :len(h)], scale.T,
                                  f"{m.what} hq scale")
    assert_product_close(m.y, dequantize_rows(m.hq, m.hq_scale), dequantize_weight(m.down), eta,
                         f"y of {m.what}")
  want = f64(b.y_routed[b.pos[:, 0]]).astype(np.float32)
  if shared is not None:
    want = want + f64(b.y_shared).astype(np.float32)
  np.testing.assert_array_equal(f64(y), f64(jnp.asarray(want, BF16)), "y")


def reference_y(case):
  """y of the XLA reference (mok_jax.moe on backend 'xla', precision 'fp8'), computed on the
  CPU: check_end_to_end bounds its sums as f32 ones (REFERENCE_ETA_PER_K), which the CPU's dots
  are and a GPU's ragged_dot need not be."""
  config = mok_jax.Config(precision="fp8")
  cpu = jax.devices("cpu")[0]
  args, shared = jax.device_put((case.args(), case.shared), cpu)
  return np.asarray(jax.jit(lambda *a: mok_jax.moe(*a, shared=shared, config=config,
                                                   backend="xla"))(*args))


def check_target(case, y, buffers, qs, shared, want, eta=None):
  """Every check of a random case's outputs (run_target's, or an emulation's), the sums within
  eta * P (default: accumulation_eta()); want: the XLA reference's y."""
  eta = accumulation_eta() if eta is None else eta
  check_gather(case, buffers)
  check_hidden(case, buffers, qs, shared, eta)
  check_outputs(case, y, buffers, qs, shared, eta)
  check_end_to_end(case, y, buffers, qs, shared, want, eta)


def check_against_reference(case, block_m):
  """A random case through the target, checked stage by stage (check_target)."""
  check_target(case, *run_target(case, block_m), reference_y(case))


def random_case(T, H, I, E, k, Is, seed, experts=None):
  return make_case(T, H, I, E, k, Is=Is or None, dtype=BF16, seed=seed, experts=experts)


def promotion_case(T=48, H=256, I=256, E=2, k=2, seed=3):
  """A random case whose x has, in its first 128-block, one value (1024, the block's amax) and
  zeros: that block's sums are one exact product, larger than the rest of the row's, so a
  missing promotion shows as the truncation of every later add at that product's scale."""
  case = random_case(T, H, I, E, k, 0, seed)
  x = f64(case.x)
  x[:, :BLOCK], x[:, 0] = 0, 1024
  return case._replace(x=jnp.asarray(x, BF16))


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


# --- mok_quantize_weight ---------------------------------------------------------------------
def quantize_weight_cases():
  """(id, w) for mok_quantize_weight: edges in K and N (blocks the shape does not fill), N not a
  multiple of 8 and K not of 16 (the kernel's byte paths), batch dimensions of ranks 0 to 2,
  f32 with values bf16 cannot hold, and blocks of zeros, with a NaN and with a value past 448
  times the rest."""
  rng = np.random.default_rng(11)

  def normal(shape):
    return rng.standard_normal(shape).astype(np.float32) * np.exp2(
        rng.integers(-8, 8, shape[:-1] + (1,))).astype(np.float32)

  special = normal((2, 256, 384))
  special[0, :128, :128] = 0.0
  special[0, 130, 200] = np.nan
  special[1, 5, 300] = 1e30
  special[1, 200, 10] = -3e-38
  special[1, 129:, :128] *= np.float32(1e-30)
  return [("edges_bf16", jnp.asarray(normal((3, 200, 130)), jnp.bfloat16)),
          ("matrix_bf16", jnp.asarray(normal((136, 264)), jnp.bfloat16)),
          ("layers_bf16", jnp.asarray(normal((2, 3, 384, 256)), jnp.bfloat16)),
          ("specials_f32", jnp.asarray(special)),
          ("edges_f32", jnp.asarray(normal((2, 140, 390))))]


def check_quantize_weight(w):
  """ops.quantize_weight(w) on jax's default device: NumPy's bits for every matrix of the
  batch, k_major their transpose."""
  blocks, k_major = jax.jit(ops.quantize_weight)(w)
  a = np.asarray(w.astype(jnp.float32)).reshape(-1, *w.shape[-2:])
  data, scale, km = (np.asarray(v).reshape(-1, *v.shape[-2:])
                     for v in (blocks.data, blocks.scale, k_major))
  assert blocks.data.dtype == k_major.dtype == quantize.E4M3
  assert blocks.scale.shape == quantize.scale_shape(w.shape, (BLOCK, BLOCK))
  for b in range(a.shape[0]):
    want_data, want_scale = numpy_quantize(a[b], (BLOCK, BLOCK))
    np.testing.assert_array_equal(scale[b].view(np.uint32), want_scale.view(np.uint32))
    np.testing.assert_array_equal(data[b].view(np.uint8), want_data.view(np.uint8))
    np.testing.assert_array_equal(km[b].view(np.uint8), want_data.T.view(np.uint8))
