"""The memory formula of `mok_jax.ops.footprint` (README, "Memory") against what the FFI
targets actually declare, and its numbers for the benchmark shapes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import ops

SHAPES = [  # (T, H, I, E, k, Is)
    (1, 64, 64, 1, 1, 0),
    (37, 128, 192, 5, 2, 64),
    (16384, 2048, 768, 128, 8, 0),
    (4096, 7168, 2048, 256, 8, 2048),
]


def nbytes(specs):
  return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in specs)


@pytest.mark.parametrize("dims", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("block_m", [1, 128])
def test_formula_matches_declared_results(dims, dtype, block_m):
  dims = ops.MoeDims(*dims)
  n_res = len(ops.Residuals._fields)
  fwd = ops.fwd_results(dims, dtype, dtype, block_m)
  bwd = ops.bwd_results(dims, dtype, block_m)
  got = ops.footprint(dims, dtype, block_m)
  assert got.residuals == nbytes(fwd[1:1 + n_res])
  assert got.fwd_scratch == nbytes(fwd[1 + n_res:])
  assert got.bwd_scratch == nbytes(bwd[8:])


def test_qwen3_numbers():
  """The README's example: qwen3_30b in bf16 keeps about 0.9 GB of residuals per layer."""
  f = ops.footprint(ops.MoeDims(16384, 2048, 768, 128, 8, 0), jnp.bfloat16)
  R = 16384 * 8 + 128 * 127
  assert R == 147328
  assert f.residuals == 4 * (131072 + 129 + R) + 2 * (2 * R * 768 + R * 2048)
  assert 0.9e9 < f.residuals < 1.1e9
