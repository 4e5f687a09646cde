"""The checks of tests/fp8_cases.py against an emulation of the tensor cores' e4m3 sums, on the
CPU: they must pass on its outputs and fail on planted bugs.

The emulation is the most pessimistic reading of "the accumulator keeps about 14 bits": within
each 128-block of K, the products (exact) are added in k order, and each partial sum's mantissa
is truncated to 13 fraction bits after every add (128 truncations toward zero a block, where
the wgmma does at most one per k32 step and aligns its products); the block's sum is then
promoted to f32 with the block scales (fma), as the kernel does. The layout, xq and its scales
are the C++ CPU target's (checked against the reference's bits by check_gather); hq, y_routed,
y_shared and y are recomputed from them through the emulated sums.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fp8_cases
from fp8_cases import BLOCK, ETA_F32, ETA_TENSOR_CORES

BF16_NP = ml_dtypes.bfloat16


def truncate(v, bits=13):
  """v with its mantissa cut to `bits` fraction bits (toward zero)."""
  m, e = np.frexp(v)
  return np.ldexp(np.trunc(m * 2.0**(bits + 1)) / 2.0**(bits + 1), e)


def emulated_product(a, a_scale, w, promote=True, scale_of_block=None):
  """f32 (M, N): e4m3 rows a (M, K) with scales a_scale (M, K / 128) times the quantize.Blocks
  w, each 128-block summed with truncated partial sums and promoted (promote=False: one
  truncated sum over all of K of the dequantized products, no promotion). scale_of_block: the
  k-block of a's scales that block kb is promoted with (a planted bug), default kb."""
  a = np.asarray(a).astype(np.float64)
  b = np.asarray(w.data).astype(np.float64)
  b_scale = np.repeat(np.asarray(w.scale, np.float64), BLOCK, axis=1)  # (K / 128, N)
  a_scale = np.asarray(a_scale, np.float64)
  M, K = a.shape
  acc, part = np.zeros((M, b.shape[1]), np.float32), np.zeros((M, b.shape[1]))
  for kb in range(K // BLOCK):
    sa = a_scale[:, (scale_of_block or (lambda kb: kb))(kb), None]
    for kk in range(kb * BLOCK, (kb + 1) * BLOCK):
      if promote:
        part = truncate(part + a[:, kk, None] * b[None, kk])
      else:
        part = truncate(part + (a[:, kk, None] * sa) * (b[None, kk] * b_scale[kb]))
    if promote:
      scale = (sa.astype(np.float32) * b_scale[kb].astype(np.float32)).astype(np.float64)
      acc = (part * scale + acc).astype(np.float32)  # fma: one rounding
      part = np.zeros_like(part)
  return acc if promote else part.astype(np.float32)


def emulate(case, block_m=64, bug=None):
  """run_target's (y, buffers, qs, shared) with hq, y_routed, y_shared and y from the emulated
  sums, and a planted bug: None, 'block_scale' (the gate's and up's k-block 1 promoted with
  x's k-block 0 scale), 'hq_rows_swapped' (two routed rows' hq and scales swapped), 'y_rows_
  swapped' (two routed rows' y_routed swapped), 'no_promotion' (emulated_product with
  promote=False)."""
  _, b, qs, shared = fp8_cases.run_target(case, block_m)
  hq, hq_scale, y_routed = b.hq.copy(), b.hq_scale.copy(), b.y_routed.copy()
  hq_shared, hq_shared_scale, y_shared = b.hq_shared.copy(), b.hq_shared_scale.copy(), \
      b.y_shared.copy()
  promote = bug != "no_promotion"
  wrong = (lambda kb: 0 if kb == 1 else kb) if bug == "block_scale" else None
  for m in fp8_cases.mlps(case, b, qs, shared):
    M = m.xq.shape[0]
    xs = np.asarray(m.xq_scale)[:, :M].T
    g = emulated_product(m.xq, xs, m.gate, promote, wrong).astype(np.float64)
    u = emulated_product(m.xq, xs, m.up, promote, wrong).astype(np.float64)
    h = (g * 0.5 * (1 + np.tanh(g / 2)) * u).astype(np.float32)
    data, scale = fp8_cases.numpy_quantize(h, (1, BLOCK))
    y = emulated_product(data, scale, m.down, promote).astype(BF16_NP)
    if m.rows is None:
      hq_shared, y_shared = data, y
      hq_shared_scale[:, :M] = scale.T
    else:
      hq[m.rows], hq_scale[:, m.rows], y_routed[m.rows] = data, scale.T, y
  used = np.nonzero(b.rows >= 0)[0]
  first = used[:2]  # two rows of the first expert (the layout sorts by expert)
  if bug == "hq_rows_swapped":
    hq[first], hq_scale[:, first] = hq[first[::-1]], hq_scale[:, first[::-1]]
  if bug == "y_rows_swapped":
    y_routed[first] = y_routed[first[::-1]]
  y = np.zeros((case.x.shape[0], case.x.shape[1]), np.float32)
  for j in range(b.pos.shape[1]):  # the combine: f32 products and sums in j order
    has = b.pos[:, j] >= 0
    y[has] += np.asarray(case.weights)[has, j, None] * y_routed[b.pos[has, j]].astype(np.float32)
  if shared is not None:
    y += y_shared.astype(np.float32)
  b = b._replace(hq=hq, hq_scale=hq_scale, y_routed=y_routed, hq_shared=hq_shared,
                 hq_shared_scale=hq_shared_scale, y_shared=y_shared)
  return y.astype(BF16_NP), b, qs, shared


# (T, H, I, E, k, Is): k-blocks 2 and 4 deep, a shared expert, one token.
CASES = ((40, 256, 256, 3, 2, 128), (24, 512, 128, 2, 2, 0), (1, 128, 128, 1, 1, 0))


@pytest.mark.parametrize("T, H, I, E, k, Is", CASES)
def test_checks_pass_on_emulated_tensor_core_sums(T, H, I, E, k, Is):
  case = fp8_cases.random_case(T, H, I, E, k, Is, seed=T)
  out = emulate(case)
  fp8_cases.check_target(case, *out, fp8_cases.reference_y(case), ETA_TENSOR_CORES)
  # The emulated sums are far from f32 ones: the CPU twin's bound rejects them.
  with pytest.raises(AssertionError):
    fp8_cases.check_hidden(case, out[1], out[2], out[3], ETA_F32)


def test_emulated_sums_within_eta():
  """The emulated sums' error, relative to the sum of the products' magnitudes, on random
  signs: well within ETA_TENSOR_CORES (a fourth of it), above 2^-13."""
  rng = np.random.default_rng(0)
  a = rng.standard_normal((64, 512)).astype(np.float32)
  w = rng.standard_normal((512, 256)).astype(np.float32) / 16
  aq, a_scale = fp8_cases.numpy_quantize(a, (1, BLOCK))
  wq, w_scale = fp8_cases.numpy_quantize(w, (BLOCK, BLOCK))
  blocks = fp8_cases.quantize.Blocks(wq, w_scale)
  got = emulated_product(aq, a_scale, blocks).astype(np.float64)
  ad = fp8_cases.dequantize_rows(aq, a_scale.T)
  wd = fp8_cases.dequantize_weight(blocks)
  ratio = np.abs(got - ad @ wd) / (np.abs(ad) @ np.abs(wd))
  assert 2.0**-13 < ratio.max() < ETA_TENSOR_CORES / 4, ratio.max()


@pytest.mark.parametrize("bug", ["block_scale", "hq_rows_swapped", "y_rows_swapped"])
def test_checks_fail_on_planted_bugs(bug):
  case = fp8_cases.random_case(40, 256, 256, 3, 2, 128, seed=40)
  with pytest.raises(AssertionError):
    fp8_cases.check_target(case, *emulate(case, bug=bug), fp8_cases.reference_y(case),
                           ETA_TENSOR_CORES)


def test_checks_catch_a_missing_promotion():
  case = fp8_cases.promotion_case()
  want = fp8_cases.reference_y(case)
  fp8_cases.check_target(case, *emulate(case), want, ETA_TENSOR_CORES)
  with pytest.raises(AssertionError, match="hq of"):
    fp8_cases.check_target(case, *emulate(case, bug="no_promotion"), want, ETA_TENSOR_CORES)
