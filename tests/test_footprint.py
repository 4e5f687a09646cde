"""The memory formula of `mok_jax.ops.footprint` (README, "Memory") against what the FFI
targets actually declare, and its numbers for the benchmark shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import Config, ops

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
@pytest.mark.parametrize("recompute", [False, True], ids=["save", "recompute"])
def test_formula_matches_declared_results(dims, dtype, block_m, recompute):
  dims = ops.MoeDims(*dims)
  n_res = len(ops.Residuals._fields)
  fwd = ops.fwd_results(dims, dtype, dtype, block_m, recompute)
  bwd = ops.bwd_results(dims, dtype, block_m, recompute)
  got = ops.footprint(dims, dtype, block_m, recompute)
  assert got.residuals == nbytes(fwd[1:1 + n_res])
  assert got.fwd_scratch == nbytes(fwd[1 + n_res:])
  aliased = set(ops.bwd_aliases(dims, recompute).values())  # results over an operand's buffer
  assert got.bwd_scratch == nbytes(s for i, s in enumerate(bwd) if i >= 8 and i not in aliased)


@pytest.mark.parametrize("dims", SHAPES)
@pytest.mark.parametrize("recompute", [False, True], ids=["save", "recompute"])
def test_bwd_aliases_pair_like_buffers(dims, recompute):
  """Each alias joins one of mok_moe_bwd's residual operands gu, xs (and gu_shared with a
  shared expert) to the result written over it, dgu, xs (dgu_shared), of one shape and dtype:
  nothing else, and nothing with recompute."""
  dims = ops.MoeDims(*dims)
  block_m = Config().block_m
  n_res = len(ops.Residuals._fields)
  res = ops.fwd_results(dims, jnp.bfloat16, jnp.bfloat16, block_m, recompute)[1:1 + n_res]
  operands = [None] * 10 + list(res)  # dy and the forward's nine inputs, then the residuals
  results = ops.bwd_results(dims, jnp.bfloat16, block_m, recompute)
  aliases = ops.bwd_aliases(dims, recompute)
  want = {} if recompute else {13: 10, 15: 8, **({14: 11} if dims.Is else {})}
  assert aliases == want
  fields = ops.Residuals._fields
  for op, out in aliases.items():
    assert fields[op - 10] in ("gu", "gu_shared", "xs")
    assert operands[op].shape == results[out].shape and operands[op].dtype == results[out].dtype


@pytest.mark.parametrize("dims", SHAPES)
def test_recompute_moves_gu_and_xs_out_of_the_residuals(dims):
  """Recompute keeps b (2 R I + 2 T Is) + b R H bytes fewer from the forward to the backward
  (gu, gu_shared and xs), and the backward holds them as scratch instead; the forward, which
  then writes no gu, holds xs as scratch."""
  dims = ops.MoeDims(*dims)
  T, H, I, E, k, Is = dims
  R = ops.routed_rows(T * k, E, Config().block_m)
  gu, xs = 2 * (2 * R * I + 2 * T * Is), 2 * R * H
  save = ops.footprint(dims, jnp.bfloat16)
  recompute = ops.footprint(dims, jnp.bfloat16, recompute=True)
  assert save.residuals - recompute.residuals == gu + xs
  assert recompute.fwd_scratch - save.fwd_scratch == xs
  # dgu and dx_r take gu's and xs's buffers in both: the residuals', or the recomputed ones.
  assert recompute.bwd_scratch - save.bwd_scratch == gu + xs
  n_res = len(ops.Residuals._fields)
  fwd = ops.fwd_results(dims, jnp.bfloat16, jnp.bfloat16, Config().block_m, recompute=True)
  res = ops.Residuals(*fwd[1:1 + n_res])
  assert res.gu.shape == (0, 2 * I)
  assert res.gu_shared.shape == (0, 2 * Is)
  assert res.xs.shape == (0, H)
  # The forward declares xs once in each mode, as a residual (the last, fwd[n_res]) or as
  # scratch (after y_routed's), and no result takes the gu that recompute drops.
  save_fwd = ops.fwd_results(dims, jnp.bfloat16, jnp.bfloat16, Config().block_m,
                             recompute=False)
  assert save_fwd[n_res].shape == (R, H) and save_fwd[n_res + 2].shape == (0, H)
  assert fwd[n_res + 2].shape == (R, H)
  assert fwd[n_res + 1] == save_fwd[n_res + 1] == jax.ShapeDtypeStruct((R, H), jnp.bfloat16)
  assert fwd[n_res + 3:] == save_fwd[n_res + 3:]


def test_recompute_keeps_only_the_layout():
  """With recompute, the forward keeps nothing for the backward but the routing layout; each
  route's output (y_routed) is the forward's scratch in either mode."""
  dims = ops.MoeDims(4096, 7168, 2048, 256, 8, 0)
  T, H, I, E, k, _ = dims
  R = ops.routed_rows(T * k, E, Config().block_m)
  assert ops.footprint(dims, jnp.bfloat16, recompute=True).residuals == 4 * (T * k + E + 1 + R)
  assert "y_routed" not in ops.Residuals._fields


def test_qwen3_numbers():
  """The README's example: qwen3_30b in bf16 keeps about 1.0 GB of residuals per layer (block_m
  64, the default)."""
  assert Config().block_m == 64
  f = ops.footprint(ops.MoeDims(16384, 2048, 768, 128, 8, 0), jnp.bfloat16)
  R = 16384 * 8 + 128 * 63
  assert R == 139136
  assert f.residuals == 4 * (131072 + 129 + R) + 2 * (2 * R * 768 + R * 2048)
  assert 0.99e9 < f.residuals < 1.01e9


# README, "Save or recompute": residuals in bf16, save (GiB) and recompute (MiB), per bench shape.
README_RECOMPUTE = {
    (16384, 2048, 768, 128, 8): (0.93, 1.0),
    (8192, 2880, 2880, 128, 4): (0.66, 0.3),
    (8192, 4096, 14336, 8, 2): (1.03, 0.1),
    (4096, 7168, 2048, 256, 8): (1.03, 0.3),
}


@pytest.mark.parametrize("dims", README_RECOMPUTE)
def test_readme_recompute_numbers(dims):
  dims = ops.MoeDims(*dims, 0)
  save, recompute = (ops.footprint(dims, jnp.bfloat16, recompute=r).residuals
                     for r in (False, True))
  want = README_RECOMPUTE[tuple(dims[:5])]
  assert (round(save / 2**30, 2), round(recompute / 2**20, 1)) == want
